"""What ``attnkit tune`` shows: the rows its report reads, the Pareto plot, and the report's tune section.

- :func:`pooled_rows`: a candidate's rows of all its rounds pooled into one row per (task, length) (the samples of
  every round, each paired with full's on the same sample), for full attention and the last round's candidates:
  the rows ``DIR/report.html``'s tables and plots are drawn from (a candidate eliminated early has fewer samples
  than full's pooled row; its evidence is in the tune section instead).
- :func:`plot_tune_pareto`: cost on the target against the worst score / full (with its 95 % interval), the floor,
  the Pareto front and the winner.
- :func:`tune_section`: the choice, its evidence and intervals, every round's eliminations and why, every
  candidate's standing and the Pareto front, from ``DIR/tune.json`` and ``DIR/pareto.json``; the report
  (:func:`attnkit.eval.report.page.write_report`) adds it when a tune wrote them.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from matplotlib.figure import Figure

from attnkit.eval.run.cells import mean_present, rel_full
from attnkit.eval.stats.intervals import score_interval

POOLED_FILE = "tune_rows.jsonl"
PARETO_PNG = "pareto.png"
TARGET_HEAD = {"kv": "peak KV / full", "decode": "decode speed-up", "prefill": "prefill speed-up"}
AXIS = {"kv": ("peak KV bytes relative to full (lower is leaner)", False),
        "decode": ("decode speed relative to full (higher is faster)", True),
        "prefill": ("prefill speed relative to full (higher is faster)", True)}


def _cat(rows: list[dict], key: str) -> list | None:
    if rows[0].get(key) is None:
        return None
    return [x for r in rows for x in (r.get(key) or [])]


def pool(rows: list[dict]) -> dict:
    """The rows of one (candidate, task, length) over several rounds as one row: their samples together."""
    first = rows[0]
    scores = _cat(rows, "scores") or []
    interval = score_interval(scores)
    depths, questions = _cat(rows, "depths"), _cat(rows, "questions")
    depth = None
    if first.get("depth_scores") is not None and depths is not None:
        by_depth: dict[float, list[float]] = {}
        for d, q, s in zip(depths, questions or [0] * len(depths), scores):
            if not q and s is not None:
                by_depth.setdefault(round(float(d), 6), []).append(s)
        depth = [[d, sum(v) / len(v)] for d, v in sorted(by_depth.items())]
    key = ["tune", first.get("model"), first.get("task"), first.get("length"), first.get("recipe_name"),
           first.get("budget"), first.get("protocol"), first.get("queries"), len(scores)]
    return dict(
        first, cell=json.dumps(key), run_id="tune", samples=len(scores), scores=scores, score=mean_present(scores),
        score_interval=None if interval is None else list(interval[:2]),
        interval=None if interval is None else interval[2], depth_scores=depth, depths=depths, questions=questions,
        predictions=_cat(rows, "predictions"), seeds=_cat(rows, "seeds"),
        contexts=sum(r.get("contexts") or 0 for r in rows) if first.get("contexts") is not None else None,
        context_prefills=sum(r.get("context_prefills") or 0 for r in rows),
        prefill_tokens=sum(r.get("prefill_tokens") or 0 for r in rows),
        prefill_s=mean_present([r.get("prefill_s") for r in rows]),
        decode_tokens_per_s=mean_present([r.get("decode_tokens_per_s") for r in rows]),
        throughput_tokens_per_s=mean_present([r.get("throughput_tokens_per_s") for r in rows]),
        peak_kv_bytes=max((r["peak_kv_bytes"] for r in rows if r.get("peak_kv_bytes") is not None), default=None),
        final_kv_bytes=max((r["final_kv_bytes"] for r in rows if r.get("final_kv_bytes") is not None), default=None),
        wall_s=sum(r.get("wall_s") or 0.0 for r in rows))


def pooled_rows(evidence: dict[str, dict], finalists: list[str]) -> list[dict]:
    """Full attention's rows pooled over every round, then each finalist's, its score relative to full's pooled
    score (`evidence`: candidate -> (task, length) -> [(its row, full's row), ...], in round order)."""
    if not evidence:
        return []
    longest = max(evidence.values(), key=lambda ev: sum(len(p) for p in ev.values()))
    fulls = {key: pool([full for _, full in pairs]) for key, pairs in longest.items()}
    out = list(fulls.values())
    for cid in finalists:
        for key, pairs in evidence[cid].items():
            row = pool([r for r, _ in pairs])
            full = fulls[key] if len(pairs) == len(longest[key]) else pool([f for _, f in pairs])
            row["score_rel_full"] = rel_full(row["score"], full["score"], row.get("higher_is_better", True))
            out.append(row)
    return out


def _x(point: dict, target: str) -> float | None:
    cost = point.get("cost")
    if cost is None or cost <= 0:
        return None
    return 1.0 / cost if AXIS[target][1] else cost


def plot_tune_pareto(points: list[dict], target: str, floor: float, winner: str) -> bytes | None:
    """Every candidate's cost on the target (relative to full) against its worst score / full with that cell's
    95 % interval; the floor, the Pareto front (labelled) and the winner (a star)."""
    pts = [p for p in points if _x(p, target) is not None]
    if not pts:
        return None
    fig = Figure(figsize=(7.2, 4.8), layout="constrained")
    ax = fig.subplots()
    labelled = sorted((p for p in pts if p["pareto"] and p["candidate"] != winner), key=lambda p: _x(p, target))
    offsets = {p["candidate"]: (4, 4 if i % 2 == 0 else -11) for i, p in enumerate(labelled)}
    for p in pts:
        x, y = _x(p, target), 1.0 if p["worst_rel"] is None else p["worst_rel"]
        low, high = p.get("low"), p.get("high")
        err = None if low is None else [[max(0.0, y - low)], [max(0.0, high - y)]]
        color = "tab:red" if p["pareto"] else ("tab:gray" if p["candidate"] == "full" else "tab:blue")
        ax.errorbar([x], [y], yerr=err, fmt="o", color=color, markersize=5, capsize=2, alpha=0.85, zorder=3)
        if p["candidate"] in offsets:  # the front's labels, alternately above and below; the winner's in the legend
            ax.annotate(p["candidate"], (x, y), fontsize=9, xytext=offsets[p["candidate"]], textcoords="offset points")
    front = sorted((_x(p, target), 1.0 if p["worst_rel"] is None else p["worst_rel"]) for p in pts if p["pareto"])
    if len(front) > 1:
        ax.plot([p[0] for p in front], [p[1] for p in front], color="tab:red", linewidth=1, label="Pareto front")
    win = [p for p in pts if p["candidate"] == winner]
    if win:
        ax.scatter([_x(win[0], target)], [1.0 if win[0]["worst_rel"] is None else win[0]["worst_rel"]], marker="*",
                   s=220, color="gold", edgecolor="black", zorder=4, label=f"winner: {winner}")
    ax.axhline(floor, color="black", linestyle="--", linewidth=1, label=f"floor {floor:g}")
    ax.set_xlabel(AXIS[target][0])
    ax.set_ylabel("worst score / full over tasks and lengths")
    ax.set_title(f"{len(pts)} recipes: cost on the target vs score (red: Pareto front)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, loc="lower right")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return buf.getvalue()


def cell_text(c: dict) -> str:
    """score / full of a cell with its interval and n: ``0.98 [0.94-1.00] n=14``."""
    if c["rel"] is None:
        return "full scores 0"
    interval = "" if c["low"] is None else f" [{c['low']:.2f}-{c['high']:.2f}]"
    return f"{c['rel']:.2f}{interval} n={c['samples']}"


def target_text(s: dict | None, target: str) -> str:
    """A candidate's cost on the target as shown: peak KV relative to full (and MiB), or a speed-up."""
    if s is None or s.get("cost") is None:
        return "-"
    if target == "kv":
        kib = "" if s.get("peak_kv_bytes") is None else f" ({s['peak_kv_bytes'] / 2**20:.2f} MiB)"
        return f"{s['cost']:.2f}x{kib}"
    return f"{1.0 / s['cost']:.2f}x" if s["cost"] > 0 else "-"


def standing(log: dict) -> tuple[list[str], dict[str, str]]:
    """The candidates in the order tables show them (the last round's first, cheapest first; then those out,
    latest first) and each one's standing: the winner, in the last round, or out in round r (rule): why."""
    last = {s["candidate"]: s for entry in log["rounds"] for s in entry["summaries"]}
    out_in = {e["candidate"]: (entry["round"], e) for entry in log["rounds"] for e in entry["eliminated"]}
    final = len(log["rounds"]) + 1
    order = sorted(last, key=lambda c: (-out_in.get(c, (final, None))[0], last[c]["cost"] or 0.0))
    text = {}
    for c in order:
        if c in out_in:
            r, e = out_in[c]
            text[c] = f"out in round {r} ({e['rule']}): {e['why']}"
        else:
            text[c] = "winner" if c == log["winner"]["candidate"] else "in the last round"
    return order, text


def tune_section(base: Path, plot_dir: Path) -> list[str]:
    """The report's tune section (HTML parts), when ``base/tune.json`` holds a finished tune; else nothing."""
    path = base / "tune.json"
    if not path.is_file():
        return []
    log = json.loads(path.read_text(encoding="utf-8"))
    if not log.get("complete") or not log.get("winner"):
        return []
    st, win = log["settings"], log["winner"]
    target, esc = st["target"], html.escape
    goal = {"kv": "least peak KV bytes", "decode": "fastest decode", "prefill": "fastest prefill"}[target]
    rounds = " + ".join(str(e["samples"]) for e in log["rounds"])
    out = [f"<h2>Tune: {esc(goal)} keeping score / full &ge; {st['floor']:g}</h2>",
           f"<p class='note'>model {esc(str(st['model']))}; tasks {esc(', '.join(st['tasks']))}; lengths "
           f"{esc(', '.join(map(str, st['lengths'])))}; protocol {esc(st['protocol'])}; {len(log['candidates'])} "
           f"candidates ({len(log['skipped'])} skipped); successive halving over {len(log['rounds'])} rounds of "
           f"{esc(rounds)} fresh samples per task and length, eta {st['eta']}.</p>",
           f"<p><b>Choice: {esc(win['candidate'])}</b>: {esc(win['why'])}.</p>",
           f"<pre>{esc(json.dumps(win['recipe'], indent=1))}</pre>"]
    if win.get("summary"):
        s = win["summary"]
        body = "".join(f"<tr><td>{esc(c['task'])}</td><td>{c['length']}</td><td>{c['samples']}</td>"
                       f"<td>{_pct(c['score'])}</td><td>{_pct(c['full_score'])}</td><td>{esc(cell_text(c))}</td></tr>"
                       for c in s["cells"])
        out.append("<table><tr><th>task</th><th>length</th><th>samples</th><th>score</th><th>full</th>"
                   f"<th>score / full [95 %]</th></tr>{body}</table>")
    confirm = log.get("confirm")
    if confirm:
        s = confirm["summary"]
        verdict = "holds" if confirm["holds"] else "does not hold"
        out.append(f"<p>On {confirm['samples']} fresh samples per task and length (seeds from {confirm['seed']}) the "
                   f"floor {verdict}{' and is shown' if confirm['shown'] else ''}: "
                   f"{esc('; '.join(c['task'] + '@' + str(c['length']) + ' ' + cell_text(c) for c in s['cells']))}.</p>")
    order, status = standing(log)
    pareto_path = base / "pareto.json"
    points = json.loads(pareto_path.read_text(encoding="utf-8")) if pareto_path.is_file() else []
    front = {p["candidate"] for p in points if p.get("pareto")}
    last = {s["candidate"]: s for entry in log["rounds"] for s in entry["summaries"]}
    body = "".join(
        f"<tr><td>{esc(c)}</td><td>{last[c]['samples']}</td><td>{esc(target_text(last[c], target))}</td>"
        f"<td>{esc(worst_text(last[c]))}</td><td>{'&#9733;' if c in front else ''}</td>"
        f"<td style='text-align:left'>{esc(status[c])}</td></tr>" for c in order)
    head = TARGET_HEAD[target]
    out.append(f"<h3>Candidates</h3><table><tr><th>candidate</th><th>samples</th><th>{head}</th>"
               f"<th>worst score / full [95 %]</th><th>Pareto</th><th>standing</th></tr>{body}</table>")
    png = plot_tune_pareto(points, target, st["floor"], win["candidate"])
    if png:
        (plot_dir / "tune_pareto.png").write_bytes(png)
        out.append(f"<div><img alt='tune: {esc(head)} against the worst score relative to full, the floor, the "
                   f"Pareto front and the winner' src='data:image/png;base64,{base64.b64encode(png).decode('ascii')}'>"
                   f"</div>")
    out.append("<p class='note'>Each round runs fresh samples for the candidates left and for full on the same "
               "samples; a candidate's evidence is every round it ran. Out by <i>floor</i>: its 95 % interval of score "
               "/ full lies below the floor on some task and length; <i>dominated</i>: it is no cheaper than full; "
               "<i>halving</i>: not among the best 1/eta, ranked by meeting the floor on the point estimate, then "
               "cost (the cheapest candidate shown to meet the floor always goes on). The winner is the cheapest "
               "candidate of the last round whose interval's lower end meets the floor on every task and length "
               "(attnkit.eval.tune.rules), where the picks at the top of the page average score / full over the tasks "
               "and count final KV bytes. The tables above pool each last-round candidate's rounds.</p>")
    return out


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def worst_text(s: dict) -> str:
    """The cell of a candidate's lowest score / full, as :func:`cell_text`."""
    cells = [c for c in s["cells"] if c["rel"] is not None]
    return "full scores 0" if not cells else cell_text(min(cells, key=lambda c: c["rel"]))


def write_pareto(out_dir: Path, points: list[dict], target: str, floor: float, winner: str) -> None:
    """``pareto.json`` (every candidate's point, on the front or not) and ``pareto.png``."""
    (out_dir / "pareto.json").write_text(json.dumps(points, indent=1) + "\n", encoding="utf-8")
    png = plot_tune_pareto(points, target, floor, winner)
    if png:
        (out_dir / PARETO_PNG).write_bytes(png)
