"""Registered attention methods, one file each (see :mod:`attnkit.methods.base` for the contract).

Each class is exported under the name of its registry entry: ``make_method("h2o", ...)`` builds an
:class:`H2O`, ``"a_shape"`` an :class:`AShape`, ``"minference_static"`` an :class:`MInferenceStatic`.
"""

from attnkit.methods.a_shape import AShape
from attnkit.methods.base import Method
from attnkit.methods.cam import CaM
from attnkit.methods.cap import Cap
from attnkit.methods.compactor import Compactor
from attnkit.methods.compose import Compose
from attnkit.methods.cur import CUR
from attnkit.methods.duo_attention import DuoAttention
from attnkit.methods.expected_attention import ExpectedAttention
from attnkit.methods.fastkvzip import FastKVzip
from attnkit.methods.finch import Finch
from attnkit.methods.full import Full
from attnkit.methods.gemfilter import GemFilter
from attnkit.methods.h2o import H2O
from attnkit.methods.keydiff import KeyDiff
from attnkit.methods.keyformer import Keyformer
from attnkit.methods.kivi import Kivi
from attnkit.methods.knorm import KNorm
from attnkit.methods.kvcompose import KVCompose
from attnkit.methods.kvgrad import KVgrad
from attnkit.methods.kvzap import KVzap
from attnkit.methods.kvzip import KVzip
from attnkit.methods.lagkv import LagKV
from attnkit.methods.leverage import Leverage
from attnkit.methods.lukv import LUKV
from attnkit.methods.minference import MInference, MInferenceStatic
from attnkit.methods.non_causal_attention import NonCausalAttention
from attnkit.methods.observed_attention import ObservedAttention
from attnkit.methods.qfilter import QFilter
from attnkit.methods.quest import Quest
from attnkit.methods.random_scores import Random
from attnkit.methods.restorekv import RestoreKV
from attnkit.methods.rkv import RKV
from attnkit.methods.select import Select
from attnkit.methods.share import Share
from attnkit.methods.simlayerkv import SimLayerKV
from attnkit.methods.snapkv import SnapKV
from attnkit.methods.spec import METHODS, make_method, parse_method_spec
from attnkit.methods.streaming import Streaming
from attnkit.methods.think import Think
from attnkit.methods.tova import TOVA
from attnkit.methods.triattention import TriAttention
from attnkit.methods.window import Window

__all__ = ["METHODS", "Method", "make_method", "parse_method_spec", "AShape", "CaM", "Cap", "Compactor", "Compose", "CUR",
           "DuoAttention", "ExpectedAttention", "FastKVzip", "Finch", "Full", "GemFilter", "H2O", "KeyDiff", "Keyformer", "Kivi",
           "KNorm", "KVCompose", "KVgrad", "KVzap", "KVzip", "LagKV", "Leverage", "LUKV", "MInference", "MInferenceStatic", "NonCausalAttention",
           "ObservedAttention", "QFilter", "Quest", "Random", "RestoreKV", "RKV", "Select", "Share", "SimLayerKV", "SnapKV", "Streaming",
           "Think", "TOVA", "TriAttention", "Window"]
