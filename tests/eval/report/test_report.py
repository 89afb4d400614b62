"""`attnkit report`: the HTML page and PNGs regenerate from results alone, old and new schemas, Chromium renders it."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from attnkit import AttnkitError
from attnkit.cli import main
from attnkit.eval.report.page import enrich, summarize, write_report
from attnkit.eval.run import results as results_store
from helpers import chromium as _chromium
from helpers import fresh_dir as _fresh_dir

PLOTS = {"score_vs_budget_passkey.png", "score_vs_budget_code_completion.png", "needle_passkey.png",
         "speed_memory.png", "pareto.png"}


@pytest.fixture(scope="module")
def written(report_sweep, tmp_path_factory):
    """A directory holding only the results file, and the report written from it (once for the module)."""
    d = _fresh_dir(tmp_path_factory.mktemp("report"), report_sweep)
    return d, write_report(d)


def test_report_from_results_alone(written):
    d, page = written
    assert page == d / "report.html"
    assert {p.name for p in (d / "report").iterdir()} == PLOTS
    for png in (d / "report").iterdir():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = page.read_text()
    assert text.count("data:image/png;base64,") == len(PLOTS)
    assert "src='http" not in text and "<link" not in text  # self-contained
    assert "Which method should I use?" in text and "snapkv@0.25" in text
    summary = json.loads((d / "summary.json").read_text())
    assert {s["label"] for s in summary} == {"full", "snapkv@0.25", "snapkv@0.5", "window@0.25", "window@0.5"}
    assert (d / "summary.csv").read_text().startswith("label,recipe,budget,cells,")
    first = page.read_bytes()
    write_report(d)  # regenerating gives the same page
    assert page.read_bytes() == first


def test_summary_numbers(report_sweep):
    rows, _ = enrich(results_store.read_results(report_sweep))
    summary = {s["label"]: s for s in summarize(rows)}
    full = summary["full"]
    assert full["decode_speedup"] == 1.0 and full["final_kv_ratio"] == 1.0 and full["cells"] == 4
    assert summary["window@0.25"]["final_kv_ratio"] < summary["window@0.5"]["final_kv_ratio"] < 1
    assert any(s["pareto"] for s in summary.values())


def test_other_schema_versions(report_sweep, tmp_path):
    rows = [json.loads(line) for line in report_sweep.read_text().splitlines()]
    old = tmp_path / "old"
    old.mkdir()
    with open(old / results_store.RESULTS_FILE, "w") as fh:  # schema 1: before recipes, budgets and depth scores
        for row in rows:
            row = {k: v for k, v in row.items() if k not in ("schema", "recipe", "recipe_name", "budget", "cell",
                                                              "depth_scores")}
            fh.write(json.dumps(row) + "\n")
    read = results_store.read_results(old)
    assert all(r["schema_read"] == 1 and r["recipe_name"] == r["method_spec"] for r in read)
    assert write_report(old).is_file()
    new = tmp_path / "new"
    new.mkdir()
    rows[3]["schema"] = results_store.SCHEMA + 1
    (new / results_store.RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(AttnkitError, match=rf"line 4: results schema {results_store.SCHEMA + 1} is newer than this attnkit reads"):
        write_report(new)
    (new / results_store.RESULTS_FILE).write_text("{broken\n")
    with pytest.raises(AttnkitError, match="line 1 is not a JSON row"):
        results_store.read_results(new)
    (new / results_store.RESULTS_FILE).write_text("")
    with pytest.raises(AttnkitError, match="holds no rows"):
        write_report(new)


def test_report_cli(report_sweep, tmp_path, capsys):
    d = _fresh_dir(tmp_path, report_sweep)
    assert main(["report", str(d), "--out", str(tmp_path / "page" / "r.html")]) == 0
    assert (tmp_path / "page" / "r.html").is_file() and (tmp_path / "page" / "report" / "pareto.png").is_file()
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "no results file" in capsys.readouterr().err


CHECK_IMAGES = """<script>
window.addEventListener("load", function () {
  var images = Array.prototype.slice.call(document.images);
  var ok = images.map(function (i) { return i.complete && i.naturalWidth > 0 && i.naturalHeight > 0 ? 1 : 0; });
  document.body.setAttribute("data-loaded", ok.join(","));
});
</script></body>"""


def _render(page: Path, tmp_path: Path) -> list[int]:
    """Whether each picture of `page` loaded in Chromium (1 or 0), in document order."""
    probe = page.with_name("probe.html")
    probe.write_text(page.read_text().replace("</body>", CHECK_IMAGES))
    out = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                          f"--user-data-dir={tmp_path / 'chromium-profile'}", "--virtual-time-budget=10000",
                          "--dump-dom", probe.resolve().as_uri()], capture_output=True, text=True, timeout=90)
    found = re.search(r'data-loaded="([01,]*)"', out.stdout)
    assert found, f"chromium gave no page (exit {out.returncode}): {out.stderr[-1500:]}"
    return [int(x) for x in found.group(1).split(",") if x]


def test_page_renders_in_chromium(written, tmp_path):
    _, page = written
    # the page, then one more picture that is not a PNG: the check must see that one broken
    broken = "<img alt='not a PNG' src='data:image/png;base64,AAAA'>"
    probe = tmp_path / "report.html"
    probe.write_text(page.read_text().replace("</body>", broken + "</body>"))
    assert _render(probe, tmp_path) == [1] * len(PLOTS) + [0]
