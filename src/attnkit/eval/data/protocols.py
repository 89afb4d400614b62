"""How a method meets the question: the evaluation protocols of ``attnkit eval --protocol``.

- ``query-aware`` (the default, and what most papers report): the prompt, question included, is prefilled and
  compressed as one; a method that picks keys by the prompt's last queries (SnapKV's observation window) sees
  the question while it compresses.
- ``query-agnostic``: the context is prefilled and compressed first; the question is fed afterwards through the
  compressed cache (:func:`attnkit.continuation.generate_after`). This is how a cache compressed ahead of use
  (a document, a system prompt, a chat history) meets the question, and how kvpress's leaderboard measures
  (the repository NVIDIA/kvpress; the setting is named in Kim et al. 2025, "KVzip: Query-Agnostic KV Cache
  Compression with Context Reconstruction", arXiv 2505.23416).
- ``multi-query``: each context is compressed once and answers several questions (``queries`` per context,
  each from the same compressed state: the state is copied, never recomputed), every answer scored. SCBench's
  shared-context setting (Li et al. 2024, "SCBench: A KV Cache-Centric Analysis of Long-Context Methods",
  arXiv 2412.10319).

Every protocol runs the same (context, question) pairs: with ``queries=K`` each context brings up to K questions
(its task's own first, :meth:`attnkit.eval.data.sample.Sample.questions`) under all three, so full attention, which
loses nothing, gives the same predictions under each, and a difference between protocols is the method's.
A recipe that cannot meet the question after its context is refused here with a one-line error.
"""

from __future__ import annotations

from attnkit.continuation import generate_after
from attnkit.errors import AttnkitError
from attnkit.eval.data.long_output import LONG_OUTPUT_TASKS
from attnkit.eval.data.sample import split_ids
from attnkit.model import LoadedModel
from attnkit.recipe import Recipe
from attnkit.validate import is_whole

QUERY_AWARE, QUERY_AGNOSTIC, MULTI_QUERY = "query-aware", "query-agnostic", "multi-query"
PROTOCOLS = (QUERY_AWARE, QUERY_AGNOSTIC, MULTI_QUERY)


def check_protocols(protocols, source: str = "protocols") -> list[str]:
    """A protocol name or a list of them -> a list of distinct known protocol names."""
    if isinstance(protocols, str):
        protocols = [protocols]
    if not isinstance(protocols, (list, tuple)) or not protocols:
        raise AttnkitError(f"{source} must be a protocol or a non-empty list of them ({', '.join(PROTOCOLS)})")
    unknown = [p for p in protocols if p not in PROTOCOLS]
    if unknown:
        raise AttnkitError(f"{source}: unknown protocol {unknown[0]!r}; available: {', '.join(PROTOCOLS)}")
    if len(set(protocols)) != len(protocols):
        raise AttnkitError(f"{source} has duplicates: {list(protocols)}")
    return list(protocols)


def check_queries(queries, protocols, source: str = "queries") -> int:
    """Questions per context: a whole number >= 1, at least 2 when multi-query runs (one question per context
    would make it query-agnostic under another name)."""
    if not is_whole(queries) or queries < 1:
        raise AttnkitError(f"{source} must be a whole number >= 1 (questions per context), got {queries!r}")
    if MULTI_QUERY in protocols and queries < 2:
        raise AttnkitError(f"the multi-query protocol answers several questions per context: give {source} >= 2 "
                           f"(it is {queries})")
    return int(queries)


def refusal(recipe: Recipe, protocol: str, task: str | None = None, items=None) -> str | None:
    """Why `recipe` cannot run `protocol` on `task` (its samples `items`), or None when it can."""
    if task in LONG_OUTPUT_TASKS:
        return long_output_refusal(recipe, protocol, task)
    if protocol == QUERY_AWARE:
        return None
    why = None
    if recipe.is_peer:
        why = "the kvpress worker prefills the whole prompt at once"
    elif recipe.decode is not None:
        why = "speculative decoding prefills the whole prompt at once"
    elif task == "perplexity":
        why = "task 'perplexity' has no question"
    elif items is not None and any(getattr(it, "question", None) is None for it in items):
        why = f"task {task!r} does not say which part of its prompts is the question"
    return None if why is None else f"{recipe.label} cannot run the {protocol} protocol: {why}; use query-aware"


def long_output_refusal(recipe: Recipe, protocol: str, task: str) -> str | None:
    """Why `recipe` cannot run the long-output `task` (:mod:`attnkit.eval.data.long_output`) under `protocol`: it
    feeds its tokens one per decoding step through attnkit's decode path, after a prompt prefilled whole."""
    if recipe.is_peer:
        why = "the kvpress worker cannot feed tokens one at a time through its cache"
    elif recipe.decode is not None:
        why = "speculative decoding feeds several tokens per step"
    elif protocol != QUERY_AWARE:
        why = (f"the {protocol} protocol does not apply: everything after the prompt already goes through the "
               f"decode path; use query-aware")
    else:
        return None
    return f"{recipe.label} cannot run task {task!r}: {why}"


def check_refusals(recipes: list[Recipe], protocols: list[str], task: str | None = None, items=None) -> None:
    for protocol in protocols:
        for recipe in recipes:
            why = refusal(recipe, protocol, task, items)
            if why:
                raise AttnkitError(why)


def contexts(tokenizer, items, protocol: str) -> list[tuple[list[int], list[int], list[list[int]]]]:
    """The contexts a protocol prefills: ``(context ids, item indices, question ids per item)``. Query-agnostic:
    one per item; multi-query: one per run of consecutive items asking about the same context (a new context
    starts at an item's first question, or where the context's tokens differ)."""
    out: list[tuple[list[int], list[int], list[list[int]]]] = []
    for i, item in enumerate(items):
        context, question = split_ids(tokenizer, item)
        same = (protocol == MULTI_QUERY and out and item.query > 0 and out[-1][0] == context
                and items[out[-1][1][-1]].max_new_tokens == item.max_new_tokens)
        if same:
            out[-1][1].append(i)
            out[-1][2].append(question)
        else:
            out.append((context, [i], [question]))
    return out


def generate_protocol(model: LoadedModel, recipe: Recipe, items, protocol: str, batch_size: int, stop_of,
                      progress_bar=None) -> tuple[list[list], dict]:
    """Every item's generation under `protocol` (query-agnostic or multi-query), grouped by the call that made
    it: ``batch_size`` contexts per :func:`attnkit.continuation.generate_after` call, contexts sharing token limit
    and stop string. Also the prefill work done: ``context_prefills`` and ``prefill_tokens``."""
    why = refusal(recipe, protocol, None, items)
    if why:
        raise AttnkitError(why)
    method = recipe.method()
    units = contexts(model.tokenizer, items, protocol)
    by_setting: dict[tuple, list] = {}
    for unit in units:
        first = items[unit[1][0]]
        by_setting.setdefault((first.max_new_tokens, stop_of(first)), []).append(unit)
    calls = []
    for (max_new, stop), group in by_setting.items():
        for s in range(0, len(group), batch_size):
            part = group[s:s + batch_size]
            gens = generate_after(model, [u[0] for u in part], [u[2] for u in part], method, max_new_tokens=max_new,
                                  stop=stop)
            calls.append([(i, g) for u, gs in zip(part, gens, strict=True) for i, g in zip(u[1], gs, strict=True)])
            if progress_bar is not None:
                progress_bar.update(sum(len(u[1]) for u in part))
    work = {"context_prefills": len(units), "prefill_tokens": sum(len(u[0]) for u in units)}
    return calls, work
