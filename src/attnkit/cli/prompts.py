"""``attnkit generate --prompts-file FILE.jsonl``: many prompts through :func:`attnkit.generate` as one batch.

The file holds one JSON object per line with a ``"prompt"`` key (text, or a list of token ids); its other
keys (an ``"id"``...) are passed through into that prompt's output. Blank lines are skipped. The file is
read and checked before any model loads, and every mistake is one line naming the file and the line.
The prompts run as one batch (``--batch-size N``: batches of N, in file order); results come in file
order, one per prompt: with ``--json`` one JSON object per line (``index``, the passed-through keys,
``text``, ``token_ids``, ``stats``), otherwise a block per prompt (its text on stdout, its statistics on
stderr as for one prompt).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.generation import check_length, encode_prompt
from attnkit.validate import is_whole

# what the output of every prompt holds besides the file's own keys (a line may not use these names)
OUTPUT_KEYS = ("index", "text", "token_ids", "stats")


@dataclass(frozen=True)
class FilePrompt:
    """One prompt of a prompts file."""

    line: int  # 1-based line number in the file
    prompt: str | list[int]
    extra: dict  # the line's other keys, passed through into the output

    def where(self, name: str) -> str:
        return f"prompts file {name!r} line {self.line}"


def _line_error(name: str, line: int, message: str) -> AttnkitError:
    return AttnkitError(f"prompts file {name!r} line {line}: {message}")


def _prompt_of(name: str, line: int, obj) -> FilePrompt:
    if not isinstance(obj, dict):
        raise _line_error(name, line, f'expected a JSON object with a "prompt" key, got a JSON '
                                      f"{type(obj).__name__}")
    if "prompt" not in obj:
        keys = ", ".join(map(repr, obj)) or "none"
        raise _line_error(name, line, f'the object has no "prompt" key (its keys: {keys})')
    prompt = obj["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise _line_error(name, line, "the prompt is empty")
    elif isinstance(prompt, list) and prompt and all(is_whole(t) for t in prompt):
        pass
    else:
        raise _line_error(name, line, f'"prompt" must be a non-empty string or a non-empty list of token ids '
                                      f"(integers), got {json.dumps(prompt)[:60]}")
    reserved = [k for k in OUTPUT_KEYS if k in obj]
    if reserved:
        raise _line_error(name, line, f"key {reserved[0]!r} is a name the output uses ({', '.join(OUTPUT_KEYS)}); "
                                      f"rename it")
    return FilePrompt(line, prompt, {k: v for k, v in obj.items() if k != "prompt"})


def read_prompts_file(name: str) -> list[FilePrompt]:
    """The prompts of a JSONL file, checked line by line (no model needed)."""
    path = Path(name)
    if not path.is_file():
        raise AttnkitError(f"prompts file {name!r} does not exist" if not path.exists()
                           else f"prompts file {name!r} is not a file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _line_error(name, data[:exc.start].count(b"\n") + 1,
                          f"not UTF-8 text (byte 0x{data[exc.start]:02x}); give UTF-8 JSON lines") from None
    prompts = []
    for line, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise _line_error(name, line, f"not valid JSON ({exc.msg} at column {exc.colno}); give one JSON "
                                          f'object per line, e.g. {{"prompt": "..."}}') from None
        prompts.append(_prompt_of(name, line, obj))
    if not prompts:
        raise AttnkitError(f'prompts file {name!r} holds no prompts; give one JSON object per line with a '
                           f'"prompt" key')
    return prompts


def prompt_ids(model, prompts: list[FilePrompt], name: str, max_new_tokens: int) -> list[list[int]]:
    """Every prompt as token ids (texts through the model's tokenizer, as :func:`attnkit.generate` does),
    checked against the model (vocabulary, positions) with errors naming the file's line."""
    out = []
    for p in prompts:
        ids = encode_prompt(model, p.prompt, p.where(name))
        check_length(model, ids.shape[0], max_new_tokens, p.where(name))
        out.append(ids.tolist())
    return out


def run_prompts(generate: Callable, ids: list[list[int]], batch_size: int | None, seed: int | None,
                emit: Callable) -> None:
    """`generate(prompts, seed=...)` over batches of `batch_size` prompts (all at once when None), in order;
    `emit(index, generation)` for every prompt as its batch finishes. Prompt ``i`` samples with seed
    ``seed + i`` whatever the batch size (:func:`attnkit.generate` seeds row ``r`` of a call ``seed + r``)."""
    size = batch_size or len(ids)
    for start in range(0, len(ids), size):
        gens = generate(ids[start:start + size], seed=None if seed is None else seed + start)
        for offset, gen in enumerate(gens):
            emit(start + offset, gen)


def print_result(index: int, prompt: FilePrompt, gen, as_json: bool) -> None:
    """One prompt's result on stdout: a JSON line, or a header naming the prompt and its text."""
    if as_json:
        print(json.dumps({"index": index, **prompt.extra, "text": gen.text, "token_ids": gen.token_ids,
                          "stats": gen.stats.as_dict()}), flush=True)
        return
    tags = "".join(f", {k}={json.dumps(v)}" for k, v in prompt.extra.items())
    print(f"--- prompt {index} (line {prompt.line}{tags}) ---")
    print(gen.text, flush=True)
