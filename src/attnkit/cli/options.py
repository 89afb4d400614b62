"""The command line's building blocks: one-line parse errors, help that shows defaults, list options."""

from __future__ import annotations

import argparse
import math

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
