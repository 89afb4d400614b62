"""The generation loop: prefill (optionally chunked), decode, sampling, stop conditions, statistics.

The runner owns the KV cache and the loop; the decoder itself runs through :mod:`attnkit.forward`, so
every layer's attention reaches the active method through attnkit's attention function. A batch of
prompts is grouped by prompt length: each group is one :class:`~attnkit.session.Session` whose cache
holds the group's sequences as rows (same positions, same budgets); every decoding step is one forward
over all the groups' rows (:class:`~attnkit.session.RowsStep` splits each layer's attention by group).
"""

from __future__ import annotations

import dataclasses
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from attnkit.errors import AttnkitError
from attnkit.forward import forward, forward_rows, logits_of, prefill
from attnkit.generation import (
    GenerationConfig,
    TokenEmitter,
    available_memory,
    check_length,
    encode_prompt,
    encode_prompts,
    sync,
)
from attnkit.methods.base import Method, resolve_method
from attnkit.model import LoadedModel, check_loaded_model
from attnkit.native import guard
from attnkit.sampling import choose_token
from attnkit.session import RowsStep, Session, Step, new_session, planned_slots


@dataclass
class GenerationStats:
    method: str
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    ttft_s: float  # time to first token: prefill + choosing the first token
    decode_s: float
    decode_tokens_per_s: float  # tokens after the first, per second of decoding
    peak_kv_bytes: int  # this sequence's share of the KV cache (its own entries), at most / at the end
    final_kv_bytes: int
    peak_rss_bytes: int
    finish_reason: str  # "length", "eos" or "stop"
    # what the method measured during the run (e.g. Select-Attention's kept tokens), by name
    method_stats: dict = field(default_factory=dict, kw_only=True)
    batch_size: int = field(default=1, kw_only=True)  # prompts generated side by side in this call

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    logits: list[torch.Tensor] | None = None  # per generated token, when asked for with keep_logits


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class RunSequence:
    """One prompt of a batch while it generates (:func:`generate`'s, or :mod:`attnkit.continuation`'s)."""

    index: int  # its place in the caller's batch
    ids: torch.Tensor
    emit: TokenEmitter
    generator: torch.Generator | None
    logits: list | None
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    peak_bytes: int = 0
    final_bytes: int = 0
    done: bool = False


@dataclass
class RunGroup:
    """Sequences of one prompt length that share a session (rows of its cache), or one sequence alone."""

    session: Session
    members: list[RunSequence]  # the rows still generating, in row order
    finished: list[RunSequence] = field(default_factory=list)
    # tokens fed after the session's prompt before the first generated one (a question continuing a
    # compressed context, :mod:`attnkit.continuation`): the first generated token sits at prompt_len + offset
    offset: int = 0


def group_prompts(lengths: list[int], method: Method) -> list[list[int]]:
    """Which prompts share a session: those of the same length (they stay at the same positions and resolve
    the same budgets), when the method allows several sequences per session; otherwise one each."""
    if not method.batches:
        return [[i] for i in range(len(lengths))]
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(n, []).append(i)
    return list(groups.values())


def check_batch(model: LoadedModel, groups: list[RunGroup], batched: bool) -> None:
    """Before any work: every prompt's parameters fit it (budgets resolve per layer), and a batch's KV cache
    fits in the free memory of each device (what the method holds per layer once the prompt is processed, on
    the device that layer runs on)."""
    g = model.geometry
    slot_bytes = 2 * g.n_kv_heads * g.head_dim * model.dtype.itemsize  # a key and a value of one kv head
    devices = model.layer_devices()
    need: dict[torch.device, int] = {}
    for group in groups:
        session = group.session
        try:
            for layer, slots in enumerate(planned_slots(session)):
                need[devices[layer]] = need.get(devices[layer], 0) + slots * slot_bytes * session.rows
        except AttnkitError as err:
            if not batched:
                raise
            which = ", ".join(str(m.index) for m in group.members)
            raise AttnkitError(f"prompt{'s' if len(group.members) > 1 else ''} {which} "
                               f"({session.prompt_len} tokens): {err}") from None
    for device, bytes_ in need.items() if batched else ():
        if bytes_ > (free := available_memory(device)):
            rows = sum(group.session.rows for group in groups)
            raise AttnkitError(f"a batch of {rows} prompts needs about {bytes_ / 2**30:.2f} GiB of KV cache with "
                               f"{groups[0].session.method.describe()} on {device}, but {free / 2**30:.2f} GiB is "
                               f"free there; use a smaller batch")


