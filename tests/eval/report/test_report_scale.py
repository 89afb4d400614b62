"""The report at 40 recipes (a synthetic results directory: tests/synthetic_results.py, no model runs), checked in
the figures and in headless Chromium: label sizes on screen, no overlapping text, facets, sorted rows, HTML tables
that do not scroll sideways, text alternatives, hidden lines listed, heatmap cells with n, and the cells where full
scored 0 named rather than dropped."""

from __future__ import annotations

import io
import json
import re
import subprocess

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text
from PIL import Image

import synthetic_results
from attnkit.eval.report.label_layout import spread
from attnkit.eval.report.page import read_report
from attnkit.eval.report.plot_budget import MOST_LINES
from attnkit.eval.report.plot_style import FONT, facets, min_font_pt
from helpers import chromium as _chromium

WINDOW = (1400, 1000)  # the browser window: the page's content is 1352 px wide
MIN_PX = 11.0  # the smallest text any figure may show on screen at that width


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    rep = read_report(synthetic_results.write(tmp_path_factory.mktemp("forty")))
    return rep, rep.write()


@pytest.fixture(scope="module")
def texts(report):
    """Every plot's drawn texts and their boxes, by file name."""
    return {p.name: drawn_texts(p.figure) for p in report[0].plots}


def drawn_texts(fig) -> list[tuple[str, object]]:
    """(text, window extent) of every text the figure draws: tick labels only of ticks inside their axis' view."""
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw_without_rendering()  # lays the figure out as drawing it does, without painting pixels
    ticks, out = set(), []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                for label in (tick.label1, tick.label2):
                    ticks.add(id(label))
                    if label.get_visible() and label.get_text().strip() and low - 1e-9 <= tick.get_loc() <= high + 1e-9:
                        out.append(label)
    out += [t for t in fig.findobj(Text) if id(t) not in ticks and t.get_visible() and t.get_text().strip()]
    return [(t.get_text(), Text.get_window_extent(t, renderer)) for t in out]  # an annotation's text, not its arrow


def overlaps(boxes) -> list[tuple[str, str]]:
    return [(a, b) for i, (a, p) in enumerate(boxes) for b, q in boxes[i + 1:]
            if min(p.x1, q.x1) - max(p.x0, q.x0) > 1 and min(p.y1, q.y1) - max(p.y0, q.y0) > 1]


def test_forty_columns_sorted(report):
    rep, _ = report
    summary = rep.summary
    assert len(summary) == 41 and sum(s["is_full"] for s in summary) == 1
    rel = [s["score_rel_full"] for s in summary]
    assert rel == sorted(rel, reverse=True)  # best first: the table, the bars and the heatmaps follow this order


def test_figures_are_faceted_and_readable(report, texts):
    rep, _ = report
    names = [p.name for p in rep.plots]
    assert names == ["score_vs_budget_passkey_1.png", "score_vs_budget_passkey_2.png",
                     "score_vs_budget_code_completion_1.png", "score_vs_budget_code_completion_2.png",
                     "needle_passkey_1.png", "needle_passkey_2.png", "needle_passkey_3.png", "needle_passkey_4.png",
                     "speed_memory.png", "pareto.png"]
    for plot in rep.plots:
        assert min_font_pt(plot.figure) >= FONT, plot.name
        width, _ = Image.open(io.BytesIO(plot.png)).size
        assert width <= WINDOW[0] - 48, plot.name  # shown at its own size: its fonts are its pixels
        assert not overlaps(texts[plot.name]), (plot.name, overlaps(texts[plot.name])[:5])
        assert len(plot.alt) > 120 and plot.name not in plot.alt
    for plot in rep.plots[:4]:
        lines = [t for t in plot.figure.legends[0].get_texts() if t.get_text() != "full"]
        assert 1 <= len(lines) <= MOST_LINES
    bars = next(p for p in rep.plots if p.name == "speed_memory.png").figure
    assert [t.get_text() for t in bars.axes[0].get_yticklabels()] == [s["label"] for s in rep.summary]
    assert "streaming@0.1 = window@0.1" in [t for t, _ in texts["pareto.png"]]  # one label for one point


