"""The report's score-vs-KV-budget plots: per task, a line per recipe (and protocol, when several ran) through its
budgets, a panel per prompt length, full attention as a dashed line.

Many recipes are split into facets of at most :data:`MOST_LINES` lines, one image each, recipes sorted by their
mean score (the first facet holds the best), so every line keeps its own colour and marker and the legend stays
beside its panels. Lines with the same points at a length (``streaming`` scores exactly as ``window`` on many
tasks) are kept in one facet and drawn as nested strokes -- the first drawn widest -- so that each stays visible,
and the legend, the caption and the text alternative name the line each lies under.
"""

from __future__ import annotations

import textwrap
from collections import defaultdict

from matplotlib.figure import Figure

from attnkit.eval.report.plot_style import COLOURS, FONT, LINE_STYLES, MARKERS, TITLE, WIDTH, Plot, safe_name
from attnkit.eval.stats.table import is_reference
from attnkit.validate import is_number

MOST_LINES = 8
SAME = 0.005  # scores closer than this draw as one line at the figure's size
PANELS_PER_ROW = 3
SECTION = "Score vs KV budget"


def is_full(row: dict) -> bool:
    """The row of plain full attention (no budget), the reference of its (model, task, length)."""
    return is_reference(row) and row.get("budget") is None


def budget_x(r: dict):
    """A row's x: its budget as a fraction of the prompt, or (no budget) its measured final KV relative to full."""
    b = r.get("budget")
    if is_number(b):
        if isinstance(b, float) and b <= 1:
            return b
        return b / r["length"] if r.get("length") else None
    return r.get("final_kv_ratio")


def _protocol(r: dict) -> str:
    return r.get("protocol") or "query-aware"


def _line_name(r: dict, many_models: bool, many_protocols: bool) -> str:
    """A line's name: the recipe, after its model and before its protocol where several ran."""
    name = "full" if is_full(r) else str(r.get("recipe_name") or r["label"])
    return (f"{r.get('model')} " if many_models else "") + name + (f" · {_protocol(r)}" if many_protocols else "")


