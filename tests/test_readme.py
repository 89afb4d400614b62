"""Every example in README.md runs as written.

The README's fenced blocks are taken in document order and replayed in one temporary directory:

- a block whose info string names a file (```` ```yaml file=recipe.yaml ````) is written to that file;
- a ```python block is executed (a fresh namespace, the temporary directory as working directory);
- in a ```bash block, every command starting with ``attnkit `` or ``./run `` (``\\``-continued lines
  joined) runs as ``attnkit ARGS``: the command-line entry point ``attnkit.cli.main`` called in this
  process with the same arguments (what the venv's ``attnkit`` script does, without a Python start-up per
  command) and must return 0. ``./run test`` is the suite itself and is skipped; ``./run demo`` is
  skipped as too slow for this file (it runs 144 generations, many times the rest of the README together);
  ``attnkit serve`` serves until stopped: ``tests/vllm/test_vllm_server.py`` runs it as written.

Files a command reads (``long.txt``, ``recipe.yaml``...) must be created by an earlier block of the README,
so the README is self-sufficient.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
SKIPPED = {
    ("test",): "the test suite itself",
    ("demo",): "144 generations: many times the rest of the README together, too slow for this file",
}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.M | re.S)


def readme_steps() -> list[tuple[str, str, str]]:
    """(kind, id, payload) for every runnable part of the README, in order: kind is file, python or cli."""
    steps = []
    for match in FENCE.finditer(README.read_text()):
        info, body = match.group(1).split(), match.group(2)
        lang = info[0] if info else ""
        target = next((word.removeprefix("file=") for word in info[1:] if word.startswith("file=")), None)
        line = README.read_text()[: match.start()].count("\n") + 1
        if target is not None:
            steps.append(("file", f"L{line}-{target}", f"{target}\n{body}"))
        elif lang == "python":
            steps.append(("python", f"L{line}-python", body))
        elif lang == "bash":
            for command in body.replace("\\\n", " ").splitlines():
                command = command.split("  #")[0].strip()
                if command.startswith(("attnkit ", "./run ")):
                    args = shlex.split(command)[1:]
                    steps.append(("cli", f"L{line}-{' '.join(args[:2])}", shlex.join(args)))
    return steps


STEPS = readme_steps()
def test_readme_has_examples():
    kinds = {kind for kind, _, _ in STEPS}
    assert kinds == {"file", "python", "cli"}, kinds
    assert len(README.read_text().splitlines()) <= 250


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("readme")


@pytest.mark.parametrize(("kind", "payload"), [pytest.param(kind, payload, id=step_id)
                                               for kind, step_id, payload in STEPS])
def test_readme_example(kind, payload, workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    if kind == "file":
        name, body = payload.split("\n", 1)
        Path(name).write_text(body)
        return
    if kind == "python":
        exec(compile(payload, "README.md", "exec"), {"__name__": "__readme__"})
        return
    args = shlex.split(payload)
    if tuple(args) in SKIPPED:
        pytest.skip(SKIPPED[tuple(args)])
    if args[0] == "serve":  # it serves until stopped: the vLLM tests start it as written and query it
        pytest.skip("tests/vllm/test_vllm_server.py runs this command and queries it with the OpenAI client")
    from attnkit.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as exit_:  # argparse refusals
            code = exit_.code
    assert code in (0, None), f"attnkit {payload} exited {code}:\n{err.getvalue()[-2000:]}"
    assert os.getcwd() == str(workdir)