def test_hidden_lines_are_listed(report):
    rep, _ = report
    (plot,) = [p for p in rep.plots if p.name.startswith("score_vs_budget_passkey") and "window" in p.alt]
    legend = {t.get_text().replace("\n", " "): h for t, h in zip(plot.figure.legends[0].get_texts(),
                                                                  plot.figure.legends[0].legend_handles)}
    assert "streaming (under window: same scores)" in legend and "window" in legend
    assert legend["streaming (under window: same scores)"].get_linewidth() > legend["window"].get_linewidth()
    assert "streaming under window" in plot.caption and "Hidden lines: streaming under window" in plot.alt


def test_heatmap_cells_carry_their_n(texts):
    cells = [t for name, boxes in texts.items() if name.startswith("needle_") for t, _ in boxes
             if re.fullmatch(r"\d\.\d\d n=\d+", t)]
    assert len(cells) == 41 * 4 * 2  # 41 columns x 4 depth bins x 2 lengths
    assert {t.split("n=")[1] for t in cells} == {"3"}  # 12 samples in 4 bins, not 12 cells of one sample


def test_cells_where_full_scored_zero_are_named(report):
    rep, page = report
    methods = [s for s in rep.summary if not s["is_full"]]
    assert all(s["ratio_cells"] == 3 and s["cells"] == 4 and s["no_ratio"] == ["passkey 2048"] for s in methods)
    text = page.read_text()
    assert "Full attention scored 0 on 1 cell (passkey 2048 tokens)" in text
    assert text.count("(no ratio: full 0)") == 40 and text.count("over 3 of 4 cells</span>") == 40


def test_the_overlap_check_sees_overlaps():
    fig = Figure(figsize=(4, 3))
    ax = fig.subplots()
    ax.annotate("snapkv@0.25", (0.5, 0.5), fontsize=FONT)
    ax.annotate("window@0.25", (0.51, 0.5), fontsize=FONT)  # the old labels at their points
    assert ("snapkv@0.25", "window@0.25") in overlaps(drawn_texts(fig))


def test_label_column_layout():
    assert spread([0.0, 5.0, 10.0], 1.0, 0.0, 20.0) == [0.0, 5.0, 10.0]  # already apart: nothing moves
    assert spread([5.0, 5.0, 5.0], 1.0, 0.0, 20.0) == [4.0, 5.0, 6.0]  # a pile spreads around its centre
    out = spread([3.0, 0.2, 0.1, 9.9, 3.1], 1.0, 0.0, 10.0)
    assert all(0.0 <= y <= 10.0 for y in out)
    ordered = sorted(out)
    assert all(b - a >= 1.0 - 1e-9 for a, b in zip(ordered, ordered[1:]))
    assert [sorted(range(5), key=lambda i: out[i])] == [[2, 1, 0, 4, 3]]  # labels keep their points' order
    assert [len(f) for f in facets(list(range(10)), 8)] == [5, 5]


PROBE = """<script>
window.addEventListener("load", function () {
  var imgs = Array.prototype.slice.call(document.images);
  var all = function (q) { return Array.prototype.slice.call(document.querySelectorAll(q)); };
  var r = {
    loaded: imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length,
    alts: imgs.map(function (i) { return i.alt; }), files: imgs.map(function (i) { return i.dataset.file; }),
    fontPx: imgs.map(function (i) { return parseFloat(i.dataset.minFontPx) * i.getBoundingClientRect().width /
                                           i.naturalWidth; }),
    pageWidth: document.documentElement.scrollWidth, window: window.innerWidth,
    tables: all("table").map(function (t) { return {cls: t.className, rows: t.tBodies[0].rows.length,
      width: t.getBoundingClientRect().width, first: t.tBodies[0].rows[0].cells[0].textContent}; }),
    captions: all("figure figcaption").map(function (c) { return c.textContent; }),
    pre: all("pre").length
  };
  var out = document.createElement("script");
  out.type = "application/json"; out.id = "probe"; out.textContent = JSON.stringify(r);
  document.body.appendChild(out);
});
</script></body>"""