def _series(rs: list[dict], many_models: bool, many_protocols: bool) -> dict[str, dict[int, list[tuple]]]:
    """Line name -> length -> its (x, score) points, sorted."""
    out: dict[str, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for r in rs:
        x = budget_x(r)
        if is_full(r) or x is None:
            continue
        out[_line_name(r, many_models, many_protocols)][r["length"]].append((x, r["score"]))
    return {name: {n: sorted(pts) for n, pts in by_length.items()} for name, by_length in out.items()}


def _same(a: list[tuple], b: list[tuple]) -> bool:
    return len(a) == len(b) and all(xa == xb and abs(ya - yb) <= SAME for (xa, ya), (xb, yb) in zip(a, b))


def _stacks(order: list[str], series: dict) -> dict[str, dict[int, list[str]]]:
    """For each line and length, the lines with the same points there, itself included, in drawing order."""
    out: dict[str, dict[int, list[str]]] = defaultdict(dict)
    for length in sorted({n for by in series.values() for n in by}):
        stacks: list[list[str]] = []
        for name in order:
            pts = series[name].get(length)
            if not pts:
                continue
            stack = next((st for st in stacks if _same(pts, series[st[0]][length])), None)
            if stack is None:
                stacks.append([name])
            else:
                stack.append(name)
        for stack in stacks:
            for name in stack:
                out[name][length] = stack
    return out


def _clusters(order: list[str], stacks: dict) -> list[list[str]]:
    """The lines in order, those drawn over each other somewhere kept together (a facet never splits them)."""
    clusters: list[list[str]] = []
    where: dict[str, int] = {}
    for name in order:
        before = [other for stack in stacks[name].values() for other in stack if other in where]
        if before:
            where[name] = where[before[0]]
            clusters[where[name]].append(name)
        else:
            where[name] = len(clusters)
            clusters.append([name])
    return clusters


def hidden_under(name: str, stacks: dict) -> tuple[list[str], list[int]]:
    """The line drawn on top of `name` with its very points (the one a reader sees), one per length where another
    is (a list: at two lengths, two lines may hide it), and those lengths; empty when `name` is on top everywhere."""
    over = {length: stack[-1] for length, stack in stacks[name].items() if stack[-1] != name}
    return list(dict.fromkeys(over.values())), sorted(over)


def _facet_runs(clusters: list[list[str]]) -> list[list[str]]:
    """Facets of near-equal size, at most :data:`MOST_LINES` lines each where no cluster is larger."""
    total = sum(len(c) for c in clusters)
    size = -(-total // -(-total // MOST_LINES))
    runs: list[list[str]] = [[]]
    for cluster in clusters:
        if runs[-1] and (len(runs[-1]) >= size or len(runs[-1]) + len(cluster) > MOST_LINES):
            runs.append([])
        runs[-1] += cluster
    return runs


def _legend_label(name: str, stacks: dict) -> str:
    above, where = hidden_under(name, stacks)
    if not above:
        return name
    at = "" if len(where) == len(stacks[name]) else f" at {', '.join(map(str, where))} tokens"
    return textwrap.fill(f"{name} (under {', '.join(above)}{at}: same scores)", 34)


def plot_score_vs_budget(rows: list[dict], task: str) -> list[Plot]:
    """The task's score-vs-budget images, a facet of at most :data:`MOST_LINES` recipes each."""
    rs = [r for r in rows if r.get("task") == task and r.get("score") is not None]
    if not rs:
        return []
    lengths = sorted({r["length"] for r in rs})
    many = (len({r.get("model") for r in rs}) > 1, len({_protocol(r) for r in rs}) > 1)
    series = _series(rs, *many)
    mean = {name: sum(y for pts in by.values() for _, y in pts) / sum(len(p) for p in by.values())
            for name, by in series.items()}
    order = sorted(series, key=lambda name: (-mean[name], name))
    stacks = _stacks(order, series)
    runs = _facet_runs(_clusters(order, stacks)) if order else [[]]
    higher = rs[0].get("higher_is_better", True)
    plots = []
    done = 0
    for k, run in enumerate(runs, start=1):
        fig = _figure(rs, run, series, stacks, lengths, many, higher)
        span = f"recipes {done + 1}-{done + len(run)} of {len(order)} by mean score" if len(runs) > 1 else ""
        fig.suptitle(f"{task}: score vs KV budget" + (f" ({span})" if span else ""), fontsize=TITLE + 1, x=0.01,
                     ha="left")  # clear of the legend at the right
        hidden = [f"{name} under {', '.join(hidden_under(name, stacks)[0])}" for name in run
                  if hidden_under(name, stacks)[0]]
        caption = "; ".join(filter(None, [span and f"Facet {k} of {len(runs)}: {span}",
                                          hidden and "lines with the same scores, drawn wider beneath narrower so that "
                                                     f"each shows: {', '.join(hidden)}"]))
        alt = (f"Line chart of {task}: score ({'0 to 1' if higher else 'bits per byte, lower is better'}) against the "
               f"KV budget as a fraction of the prompt, a panel per prompt length ({', '.join(map(str, lengths))} "
               f"tokens), a line per recipe: {', '.join(run) or 'none'}; full attention is the dashed black line."
               + (f" Hidden lines: {', '.join(hidden)}." if hidden else ""))
        name = f"score_vs_budget_{safe_name(task)}" + (f"_{k}" if len(runs) > 1 else "") + ".png"
        plots.append(Plot(SECTION, name, alt, fig, caption))
        done += len(run)
    return plots


def _figure(rs, run, series, stacks, lengths, many, higher) -> Figure:
    cols = min(PANELS_PER_ROW, len(lengths))
    nrows = -(-len(lengths) // cols)
    fulls = list(dict.fromkeys(_line_name(r, *many) for r in rs if is_full(r)))  # a dash pattern each
    labels = fulls + [_legend_label(name, stacks) for name in run]
    legend_in = sum(label.count("\n") * 1.25 + 1.75 for label in labels) * FONT / 72 + 0.6  # the legend's height
    fig = Figure(figsize=(min(WIDTH, 3.9 * cols + 3.2), max(3.4 * nrows + 0.5, legend_in)), layout="constrained")
    axes = fig.subplots(nrows, cols, squeeze=False)
    for ax in axes.flat[len(lengths):]:
        ax.axis("off")
    handles: dict[str, object] = {}
    for ax, length in zip(axes.flat, lengths):
        for r in rs:
            if is_full(r) and r["length"] == length:
                label = _line_name(r, *many)
                handles[label] = ax.axhline(r["score"], color="black", linewidth=1.2, label=label,
                                            linestyle=LINE_STYLES[(fulls.index(label) + 1) % len(LINE_STYLES)])
        for i, name in enumerate(run):
            pts = series[name].get(length)
            if not pts:
                continue
            stack = stacks[name][length]
            width = 1.6 + 1.8 * (len(stack) - 1 - stack.index(name))  # the bottom line widest, the top narrowest
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], color=COLOURS[i % len(COLOURS)],
                            marker=MARKERS[i % len(MARKERS)], linewidth=width, markersize=4 + width, zorder=2 + i)
            handles.setdefault(name, line)
        ax.set_title(f"{length} tokens", fontsize=TITLE)
        ax.set_xlim(0, 1.05)  # fixed axes, so panels and facets compare at a glance
        if higher:
            ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("KV budget (fraction of the prompt)", fontsize=FONT + 1)
        ax.set_ylabel("score" if higher else "bits per byte (lower is better)", fontsize=FONT + 1)
        ax.tick_params(labelsize=FONT)
        ax.grid(alpha=0.3)
    labels = [name if name not in series else _legend_label(name, stacks) for name in handles]
    fig.legend(list(handles.values()), labels, loc="outside right upper", fontsize=FONT, frameon=False)
    return fig
