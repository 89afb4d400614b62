"""The speculative-decoding options of ``generate`` and ``bench``: one flag per field of
:class:`attnkit.speculative.SpeculativeConfig` (its help, type and choices come from the field), read
back into a config, which refuses draft or loop options given without ``--speculate``."""

from __future__ import annotations

import argparse

from attnkit.speculative.config import SpeculativeConfig, command_line_options, from_arguments


def add_speculation_options(parser: argparse.ArgumentParser) -> None:
    """The speculation flags (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
    Decoding", arXiv:2211.17192): lossless, the output is distributed as without them."""
    g = parser.add_argument_group("speculative decoding (lossless: output distributed as without it)")
    for flag, keywords in command_line_options():
        g.add_argument(flag, **keywords)


def speculation_from_options(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The config of the speculation flags (None without ``--speculate``), checked before any model loads."""
    return from_arguments(args)
