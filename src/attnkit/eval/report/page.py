"""``attnkit report DIR``: one self-contained HTML page and its PNG plots, from ``DIR/results.jsonl`` alone.

What it shows, per (recipe, budget) -- a *column* such as ``snapkv@0.25``, and its protocol when several ran
(``snapkv@0.25 · query-agnostic``) -- against ``full`` on the same model, task, length and protocol
(:mod:`attnkit.eval.report.summary`):

- "Which method should I use?": per column, the mean score relative to full with its 95 % interval and
  its rank (columns whose intervals overlap share a rank: :mod:`attnkit.eval.stats.significance`), the median
  prefill and decode speed-ups and KV-memory ratios, whether it is on the Pareto front of score vs decode
  speed, and the picks per protocol (fastest decoding / least KV memory *shown* to keep at least 95 % and
  90 % of full's score: the interval's lower end at or above the level); cells where full scored 0 have no
  ratio, and the page names them and says how many cells each mean covers;
- the score tables (:mod:`attnkit.eval.report.score_table`): a row per column, every score with its sample count and
  95 % interval, greyed where its difference from full is inside the noise;
- plots (:mod:`attnkit.eval.report.plots`): score vs KV budget per method for each task, a needle heatmap (depth x
  length, every cell with its n) per column for each needle task, speed and memory relative to full, and score
  vs decode speed with the Pareto front; each with a text alternative saying what it shows.

The page stays readable at 40 columns and more: tables grow downwards, not sideways; figures keep their width and
text size and split into facets instead (:mod:`attnkit.eval.report.plot_style`). The PNGs are written beside the page
(``DIR/report/``) and embedded in it as base64, so the page is one file. ``summary.csv`` / ``summary.json`` hold
the summary table. Rows of an older results schema are read (missing fields count as absent); a newer schema is
refused (:func:`attnkit.eval.run.results.read_results`).
"""

from __future__ import annotations

import csv
import html
import json
from dataclasses import dataclass
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.eval.report.parts import CSS, capacity_section, figure, no_ratio_note, provenance, summary_table
from attnkit.eval.report.plot_style import Plot
from attnkit.eval.report.plots import figures
from attnkit.eval.report.score_table import score_tables
from attnkit.eval.report.summary import enrich, summarize
from attnkit.eval.report.tune_section import tune_section
from attnkit.eval.run.results import latest_rows, read_results
from attnkit.eval.stats.significance import picks

__all__ = ["REPORT_FILE", "PLOT_DIR", "Report", "enrich", "read_report", "summarize", "write_report"]

REPORT_FILE = "report.html"
PLOT_DIR = "report"
PLOT_PREFIXES = ("score_vs_budget_", "needle_", "speed_memory", "pareto")  # the names of the plots' PNGs
SUMMARY_FIELDS = ["label", "recipe", "budget", "cells", "score_rel_full", "prefill_speedup", "decode_speedup",
                  "decode_tokens_per_s", "peak_kv_ratio", "final_kv_ratio", "pareto", "protocol", "samples", "rel_low",
                  "rel_high", "rank", "ratio_cells"]

SUMMARY_NOTE = (
    "<p class='note'>score / full: mean over the method's cells of its score relative to full on the same task, "
    "length and protocol (below 1 is worse; for the bits-per-byte tasks, perplexity and continuation, full's bits per "
    "byte over the method's), with its 95 % "
    "bootstrap interval (every cell's samples resampled; grey: the interval holds 1, the method is not "
    "distinguishable from full). rank: 1 + the columns whose interval lies wholly above this one's (=: shared). The "
    "picks above count a method only where the interval's lower end reaches the level. Speed-ups and KV ratios: "
    "medians over cells, against full on the same cell (above 1 is faster; below 1 is less memory). Pareto "
    "&#9733;: no other column is both faster and better.</p>")


def _write_summary(page_dir: Path, summary: list[dict]) -> None:
    with open(page_dir / "summary.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=SUMMARY_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(summary)
    (page_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n", encoding="utf-8")


@dataclass
class Report:
    """A results directory read and drawn, not yet written: its rows (with their ratios to full), the summary lines
    and the plots."""

    base: Path
    rows: list[dict]
    summary: list[dict]
    plots: list[Plot]

    def write(self, out: str | Path | None = None) -> Path:
        """Write the HTML page (default ``DIR/report.html``), its PNGs (``report/`` beside it) and ``summary.csv`` /
        ``summary.json``; returns the page's path."""
        page = Path(out) if out is not None else self.base / REPORT_FILE
        page.parent.mkdir(parents=True, exist_ok=True)
        plot_dir = page.parent / PLOT_DIR
        plot_dir.mkdir(exist_ok=True)
        for plot in self.plots:
            (plot_dir / plot.name).write_bytes(plot.png)
        written = {plot.name for plot in self.plots} | {"capacity.png"}
        for old in plot_dir.glob("*.png"):  # a facet an earlier report drew and this one does not
            if old.name not in written and old.name.startswith(PLOT_PREFIXES):
                old.unlink()
        _write_summary(page.parent, self.summary)
        summary = self.summary
        parts = [f"<!DOCTYPE html><html lang=en><head><meta charset='utf-8'><title>attnkit report: "
                 f"{html.escape(str(self.base))}</title><style>{CSS}</style></head><body>",
                 "<h1>attnkit report</h1>", f"<p class='note'>{provenance(self.rows)}</p>",
                 "<h2>Which method should I use?</h2><ul>",
                 "".join(f"<li>{html.escape(p)}</li>" for p in picks(summary)), "</ul>", summary_table(summary),
                 SUMMARY_NOTE, no_ratio_note(summary),
                 "<h2>Scores</h2>", score_tables(self.rows, [s["label"] for s in summary])]
        parts += capacity_section(self.base, plot_dir)
        parts += tune_section(self.base, plot_dir)
        section = None
        for plot in self.plots:
            if plot.section != section:
                parts.append(f"<h2>{html.escape(plot.section)}</h2>")
                section = plot.section
            parts.append(figure(plot))
        parts.append("</body></html>")
        page.write_text("\n".join(parts), encoding="utf-8")
        return page


def read_report(results_dir: str | Path) -> Report:
    """The report of ``DIR/results.jsonl`` (or of a results file), drawn but not written."""
    results_dir = Path(results_dir)
    rows = latest_rows(read_results(results_dir))
    if not rows:
        raise AttnkitError(f"{results_dir}: the results file holds no rows")
    rows, _ = enrich(rows)
    summary = summarize(rows)
    return Report(results_dir if results_dir.is_dir() else results_dir.parent, rows, summary, figures(rows, summary))


def write_report(results_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the HTML page (default ``DIR/report.html``), its PNGs (``DIR/report/``) and
    ``DIR/summary.csv`` / ``summary.json`` from ``DIR/results.jsonl``; returns the page's path."""
    return read_report(results_dir).write(out)
