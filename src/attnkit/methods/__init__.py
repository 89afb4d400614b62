"""Registered attention methods, one file each (see :mod:`attnkit.methods.base` for the contract)."""

from attnkit.methods import (  # noqa: F401  (registration)
    a_shape,
    compose,
    full,
    gemfilter,
    h2o,
    keyformer,
    minference,
    select,
    share,
    snapkv,
    streaming,
    window,
)
from attnkit.methods.base import Method
from attnkit.methods.spec import METHODS, make_method, parse_method_spec

__all__ = ["METHODS", "Method", "make_method", "parse_method_spec"]
