"""The ``attnkit`` command: methods, generate, eval, tune, bench, calibrate, report, serve, demo.

:func:`main` turns what a user can get wrong into one line on stderr: bad input (an :class:`AttnkitError`,
argparse's usage errors included) exits 2, a failed read or write exits 1, Ctrl-C exits 130, and a reader
that closes the pipe early (``attnkit methods | head``) ends the command quietly.
"""

from __future__ import annotations

import os
import sys

from attnkit.cli.options import int_list, name_list
from attnkit.cli.parser import build_parser
from attnkit.cli.serve import split_passthrough
from attnkit.errors import AttnkitError
from attnkit.validate import whole

USAGE_ERROR = 2
RUNTIME_ERROR = 1
INTERRUPTED = 130  # 128 + SIGINT, as shells report a process Ctrl-C stopped
BROKEN_PIPE = 141  # 128 + SIGPIPE, as shells report a writer whose reader went away

def _set_threads(threads: int | None) -> None:
    if threads is None:
        return
    whole("--threads", threads, minimum=1)
    import torch

    torch.set_num_threads(threads)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again on the closed pipe
    (the recipe of Python's signal module documentation, "Note on SIGPIPE")."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # an in-memory stdout (tests): nothing to flush into a pipe
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """Run one ``attnkit`` command; the exit status."""
    try:
        args = split_passthrough(build_parser(), argv)
        _set_threads(getattr(args, "threads", None))
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handlers, rather than at exit
        return status
    except AttnkitError as exc:
        print(f"attnkit: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except BrokenPipeError:
        _silence_stdout()
        return BROKEN_PIPE
    except KeyboardInterrupt:
        print("attnkit: interrupted", file=sys.stderr)
        return INTERRUPTED
    except OSError as exc:  # a file that cannot be read or written: the system's reason, one line
        print(f"attnkit: error: {exc}", file=sys.stderr)
        return RUNTIME_ERROR


__all__ = ["main", "build_parser", "name_list", "int_list"]
