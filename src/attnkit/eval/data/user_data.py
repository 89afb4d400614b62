"""Data users bring (``attnkit eval --data PATH``): LongBench, RULER and InfiniteBench JSONL files, told apart by
their fields, run as the tasks ``longbench:DATASET``, ``ruler:TASK`` and ``infinitebench:TASK``.

- LongBench (:mod:`attnkit.eval.data.longbench`): ``context``, ``input``, ``answers``, ``dataset``;
- RULER (:mod:`attnkit.eval.data.ruler_data`): ``input``, ``outputs`` (``answer_prefix``, ``index``, ``length``);
- InfiniteBench (:mod:`attnkit.eval.data.infinitebench`): ``context``, ``input``, ``answer`` (``options``, ``id``).

`PATH` is a file or a folder (every ``*.jsonl`` below it, as RULER writes ``{task}/validation.jsonl``); several
paths may be given. Each file holds one format (its first item decides).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.eval.data import infinitebench, longbench, ruler_data
from attnkit.eval.data.sample import Sample

PREFIXES = (longbench.PREFIX, ruler_data.PREFIX, infinitebench.PREFIX)
FAMILY_NAMES = {p[:-1]: p for p in PREFIXES}  # "longbench" -> "longbench:" (a sweep's task naming a whole format)


def _lines(path: Path) -> list[tuple[int, dict]]:
    out = []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise AttnkitError(f"cannot read the data file {path}: {exc}") from None
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise AttnkitError(f"{path} line {n} is not JSON: {exc}") from None
    if not out:
        raise AttnkitError(f"data file {path} holds no items")
    return out


def data_format(item, where: str) -> str:
    """``longbench``, ``ruler`` or ``infinitebench``, from an item's fields."""
    keys = set(item) if isinstance(item, dict) else set()
    if {"answers", "dataset"} <= keys:
        return "longbench"
    if {"input", "outputs"} <= keys:
        return "ruler"
    if {"context", "input", "answer"} <= keys:
        return "infinitebench"
    raise AttnkitError(f"{where}: not a known data format (LongBench: context, input, answers, dataset; RULER: "
                       f"input, outputs; InfiniteBench: context, input, answer), got fields {sorted(keys)}")


def load_file(path: Path):
    lines = _lines(path)
    kind = data_format(lines[0][1], f"{path} line {lines[0][0]}")
    if kind == "longbench":
        return longbench.LongBenchData.load(path)
    if kind == "ruler":
        return ruler_data.RulerData.from_lines(path, lines)
    return infinitebench.InfiniteBenchData.from_lines(path, lines)


@dataclass
class UserData:
    """The sources of one or more data paths; a task name belongs to exactly one of them."""

    sources: list = field(default_factory=list)

    @property
    def source(self) -> str:
        return ", ".join(s.source for s in self.sources)

    def tasks(self) -> list[str]:
        return [t for s in self.sources for t in s.tasks()]

    def datasets(self) -> list[str]:
        """LongBench's dataset names (for callers that name them without the prefix)."""
        return [t[len(longbench.PREFIX):] for t in self.tasks() if t.startswith(longbench.PREFIX)]

    def expand(self, name: str) -> list[str]:
        """A format's name (``longbench``, ``ruler``, ``infinitebench``) -> all its tasks here; else [name]."""
        prefix = FAMILY_NAMES.get(name)
        return [t for t in self.tasks() if t.startswith(prefix)] if prefix else [name]

    def samples(self, model, task: str, length: int, count: int, queries: int = 1) -> list[Sample]:
        for s in self.sources:
            if task in s.tasks():
                return s.samples(model, task, length, count, queries)
        raise AttnkitError(f"no data holds task {task!r}; the data ({self.source}) has {', '.join(self.tasks())}")


def load_data(paths) -> UserData:
    """Every data file of `paths` (a path, or a list of paths; a folder contributes its ``*.jsonl`` files), or
    the :class:`UserData` / LongBench data given."""
    if isinstance(paths, UserData):
        return paths
    if isinstance(paths, longbench.LongBenchData):
        return UserData([paths])
    if isinstance(paths, (str, Path)):
        paths = [paths]
    sources = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            files = sorted(p.rglob("*.jsonl"))
            if not files:
                raise AttnkitError(f"data folder {str(p)!r} holds no .jsonl files")
        elif p.is_file():
            files = [p]
        else:
            raise AttnkitError(f"data file {str(p)!r} does not exist")
        sources += [load_file(f) for f in files]
    data = UserData(sources)
    names = data.tasks()
    dup = sorted({t for t in names if names.count(t) > 1})
    if dup:
        raise AttnkitError(f"task {dup[0]!r} comes from more than one data file ({data.source}); give one of them")
    return data


def score_sample(prediction: str, sample: Sample) -> float:
    """A data item's score with its format's metric."""
    if sample.task.startswith(ruler_data.PREFIX):
        return ruler_data.score_sample(prediction, sample)
    if sample.task.startswith(infinitebench.PREFIX):
        return infinitebench.score_sample(prediction, sample)
    return longbench.score_sample(prediction, sample)
