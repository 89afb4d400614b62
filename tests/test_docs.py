"""The documents' links resolve in a checkout: every relative link of README.md, docs/*.md and training/*.md names a file
that is in the repository (raw results under docs/results are committed, not left on one machine)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(doc: Path) -> list[str]:
    links = (m.group(1).split("#")[0] for m in LINK.finditer(doc.read_text()))
    return [link for link in links if link and not re.match(r"[a-z]+:", link)]


def test_every_relative_link_of_the_documents_names_a_file_of_the_checkout():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "training").glob("*.md"))]
    missing = [f"{doc.relative_to(ROOT)}: {link}" for doc in docs for link in relative_links(doc)
               if not (doc.parent / link).exists()]
    assert not missing, "links to files not in the checkout:\n" + "\n".join(missing)


def test_the_link_check_sees_a_missing_file(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("[a](results/a.txt) [b](https://example.org/b) [c](#section) [d](doc.md#top)")
    assert relative_links(doc) == ["results/a.txt", "doc.md"]
    assert not (tmp_path / "results/a.txt").exists()