def _chromium_run(page, tmp_path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--hide-scrollbars", f"--user-data-dir={tmp_path / 'chromium-profile'}",
                           f"--window-size={WINDOW[0]},{WINDOW[1]}", "--virtual-time-budget=20000", *args,
                           page.resolve().as_uri()], capture_output=True, text=True, timeout=120)


def test_page_at_forty_recipes_in_chromium(report, tmp_path):
    rep, page = report
    probe = page.with_name("probe.html")
    probe.write_text(page.read_text().replace("</body>", PROBE))  # the probe adds no visible element
    shot = tmp_path / "top.png"
    out = _chromium_run(probe, tmp_path, "--dump-dom", f"--screenshot={shot}")  # one browser run for both
    found = re.search(r'<script type="application/json" id="probe">(.*?)</script>', out.stdout, re.S)
    assert found, f"chromium gave no page (exit {out.returncode}): {out.stderr[-1500:]}"
    r = json.loads(found.group(1))
    assert r["loaded"] == len(rep.plots) and r["files"] == [p.name for p in rep.plots]
    assert r["pageWidth"] <= r["window"]  # nothing scrolls the page sideways
    assert min(r["fontPx"]) >= MIN_PX, dict(zip(r["files"], r["fontPx"]))
    assert all(len(a) > 120 and not a.endswith(".png") for a in r["alts"])  # text alternatives, not file names
    assert r["pre"] == 0
    summary, scores = r["tables"][0], [t for t in r["tables"] if t["cls"] == "scores"]
    assert summary["cls"] == "summary" and summary["rows"] == 41
    assert len(scores) == 1 and scores[0]["rows"] == 41 and scores[0]["first"] == "full"  # a row per recipe
    assert all(t["width"] <= r["window"] - 48 for t in r["tables"])
    assert sum("streaming under window" in c for c in r["captions"]) == 2  # both tasks' facets say it
    assert sum(c.startswith("Facet ") for c in r["captions"]) == 8
    image = Image.open(shot).convert("L")
    assert image.size == WINDOW, out.stderr[-1500:]
    assert sum(1 for count in image.histogram() if count) > 50  # a rendered page, not a blank one


def test_protocols_and_models_side_by_side(tmp_path):
    """Two protocols and two models: a Pareto plot and a score table per protocol, labels naming model and
    protocol, and a method's line per protocol in the score-vs-budget plot."""
    rows = []
    for r in synthetic_results.rows():  # one task and length: what differs here is the models and protocols
        if (r["method"] in ("full", "snapkv", "window") and r["task"] == "passkey" and r["budget"] in (None, 0.25, 0.75)
                and r["length"] == synthetic_results.LENGTHS[0]):
            for model in ("m1", "m2"):
                for protocol in ("query-aware", "query-agnostic"):
                    rows.append(dict(r, model=model, protocol=protocol,
                                     cell=json.dumps([model, r["task"], r["length"], r["method_spec"], protocol])))
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rep = read_report(tmp_path)
    assert [p.name for p in rep.plots if p.name.startswith("pareto")] == ["pareto_query-aware.png",
                                                                           "pareto_query-agnostic.png"]
    assert "m2 snapkv@0.25 · query-agnostic" in [s["label"] for s in rep.summary]
    text = rep.write().read_text()
    assert text.count("<table class=scores>") == 2 and "<h3>query-agnostic</h3>" in text
    legend = [t.get_text() for t in rep.plots[0].figure.legends[0].get_texts()]
    for line in ("m1 full · query-aware", "m2 full · query-agnostic", "m1 snapkv · query-aware",
                 "m2 snapkv · query-agnostic"):
        assert any(label.startswith(line) for label in legend), (line, legend)
