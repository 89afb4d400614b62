"""The checks every config and method shares: whole numbers, real numbers in a range, fractions, choices.

Each check returns the value (converted where that is lossless, e.g. an int where a float is wanted) or
raises :class:`AttnkitError` with one line naming the value and what is allowed. Booleans are never
numbers here (``True`` is an ``int`` to Python, never a token count to a user).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from attnkit.errors import AttnkitError


def is_number(value) -> bool:
    """A real int or float (not a bool), NaN excluded."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not (
        isinstance(value, float) and math.isnan(value))


def is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def whole(name: str, value, minimum: int | None = 0, maximum: int | None = None, what: str = "") -> int:
    """`value` as a whole number in ``[minimum, maximum]``; `what` adds why the bound holds."""
    ok = is_whole(value) and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
    if not ok:
        bounds = (f" >= {minimum}" if minimum is not None else "") + (
            f" and <= {maximum}" if maximum is not None else "")
        raise AttnkitError(f"{name} must be a whole number{bounds}{what}, got {value!r}")
    return value


def optional_whole(name: str, value, minimum: int | None = 0, maximum: int | None = None) -> int | None:
    return None if value is None else whole(name, value, minimum, maximum)


def number(name: str, value, low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False, what: str = "") -> float:
    """`value` as a real number within the bounds (open or closed on each side); NaN and inf are refused
    unless a bound is itself infinite."""
    ok = is_number(value) and (math.isfinite(value) or (low is None or high is None))
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise AttnkitError(f"{name} must be {_range_text(low, high, low_open, high_open)}{what}, got {value!r}")
    return value


def _range_text(low, high, low_open, high_open) -> str:
    left = "" if low is None else f"{low} {'<' if low_open else '<='} "
    right = "" if high is None else f" {'<' if high_open else '<='} {high}"
    if left and right:
        return f"a number with {left}x{right}"
    if left:
        return f"a number {'>' if low_open else '>='} {low}"
    return f"a number{right}" if right else "a finite number"


def fraction(name: str, value, *, allow_zero: bool = False, allow_one: bool = True, what: str = "") -> float:
    """A fraction: ``0 < f <= 1`` by default."""
    return number(name, value, 0.0, 1.0, low_open=not allow_zero, high_open=not allow_one, what=what)


def choice(name: str, value, choices: Iterable) -> object:
    """`value` if it is one of `choices`."""
    choices = tuple(choices)
    if isinstance(value, bool) or value not in choices:
        raise AttnkitError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")
    return value


def flag(name: str, value) -> bool:
    """A real bool (``1`` or ``"yes"`` are not flags in Python code)."""
    if not isinstance(value, bool):
        raise AttnkitError(f"{name} must be True or False, got {value!r}")
    return value


def text(name: str, value, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise AttnkitError(f"{name} must be a {'' if empty else 'non-empty '}string, got {value!r}")
    return value


def per_layer(name: str, value, check) -> object:
    """One value or a non-empty list of them (one per layer), each passed through ``check(name, item)``."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise AttnkitError(f"{name} is an empty list; give one value per layer or a single value")
        return [check(name, item) for item in value]
    return check(name, value)


def one_of_two(first: str, a, second: str, b, *, required: str | None = None) -> None:
    """At most one of two alternative parameters (exactly one when `required` says what is needed)."""
    if a is not None and b is not None:
        raise AttnkitError(f"give {first} or {second}, not both; got {first}={a!r} and {second}={b!r}")
    if required and a is None and b is None:
        raise AttnkitError(required)
