"""The attnkit command line: methods, generate --json, bench, one-line errors."""

import json

from attnkit.cli import main
from helpers import SMALL

MODEL = f"random:llama:{SMALL}"


def test_methods_lists_parameters(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "full" in out and "window" in out and "window = 1024" in out


def test_generate_json(capsys):
    assert main(["generate", "--model", MODEL, "--prompt", "hello", "--max-new-tokens", "5", "--method", "window",
                 "--param", "window=8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"text", "token_ids", "stats"}
    assert len(data["token_ids"]) <= 5
    assert data["stats"]["method"] == "window(window=8)"
    assert data["stats"]["prompt_tokens"] == 6  # BOS + 5 bytes


def test_generate_recipe_and_prompt_file(tmp_path, capsys):
    recipe = tmp_path / "r.json"
    recipe.write_text('{"method": "window", "params": {"window": 4}}')
    prompt = tmp_path / "p.txt"
    prompt.write_text("some prompt text")
    assert main(["generate", "--model", MODEL, "--prompt-file", str(prompt), "--recipe", str(recipe),
                 "--max-new-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["method"] == "window(window=4)"


def test_errors_are_one_line(capsys):
    assert main(["generate", "--model", MODEL, "--prompt", "hi", "--method", "window", "--param", "window=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnkit: error:") and "window must be a positive" in err and "\n" not in err
    assert main(["generate", "--model", MODEL, "--prompt", "", "--json"]) == 2
    assert "empty" in capsys.readouterr().err
    assert main(["generate", "--model", "random:bert", "--prompt", "x"]) == 2
    assert "unknown random architecture 'bert'" in capsys.readouterr().err


def test_bench_reports_ratios(capsys):
    assert main(["bench", "--model", MODEL, "--context", "300", "--new-tokens", "6", "--methods",
                 "full,window:window=64", "--repeats", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in rows] == ["full", "window:window=64"]
    full, win = rows
    assert full["kv_ratio"] == 1.0
    assert win["final_kv_bytes"] * (306 / 64) == full["final_kv_bytes"]
    assert win["prefill_speedup"] > 0 and win["decode_speedup"] > 0
    for extra in ([], ["--speculate", "prompt_lookup"]):  # one new token: no decoding step to time
        assert main(["bench", "--model", MODEL, "--context", "300", "--new-tokens", "1", *extra]) == 2
        err = capsys.readouterr().err
        assert "--new-tokens must be a whole number >= 2" in err and "got 1" in err
