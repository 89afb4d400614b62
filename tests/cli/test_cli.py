"""The attnkit command line: methods, generate --json, bench, --speculate and its draft options, one-line errors,
help, pipes and Ctrl-C."""

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import attnkit
import attnkit.cli.commands as commands_module
import attnkit.cli.parser as parser_module
from attnkit import AttnkitError
from attnkit.cli import build_parser, int_list, main, name_list
from attnkit.eval.data.task_registry import ALL_TASKS
from attnkit.methods.spec import split_spec_list
from helpers import SMALL

MODEL = f"random:llama:{SMALL}"


def test_methods_lists_parameters(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "full" in out and "window" in out and "window = 1024" in out
    # each method's kvpress counterpart, or none
    from attnkit.methods.spec import METHODS
    assert out.count("    kvpress: ") == len(METHODS)
    assert "snapkv" in out.split("    kvpress: SnapKVPress")[0].rsplit("\n", 2)[-2]
    assert "    kvpress: RandomPress" in out and "    kvpress: none" in out


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


# ---- generate --prompts-file: a batch of prompts from a JSONL file --------------------------------------------

PROMPT_LINES = ['{"id": "a", "prompt": "abcabcabc abc"}', "", '{"prompt": [1, 70, 71, 72, 73], "id": 7, "tag": [1]}',
                '{"id": "c", "prompt": "a longer prompt than the others"}']


def _prompts_file(tmp_path, lines=PROMPT_LINES, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("batch", [[], ["--batch-size", "2"]])
def test_generate_prompts_file_json(tmp_path, capsys, small_llama, batch):
    """One JSON line per prompt, in file order, with the line's other keys; each prompt's tokens are those it
    gets alone, whatever the batch size."""
    assert main(["generate", "--model", MODEL, "--prompts-file", _prompts_file(tmp_path), "--max-new-tokens", "5",
                 "--method", "window:window=8", "--json", *batch]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["index"] for r in out] == [0, 1, 2]
    assert [set(r) for r in out] == [{"index", "id", "text", "token_ids", "stats"},
                                     {"index", "id", "tag", "text", "token_ids", "stats"},
                                     {"index", "id", "text", "token_ids", "stats"}]
    assert [r["id"] for r in out] == ["a", 7, "c"] and out[1]["tag"] == [1]
    alone = [attnkit.generate(small_llama, p, "window", params={"window": 8}, max_new_tokens=5)
             for p in ("abcabcabc abc", [1, 70, 71, 72, 73], "a longer prompt than the others")]
    assert [r["token_ids"] for r in out] == [g.token_ids for g in alone]
    assert [r["text"] for r in out] == [g.text for g in alone]
    assert [r["stats"]["prompt_tokens"] for r in out] == [14, 5, 32]
    assert [r["stats"]["batch_size"] for r in out] == ([2, 2, 1] if batch else [3, 3, 3])


def test_generate_prompts_file_text_and_seeds(tmp_path, capsys):
    path = _prompts_file(tmp_path)
    assert main(["generate", "--model", MODEL, "--prompts-file", path, "--max-new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    heads = [line for line in captured.out.splitlines() if line.startswith("--- prompt")]
    assert heads == ['--- prompt 0 (line 1, id="a") ---', '--- prompt 1 (line 3, id=7, tag=[1]) ---',
                     '--- prompt 2 (line 4, id="c") ---']
    stats = captured.err.strip().splitlines()
    assert [line.split(" [")[0] for line in stats] == ["prompt 0:", "prompt 1:", "prompt 2:"]
    assert "[full] 14 prompt tokens" in stats[0]
    sampled = []
    for batch in ([], ["--batch-size", "1"]):  # prompt i samples with seed + i, whatever the batches
        assert main(["generate", "--model", MODEL, "--prompts-file", path, "--max-new-tokens", "6", "--do-sample",
                     "--seed", "11", "--json", *batch]) == 0
        sampled.append([json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()])
    assert sampled[0] == sampled[1]


@pytest.mark.parametrize("lines,fragments", [
    (['{"prompt": "x"}', '{"prompt": "y"'], ["line 2: not valid JSON", "Expecting ',' delimiter"]),
    (['{"prompt": "x"}', "", "[1, 2]"], ["line 3: expected a JSON object", "got a JSON list"]),
    (['{"id": 1}'], ['line 1: the object has no "prompt" key', "'id'"]),
    (['{"prompt": 5}'], ['line 1: "prompt" must be a non-empty string or a non-empty list of token ids', "got 5"]),
    (['{"prompt": [1, 2.5]}'], ['"prompt" must be', "got [1, 2.5]"]),
    (['{"prompt": ""}'], ["line 1: the prompt is empty"]),
    (['{"prompt": "x", "text": "y"}'], ["line 1: key 'text' is a name the output uses"]),
    (["", "  "], ["holds no prompts"]),
    (['{"prompt": "x"}', '{"prompt": [1, 99999]}'], ["token id 99999 in prompts file", "line 2 is outside the vocabulary"]),
])
def test_generate_prompts_file_errors(tmp_path, capsys, lines, fragments):
    path = _prompts_file(tmp_path, lines)
    _one_line_error(capsys, ["generate", "--model", MODEL, "--prompts-file", path], f"prompts file {path!r}",
                    *fragments)


def test_generate_prompts_file_with_speculation(tmp_path, capsys):
    """A prompts file through speculative decoding (--speculate or a recipe's decode) is one batch whose greedy
    tokens are plain greedy's."""
    path = _prompts_file(tmp_path)
    recipe = tmp_path / "spec.json"
    recipe.write_text('{"decode": {"speculate": "prompt_lookup", "gamma": 3}}')
    outs = []
    for flags in ([], ["--speculate", "prompt_lookup", "--gamma", "3"], ["--recipe", str(recipe)]):
        assert main(["generate", "--model", MODEL, "--prompts-file", path, "--max-new-tokens", "6", "--json",
                     *flags]) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        outs.append([r["token_ids"] for r in rows])
        assert all(r["stats"]["batch_size"] == 3 for r in rows)
        if flags:
            assert all("acceptance_rate" in r["stats"] for r in rows)
    assert outs[0] == outs[1] == outs[2]


def test_generate_prompts_file_refusals(tmp_path, capsys):
    path = _prompts_file(tmp_path)
    base = ["generate", "--model", MODEL]
    _one_line_error(capsys, [*base, "--prompts-file", str(tmp_path / "none.jsonl")], "none.jsonl", "does not exist")
    _one_line_error(capsys, [*base, "--prompts-file", path, "--prompt", "hi"],
                    "give exactly one of --prompt TEXT, --prompt-file FILE or --prompts-file", "--prompt and --prompts-file")
    _one_line_error(capsys, [*base, "--prompt", "hi", "--batch-size", "2"], "--batch-size splits the prompts of --prompts-file")
    _one_line_error(capsys, [*base, "--prompts-file", path, "--batch-size", "0"], "--batch-size must be a whole number >= 1")
    long = _prompts_file(tmp_path, ['{"prompt": "x"}', '{"prompt": "' + "y" * 5000 + '"}'], "long.jsonl")
    _one_line_error(capsys, [*base, "--prompts-file", long], f"prompts file {long!r} line 2", "allows at most")


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


def test_bench_batch_sizes(capsys):
    """Every method at every batch size, ratios to full at the same batch size; the batch's decode rate is
    the tokens of all its sequences per second, its KV per sequence and in total."""
    assert main(["bench", "--model", MODEL, "--context", "120", "--new-tokens", "4", "--methods",
                 "full,window:window=32", "--repeats", "1", "--batch-sizes", "1,3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["batch_size"], r["method"]) for r in rows] == [(1, "full"), (1, "window:window=32"),
                                                              (3, "full"), (3, "window:window=32")]
    for full, win in (rows[:2], rows[2:]):
        b = full["batch_size"]
        assert full["kv_ratio"] == 1.0 and full["decode_speedup"] == 1.0
        assert win["decode_speedup"] == pytest.approx(win["decode_tokens_per_s"] / full["decode_tokens_per_s"])
        assert win["prefill_speedup"] == pytest.approx(full["prefill_s"] / win["prefill_s"])
        assert win["final_kv_bytes"] * (124 / 32) == full["final_kv_bytes"]  # per sequence: as at batch 1
        for r in (full, win):
            assert r["final_kv_bytes_total"] == b * r["final_kv_bytes"]
            assert r["peak_kv_bytes_total"] == b * r["peak_kv_bytes"]
    assert rows[2]["final_kv_bytes"] == rows[0]["final_kv_bytes"]
    assert main(["bench", "--model", MODEL, "--context", "120", "--new-tokens", "4", "--methods", "full",
                 "--repeats", "1", "--batch-sizes", "2", "--bandwidth-mib", "0"]) == 0
    captured = capsys.readouterr()
    head, _, row = captured.out.splitlines()[:3]
    assert head.split()[:2] == ["method", "batch"] and row.split()[:2] == ["full", "2"]
    assert "batch sizes 2" in captured.err and "full x2" in captured.err


# ---- first contact: every mistake is one line on stderr, before any model loads ----------------------------

def _one_line_error(capsys, argv, *fragments, status=2):
    assert main(argv) == status
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("attnkit: error:") and "\n" not in err and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err
    return err


@pytest.mark.parametrize("argv,fragments", [
    (["bench", "--repeats", "0"], ["--repeats must be a whole number >= 1", "got 0"]),
    (["bench", "--context", "-1"], ["--context must be a whole number >= 1", "got -1"]),
    (["bench", "--repeats", "x"], ["--repeats", "invalid int value: 'x'", "attnkit bench --help"]),
    (["generate", "--prompt", "hi", "--temperature", "nan"], ["--temperature must be a finite number > 0", "nan"]),
    (["generate", "--prompt", "hi", "--temperature", "inf"], ["--temperature", "inf"]),
    (["generate", "--prompt", "hi", "--do-sample", "--temperature", "0"], ["--temperature must be", "got 0.0"]),
    (["generate", "--prompt", "hi", "--do-sample", "--temperature", "-1"], ["--temperature must be", "got -1.0"]),
    (["generate", "--prompt", "hi", "--top-p", "1.5"], ["--top-p must be a number with 0.0 < x <= 1.0", "1.5"]),
    (["generate", "--prompt", "hi", "--top-p", "nan"], ["--top-p must be", "nan"]),
    (["generate", "--prompt", "hi", "--top-k", "0"], ["--top-k must be a whole number >= 1", "got 0"]),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], ["--max-new-tokens must be a whole number >= 1"]),
    (["generate", "--prompt", "hi", "--chunk-size", "0"], ["--chunk-size must be a whole number >= 1"]),
    (["generate", "--prompt", "hi", "--speculate", "self", "--gamma", "0"], ["--gamma must be a whole number >= 1"]),
    (["generate", "--prompt", "hi", "--speculate", "self", "--draft-confidence", "1"],
     ["--draft-confidence must be a probability between 0 and 1", "got 1.0"]),
    (["bench", "--threads", "0"], ["--threads must be a whole number >= 1", "got 0"]),
    (["generate", "--prompt", "hi", "--method", "nope"], ["unknown method 'nope'", "full"]),
    (["generate", "--prompt", "hi", "--speculate", "later"], ["invalid choice: 'later'", "prompt_lookup"]),
    (["eval", "--samples", "0"], ["--samples must be a whole number >= 1", "got 0"]),
    (["eval", "--lengths", "1024,-5"], ["--lengths must hold whole numbers >= 1", "-5"]),
    (["eval", "--lengths", "1k"], ["--lengths must be comma-separated integers", "'1k'"]),
    (["eval", "--tasks", " , "], ["--tasks is empty"]),
    (["eval", "--batch-size", "0"], ["--batch-size must be a whole number >= 1", "got 0"]),
    (["bench", "--batch-sizes", "1,0"], ["--batch-sizes must hold whole numbers >= 1", "0"]),
    (["bench", "--batch-sizes", "4,4"], ["--batch-sizes has duplicates", "[4, 4]"]),
    (["bench", "--batch-sizes", "1,4", "--speculate", "prompt_lookup"], ["--speculate decodes one prompt at a time"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'", "generate"]),
    ([], ["required", "COMMAND"]),
])
def test_bad_options_are_one_line_before_loading(capsys, argv, fragments):
    _one_line_error(capsys, argv, *fragments)


def test_non_utf8_prompt_file(tmp_path, capsys):
    prompt = tmp_path / "latin1.txt"
    prompt.write_bytes("caf\xe9 au lait".encode("latin-1"))
    _one_line_error(capsys, ["generate", "--model", MODEL, "--prompt-file", str(prompt)],
                    str(prompt), "not UTF-8 text", "0xe9", "offset 3")
    _one_line_error(capsys, ["generate", "--model", MODEL, "--prompt-file", str(tmp_path / "missing.txt")],
                    "does not exist")
    _one_line_error(capsys, ["generate", "--model", MODEL, "--prompt-file", str(tmp_path)], "is not a file")


def test_binary_results_file_for_report(tmp_path, capsys):
    (tmp_path / "results.jsonl").write_bytes(bytes(range(256)) * 4)
    _one_line_error(capsys, ["report", str(tmp_path)], str(tmp_path), "not UTF-8")


def test_unwritable_output_is_a_runtime_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where a directory is wanted: the write fails with the system's reason
    err = _one_line_error(capsys, ["eval", "--model", MODEL, "--lengths", "256", "--samples", "1", "--no-progress",
                                   "--out", str(blocker / "out")], status=1)
    assert str(blocker) in err


# ---- generate --method: the spec grammar of eval/bench --methods ------------------------------------------

PROMPT = "abcdefgh " * 12


@pytest.mark.parametrize("argv,method", [
    (["--method", "window:window=8"], "window(window=8)"),
    (["--method", "window", "--param", "window=8"], "window(window=8)"),
    (["--method", "snapkv:budget=0.5,window_size=4"], "snapkv(budget=0.5, "),
    (["--method", "snapkv:budget=0.5", "--param", "window_size=4"], "window_size=4"),
    (["--method", "minference+snapkv:budget_tokens=40"], "minference("),
])
def test_generate_method_spec_grammar(capsys, argv, method):
    assert main(["generate", "--model", MODEL, "--prompt", PROMPT, "--max-new-tokens", "2", "--json", *argv]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert method in stats["method"]
    if "+" in argv[1]:
        assert "+snapkv(" in stats["method"]


def test_generate_param_conflicts(capsys):
    base = ["generate", "--model", MODEL, "--prompt", "hi"]
    _one_line_error(capsys, [*base, "--method", "window:window=8", "--param", "window=4"],
                    "window is given both in --method")
    _one_line_error(capsys, [*base, "--method", "minference+snapkv", "--param", "budget=0.3"],
                    "--param sets parameters of a single method")
    _one_line_error(capsys, [*base, "--param", "budget"], "--param expects key=value, got 'budget'")
    _one_line_error(capsys, [*base, "--method", "window:window"], "expected key=value")


def test_spec_list_helpers_are_public():
    assert split_spec_list("full,window:window=1024,a=1+snapkv:budget=0.3") == [
        "full", "window:window=1024,a=1+snapkv:budget=0.3"]
    assert name_list(" passkey, kv_retrieval ,", "--tasks") == ["passkey", "kv_retrieval"]
    assert int_list("1024, 2048", "--lengths", minimum=1) == [1024, 2048]
    with pytest.raises(AttnkitError, match="--methods is empty"):
        split_spec_list(" , ")


# ---- help: every option says what it does and its default ---------------------------------------------------

def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield sub
                yield from _subparsers(sub)


def test_every_option_has_help_with_its_default():
    parsers = list(_subparsers(build_parser()))
    assert {p.prog for p in parsers} >= {"attnkit generate", "attnkit bench", "attnkit eval",
                                         "attnkit calibrate heads", "attnkit demo"}
    for p in parsers:
        text = p.format_help()
        for action in p._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            assert action.help, f"{p.prog} {action.option_strings[0]} has no help"
            shown = action.default not in (None, False) and "default" not in action.help
            if shown:
                assert f"(default: {action.default})" in " ".join(text.split()), (p.prog, action.dest)
    generate = build_parser().parse_args(["generate"])  # the defaults the help shows are the ones used
    assert (generate.max_new_tokens, generate.method, generate.temperature) == (64, "full", 1.0)


def test_tasks_help_lists_the_tasks(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for task in ALL_TASKS:
        assert task in out
    assert "longbench:DATASET" in out and "(default: 1024)" in out and "(default: 20)" in out


# ---- closed pipes and Ctrl-C -----------------------------------------------------------------------------------

def _cli(*argv):
    return [sys.executable, "-m", "attnkit.cli", *argv]


def _env():
    src = str(Path(attnkit.__file__).resolve().parents[1])
    return dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")


@pytest.mark.parametrize("error,status,err", [(BrokenPipeError, 141, ""), (KeyboardInterrupt, 130,
                                                                           "attnkit: interrupted\n")])
def test_pipe_and_interrupt_in_process(monkeypatch, capsys, error, status, err):
    def boom(_args):
        raise error()

    monkeypatch.setattr(commands_module, "cmd_methods", boom)
    monkeypatch.setattr(parser_module, "cmd_methods", boom)
    assert main(["methods"]) == status
    assert capsys.readouterr().err == err


def test_closed_pipe_ends_quietly():
    # both commands at once: each spends seconds importing torch and transformers before it writes
    proc = subprocess.Popen(_cli("methods"), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first write
    head = subprocess.run(" ".join(shlex.quote(a) for a in _cli("methods")) + " | head -1", shell=True,
                          env=_env(), capture_output=True, text=True, timeout=300)
    _, err = proc.communicate(timeout=300)
    assert head.returncode == 0 and head.stderr == "", head.stderr
    assert len(head.stdout.splitlines()) == 1
    assert proc.returncode == 141 and err == b"", err.decode()


def test_ctrl_c_is_one_line(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(_cli("eval", "--model", MODEL, "--tasks", "passkey", "--lengths",
                                 "256,320,384,448,512,576,640,704", "--samples", "4", "--out", str(out), "--no-progress"),
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            # a suite started in the background (`cmd &`) hands its children SIGINT ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    results = out / "results.jsonl"
    deadline = time.time() + 240  # the subprocess imports torch and transformers first: slow on a busy machine
    while time.time() < deadline and proc.poll() is None and not (results.is_file() and results.read_text()):
        time.sleep(0.01)
    assert proc.poll() is None, "eval finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()
    assert err.decode().strip().splitlines()[-1] == "attnkit: interrupted" and b"Traceback" not in err


@pytest.mark.parametrize("command", ["generate", "bench"])
@pytest.mark.parametrize("flags,named", [(["--draft-lookup"], "--draft-lookup"),
                                         (["--draft-confidence", "0.3"], "--draft-confidence"),
                                         (["--draft-weights", "int8"], "--draft-weights"),
                                         (["--draft", "tiny-draft"], "--draft")])
def test_cli_refuses_draft_options_without_speculate(command, flags, named, capsys):
    args = [command, "--model", f"random:llama:{SMALL}", *flags]
    if command == "generate":
        args += ["--prompt", "abc"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert named in err and "add --speculate" in err


def test_cli_generate_speculate_matches_plain(capsys):
    model = f"random:llama:{SMALL}"
    prompt = "abcabcabcabcabcabc"
    assert main(["generate", "--model", model, "--prompt", prompt, "--max-new-tokens", "12", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["generate", "--model", model, "--prompt", prompt, "--max-new-tokens", "12", "--json",
                 "--speculate", "prompt_lookup", "--gamma", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"]
    assert "acceptance_rate" in spec["stats"] and spec["stats"]["draft_forwards"] == 0
    assert main(["generate", "--model", model, "--prompt", prompt, "--max-new-tokens", "6",
                 "--speculate", "self", "--draft", "streaming:budget_tokens=8,sinks=2"]) == 0
    err = capsys.readouterr().err
    assert "acceptance" in err and "draft forwards per round" in err
    assert main(["generate", "--model", model, "--prompt", prompt, "--speculate", "self", "--method", "window",
                 "--param", "window=8"]) == 2


def test_cli_bench_speculate(capsys):
    assert main(["bench", "--model", f"random:llama:{SMALL}", "--context", "200", "--new-tokens", "8",
                 "--repeats", "1", "--threads", "1", "--speculate", "prompt_lookup", "--gamma", "3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["decoder"].split()[0] for r in rows] == ["plain", "speculative"]
    assert rows[1]["same_output_as_plain"] is True and rows[0]["decode_speedup"] == 1.0
    split = rows[1]["per_round"]  # one run: its own figures
    assert split["draft_forwards"] == 0 and split["tokens"] == pytest.approx(rows[1]["tokens_per_target_forward"])
    assert split["verify_steps"] > 0
