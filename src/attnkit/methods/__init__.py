"""Registered attention methods, one file each (see :mod:`attnkit.methods.base` for the contract)."""

from attnkit.methods import full, h2o, keyformer, snapkv, streaming, window  # noqa: F401  (registration)
from attnkit.methods.base import METHODS, Method, make_method, parse_method_spec

__all__ = ["METHODS", "Method", "make_method", "parse_method_spec"]
