"""Registered attention methods, one file each (see :mod:`attnkit.methods.base` for the contract).

Each class is exported under the name of its registry entry: ``make_method("h2o", ...)`` builds an
:class:`H2O`, ``"a_shape"`` an :class:`AShape`, ``"minference_static"`` an :class:`MInferenceStatic`.
"""

from attnkit.methods.a_shape import AShape
from attnkit.methods.base import Method
from attnkit.methods.compose import Compose
from attnkit.methods.cur import CUR
from attnkit.methods.duo_attention import DuoAttention
from attnkit.methods.expected_attention import ExpectedAttention
from attnkit.methods.full import Full
from attnkit.methods.gemfilter import GemFilter
from attnkit.methods.h2o import H2O
from attnkit.methods.keydiff import KeyDiff
from attnkit.methods.keyformer import Keyformer
from attnkit.methods.kivi import Kivi
from attnkit.methods.knorm import KNorm
from attnkit.methods.kvzap import KVzap
from attnkit.methods.kvzip import KVzip
from attnkit.methods.lagkv import LagKV
from attnkit.methods.minference import MInference, MInferenceStatic
from attnkit.methods.observed_attention import ObservedAttention
from attnkit.methods.quest import Quest
from attnkit.methods.random_scores import Random
from attnkit.methods.rkv import RKV
from attnkit.methods.select import Select
from attnkit.methods.share import Share
from attnkit.methods.snapkv import SnapKV
from attnkit.methods.spec import METHODS, make_method, parse_method_spec
from attnkit.methods.streaming import Streaming
from attnkit.methods.tova import TOVA
from attnkit.methods.triattention import TriAttention
from attnkit.methods.window import Window

__all__ = ["METHODS", "Method", "make_method", "parse_method_spec", "AShape", "Compose", "CUR", "DuoAttention",
           "ExpectedAttention", "Full", "GemFilter", "H2O", "KeyDiff", "Keyformer", "Kivi", "KNorm", "KVzap", "KVzip",
           "LagKV", "MInference", "MInferenceStatic", "ObservedAttention", "Quest", "Random", "RKV", "Select", "Share",
           "SnapKV", "Streaming", "TOVA", "TriAttention", "Window"]
