"""The results store (attnkit.eval.results): appending rows, repairing a cut-off tail, reading any file."""

from __future__ import annotations

import pytest

from attnkit import AttnkitError
from attnkit.cli import main
from attnkit.eval import provenance
from attnkit.eval.results import RESULTS_FILE, append_row, read_results, repair_tail


def test_append_repair_and_read(tmp_path):
    path = tmp_path / RESULTS_FILE
    append_row(path, {"schema": 2, "cell": "a", "score": 0.5})
    append_row(path, {"schema": 2, "cell": "b", "score": 1.0})
    with path.open("a") as fh:
        fh.write('{"schema": 2, "cell": "c')  # a row cut off while being written
    with pytest.warns(UserWarning, match="unterminated last line"):
        assert [r["cell"] for r in read_results(tmp_path)] == ["a", "b"]
    assert repair_tail(path) and not repair_tail(path)
    assert [r["cell"] for r in read_results(path)] == ["a", "b"]


@pytest.mark.parametrize("content", [
    bytes(range(256)) * 4,  # a binary file
    '{"task": "café"}\n'.encode("latin-1"),  # text in another encoding
])
def test_a_file_that_is_not_utf8_is_a_one_line_error(tmp_path, capsys, content):
    (tmp_path / RESULTS_FILE).write_bytes(content)
    with pytest.raises(AttnkitError, match="is not a results file") as info:
        read_results(tmp_path)
    message = str(info.value)
    assert str(tmp_path / RESULTS_FILE) in message and "\n" not in message
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnkit: error:") and RESULTS_FILE in err and "\n" not in err


def test_provenance():
    assert set(provenance.versions()) == {"attnkit", "torch", "transformers", "python"}
    assert "cores" in provenance.cpu_name()
    commit = provenance.git_commit()  # attnkit's own checkout, when it runs from one
    assert commit is None or len(commit) == 40
