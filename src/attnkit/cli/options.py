"""The command line's building blocks: one-line parse errors, help that shows defaults, list options,
and options generated from a dataclass's fields."""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing

from attnkit.errors import AttnkitError
from attnkit.validate import number


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, except where there is none to show (None, a flag's
    False) or the text already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("%(default)" in text or not action.option_strings
                or action.default is None or action.default is False or action.default is argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one-line :class:`AttnkitError` s (the caller prints them),
    not a usage block and an exit; its subcommand parsers are Parsers with the same formatter."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise AttnkitError(f"{message} (see `{self.prog} --help`)")


def name_list(text: str, what: str) -> list[str]:
    """"a, b,c" -> ["a", "b", "c"] (a comma-separated option such as --tasks)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise AttnkitError(f"{what} is empty")
    return names


def int_list(text: str, what: str, minimum: int | None = None) -> list[int]:
    """"1024, 2048" -> [1024, 2048]; every value at least `minimum` when given."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise AttnkitError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values:
        raise AttnkitError(f"{what} is empty")
    bad = [v for v in values if minimum is not None and v < minimum]
    if bad:
        raise AttnkitError(f"{what} must hold whole numbers >= {minimum}, got {bad[0]} in {text!r}")
    return values


def positive_finite(name: str, value: float) -> float:
    """A real number > 0 (NaN and infinity refused: float() reads both from the command line)."""
    if not math.isfinite(value):
        raise AttnkitError(f"{name} must be a finite number > 0, got {value!r}")
    return number(name, value, 0.0, None, low_open=True)


def _unwrap_optional(hint) -> tuple[object, bool]:
    """``int | None`` -> ``(int, True)``; any other hint -> ``(hint, False)``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0], True
    return hint, False


def _field_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def add_dataclass_options(parser, cls, *, exclude: typing.Iterable[str] = ()) -> None:
    """One option per field of dataclass `cls`: ``--field-name``, typed by the field's annotation (int,
    float, str, a Literal's values as choices, each optionally ``| None``), bools as flags (``store_true``,
    or ``--x/--no-x`` when the default is True), help from ``metadata["help"]``, ``metadata["metavar"]``
    when given; a field without a default is a required option. :func:`dataclass_from_options` reads
    them back."""
    hints = typing.get_type_hints(cls)
    skip = set(exclude)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        hint, _ = _unwrap_optional(hints[f.name])
        default = _field_default(f)
        kwargs: dict = {"dest": f.name, "help": f.metadata.get("help")}
        if kwargs["help"] is None:
            raise AttnkitError(f"{cls.__name__}.{f.name} has no metadata help for its command-line option")
        if default is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        if hint is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if default is True else "store_true"
        elif typing.get_origin(hint) is typing.Literal:
            choices = typing.get_args(hint)
            kwargs.update(choices=choices, type=type(choices[0]))
        elif hint in (int, float, str):
            kwargs["type"] = hint
        else:
            raise AttnkitError(f"{cls.__name__}.{f.name}: type {hints[f.name]} has no command-line form "
                               f"(bool, int, float, str or a Literal, optionally | None)")
        if "metavar" in f.metadata:
            kwargs["metavar"] = f.metadata["metavar"]
        parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)


def dataclass_from_options(cls, args: argparse.Namespace, *, exclude: typing.Iterable[str] = ()):
    """The `cls` instance of the options :func:`add_dataclass_options` added (its own checks run)."""
    skip = set(exclude)
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.init and f.name not in skip})