@torch.inference_mode()
def generate(model: LoadedModel, prompt, method: str | Method | None = "full", *, params: dict | None = None,
             config: GenerationConfig | None = None, on_token: Callable | None = None,
             keep_logits: bool = False, **options) -> Generation | list[Generation]:
    """Generate after `prompt` with attention method `method`.

    `prompt` is one prompt (text or token ids) or a batch: a list of texts, a list of token-id lists, or a
    ``[batch, n]`` tensor; for a batch the result is one :class:`Generation` per prompt, in order. Each
    sequence keeps its own positions, budget (a fractional budget is a fraction of its own prompt), stop
    and statistics; prompts of the same length share one cache (batched tensor work), others run side by
    side in the same forward passes, and a finished sequence leaves the batch.
    `method` is a registered name (with `params`) or a method instance. How much to generate and how is a
    :class:`GenerationConfig` (`config`), or its fields as keywords (`options`: ``max_new_tokens``,
    ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``, ``stop_at_eos``,
    ``chunk_size``), which override `config`'s. Generation stops at EOS (unless ``stop_at_eos=False``), at
    any ``stop`` string (the returned text ends before it), or after ``max_new_tokens``. With ``seed``,
    prompt ``i`` of a batch samples with seed ``seed + i`` (so prompt 0 samples as it would alone).
    `on_token(token_id, text_delta)` streams (for a batch: ``on_token(index, token_id, text_delta)``).
    `keep_logits` returns the logits each token was chosen from (float32, ``[vocab]`` each).
    """
    model = check_loaded_model(model)
    config = GenerationConfig.build(config, **options)
    method = resolve_method(method, params)
    prompts, batched = encode_prompts(model, prompt)
    max_new_tokens = config.max_new_tokens
    for i, ids in enumerate(prompts):
        check_length(model, ids.shape[0], max_new_tokens, f"prompt {i}" if batched else "the prompt")
    lengths = [int(ids.shape[0]) for ids in prompts]
    sequences = [start_sequence(model, i, prompts[i], config, on_token if not batched or on_token is None
                                else (lambda t, text, i=i: on_token(i, t, text)), keep_logits)
                 for i in range(len(prompts))]
    groups = [RunGroup(new_session(model, method, lengths[idx[0]], max_new_tokens, rows=len(idx)),
                       [sequences[i] for i in idx]) for idx in group_prompts(lengths, method)]
    check_batch(model, groups, batched)

    sync(model.device)
    mark = guard.mark()  # the C++ kernels' choices this call consults go into its statistics
    t0 = time.perf_counter()
    for group in groups:
        t_group = time.perf_counter()
        ids = torch.stack([m.ids for m in group.members])
        hidden = prefill(model, group.session, ids, config.chunk_size)
        logits = logits_of(model, hidden[:, -1])
        sync(model.device)
        prefill_s = time.perf_counter() - t_group
        for seq in group.members:
            seq.prefill_s = prefill_s
        choose_tokens(group, logits, config.sampling, t0, first=True)
    decode_groups(model, method, groups, config.sampling, max_new_tokens)
    gens = generations(groups, method, len(prompts))
    for gen in gens:
        gen.stats.method_stats.update(guard.report(mark))
    return gens if batched else gens[0]


def start_sequence(model: LoadedModel, index: int, ids: torch.Tensor, config: GenerationConfig,
                   on_token: Callable | None = None, keep_logits: bool = False) -> RunSequence:
    """The sequence of prompt `index` (`ids`: what its statistics count as the prompt): its stop conditions,
    and its sampling generator (seed ``config.seed + index``, so prompt 0 samples as it would alone)."""
    sampling = config.sampling
    seeded = sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + index)
    return RunSequence(index, ids, TokenEmitter(model.tokenizer, config.eos(model.tokenizer), config.stop, on_token),
                       seeded.generator(model.output_device), [] if keep_logits else None)  # the logits' device


def decode_groups(model: LoadedModel, method: Method, groups: list[RunGroup], sampling, max_new_tokens: int) -> None:
    """Decode every group from its first chosen token on, all groups' rows in each forward, until each
    sequence stops or has `max_new_tokens` tokens; finished sequences leave their group's rows."""
    t_decode = time.perf_counter()
    finish_rows(groups, t_decode)
    for i in range(1, max_new_tokens):
        active = [g for g in groups if g.members]
        if not active:
            break
        for group, logits in zip(active, _decode_step(model, method, active, i), strict=True):
            choose_tokens(group, logits, sampling, t_decode)
        finish_rows(active, t_decode)
    for group in groups:  # sequences that ran to max_new_tokens
        finish_rows([group], t_decode, everyone=True)


def generations(groups: list[RunGroup], method: Method, batch_size: int) -> list[Generation]:
    """Every finished sequence's :class:`Generation`, in the order of their indices."""
    rss = peak_rss_bytes()
    out = [_generation(seq, method, g.session, batch_size, rss) for g in groups for seq in g.finished]
    out.sort(key=lambda gen: gen[0])
    return [gen for _, gen in out]


def _decode_step(model: LoadedModel, method: Method, active: list[RunGroup], i: int) -> list[torch.Tensor]:
    """One decoding step of every active sequence: the logits ``[rows, vocab]`` of each group."""
    device = model.device
    if method.run_layers is not None:  # the method runs the layers itself: one forward per session (its rows)
        return [logits_of(model, forward(model, torch.tensor([[m.emit.generated[-1]] for m in g.members],
                                                             device=device),
                                         g.session.prompt_len + g.offset + i - 1,
                                         lambda pos, g=g: Step(g.session, "decode", pos))[:, -1]) for g in active]
    ids = torch.tensor([[m.emit.generated[-1]] for g in active for m in g.members], device=device)
    parts, row = [], 0
    for g in active:
        pos = torch.tensor([g.session.prompt_len + g.offset + i - 1], device=device)
        parts.append((row, row + len(g.members), 1, Step(g.session, "decode", pos)))
        row += len(g.members)
    if len(parts) == 1:
        positions, step = parts[0][3].q_pos, parts[0][3]
    else:
        positions = torch.cat([p[3].q_pos.expand(p[1] - p[0]) for p in parts])[:, None]
        step = RowsStep(parts)
    logits = logits_of(model, forward_rows(model, ids, positions, step)[:, -1])
    return [logits[start:end] for start, end, _, _ in parts]


def choose_tokens(group: RunGroup, logits: torch.Tensor, sampling, t0: float, first: bool = False) -> None:
    """Choose and emit each row's next token."""
    greedy = None if sampling.do_sample else logits.argmax(-1).tolist()
    for row, seq in enumerate(group.members):
        token = greedy[row] if greedy is not None else choose_token(logits[row], sampling, seq.generator)
        if seq.logits is not None:
            seq.logits.append(logits[row])
        if first:
            seq.ttft_s = time.perf_counter() - t0
        seq.done = seq.emit.push(token)


def finish_rows(groups: list[RunGroup], t_decode: float, everyone: bool = False) -> None:
    """Record the sequences that finished and drop their rows (the others go on)."""
    for group in groups:
        ended = [m for m in group.members if m.done or everyone]
        if not ended:
            continue
        cache = group.session.cache
        now = time.perf_counter()
        for seq in ended:
            seq.decode_s = now - t_decode
            seq.peak_bytes, seq.final_bytes = cache.peak_row_bytes, cache.row_nbytes()
        group.finished += ended
        keep = [row for row, m in enumerate(group.members) if not (m.done or everyone)]
        group.members = [group.members[row] for row in keep]
        if keep:
            group.session.keep_rows(keep)


def _generation(seq: RunSequence, method: Method, session: Session, batch_size: int, rss: int) -> tuple[int, Generation]:
    emit = seq.emit
    text = emit.close()
    steps = emit.decode_steps()
    stats = GenerationStats(
        method=method.describe(), prompt_tokens=int(seq.ids.shape[0]), new_tokens=len(emit.generated),
        prefill_s=seq.prefill_s, ttft_s=seq.ttft_s, decode_s=seq.decode_s,
        decode_tokens_per_s=steps / seq.decode_s if steps and seq.decode_s > 0 else 0.0,
        peak_kv_bytes=seq.peak_bytes, final_kv_bytes=seq.final_bytes, peak_rss_bytes=rss,
        finish_reason=emit.finish, method_stats=method.run_stats(session), batch_size=batch_size,
    )
    return seq.index, Generation(text, emit.generated, stats, seq.logits)


def _prefill_all(model: LoadedModel, ids, method, params, chunk_size) -> tuple[torch.Tensor, torch.Tensor]:
    model = check_loaded_model(model)
    method = resolve_method(method, params)
    ids = encode_prompt(model, ids)
    check_length(model, ids.shape[0], 0)
    session = new_session(model, method, ids.shape[0], 0)
    return ids, prefill(model, session, ids, chunk_size, all_positions=True)


@torch.inference_mode()
def score_tokens(model: LoadedModel, ids, method: str | Method | None = "full", *, params: dict | None = None,
                 chunk_size: int | None = None) -> torch.Tensor:
    """Logits ``[n, vocab]`` at every prompt position under `method`'s prefill."""
    _, hidden = _prefill_all(model, ids, method, params, chunk_size)
    return logits_of(model, hidden)


@torch.inference_mode()
def token_nll(model: LoadedModel, ids, method: str | Method | None = "full", *, params: dict | None = None,
              chunk_size: int | None = None, slice_tokens: int = 1024) -> torch.Tensor:
    """Negative log-likelihood (nats) of tokens 1..n-1 given what precedes them, under `method`'s prefill.

    Logits are formed `slice_tokens` positions at a time, so a long text never holds ``[n, vocab]``.
    """
    ids, hidden = _prefill_all(model, ids, method, params, chunk_size)
    nll = []
    for s in range(0, ids.shape[0] - 1, slice_tokens):
        e = min(ids.shape[0] - 1, s + slice_tokens)
        nll.append(torch.nn.functional.cross_entropy(logits_of(model, hidden[s:e]), ids[s + 1:e + 1],
                                                     reduction="none"))
    return torch.cat(nll)
