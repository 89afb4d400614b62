"""Presses of kvpress given what attnkit's calibration tools wrote, for :mod:`attnkit.eval.run.kvpress_worker` (it
runs in kvpress's environment and imports this file by its directory: standard library, torch, safetensors and
kvpress only, kvpress inside the functions), and helpers of its trace: the positions a press masked or removed and
the key channels it zeroed (ThinK's).
"""

import json

import torch
from kvpress_trained import fastkvzip_press, lukv_press, restorekv_press  # beside this file (sys.path[0])


def kvzap_press(path: str, ratio: float):
    """``KVzapPress`` with a linear surrogate loaded from `path` (tensors ``layers.{l}.weight`` / ``.bias``, as
    ``KVzapModel`` names them) instead of the hub weights its ``post_init_from_model`` would fetch."""
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel, KVzapPress
    from safetensors.torch import load_file

    state = load_file(path)
    n = len({key.split(".")[1] for key in state})
    out_dim, in_dim = state["layers.0.weight"].shape
    model = KVzapModel(KVzapConfig(input_dim=in_dim, output_dim=out_dim, n_modules=n))
    model.load_state_dict(state)
    press = KVzapPress(compression_ratio=ratio, model_type="linear")
    press.kvzap_model = model.eval()
    press.post_init_from_model = lambda _model: None  # on the instance: the weights are given
    return press


def qfilter_press(path: str, ratio: float):
    """``QFilterPress`` scoring with the unit vectors ``u`` of an ``attnkit calibrate qfilter`` file (JSON, per layer
    ``filters`` ``[kv, d]``) instead of the hub filters its ``post_init_from_model`` would fetch: it scores ``-<k, f>``,
    so it is given ``f = -u``."""
    from kvpress import QFilterPress

    with open(path) as f:
        layers = json.load(f)["layers"]
    press = QFilterPress(compression_ratio=ratio)
    press.q_filters = -torch.tensor([layer["filters"] for layer in layers], dtype=torch.float32)
    press.post_init_from_model = lambda _model: None  # on the instance: the filters are given
    return press


def stats_press(path: str, ratio: float):
    """``ExpectedAttentionStatsPress`` with the query mean and covariance of an ``attnkit calibrate
    expected_attention`` file (safetensors ``query_mean`` / ``query_cov``, its ``ExpectedAttentionStats`` names); set
    on the instance, so its ``post_init_from_model`` loads nothing."""
    from kvpress import ExpectedAttentionStatsPress
    from safetensors.torch import load_file

    tensors = load_file(path)
    press = ExpectedAttentionStatsPress(compression_ratio=ratio)
    press.mu, press.cov = tensors["query_mean"].float(), tensors["query_cov"].float()
    return press


FILE_PRESSES = ("kvzap", "qfilter", "expected_attention_stats", "fastkvzip", "lukv", "restorekv")


def press_from_file(spec: dict):
    """The press of a request ``{"kind": one of FILE_PRESSES, "file": ..., "compression_ratio": ..., ...}``."""
    kind, path, ratio = spec["kind"], spec["file"], spec["compression_ratio"]
    if kind == "kvzap":  # KVzapPress running the surrogate weights of a file (KVzapModel's state dict)
        return kvzap_press(path, ratio)
    if kind == "qfilter":  # QFilterPress with the filters of an attnkit calibrate qfilter file
        return qfilter_press(path, ratio)
    if kind == "expected_attention_stats":  # ExpectedAttentionStatsPress with a file's statistics
        return stats_press(path, ratio)
    if kind == "fastkvzip":  # FastKVzipPress with the gates of a file (the authors' torch format)
        return fastkvzip_press(path, ratio, spec["layerwise"], spec["n_sink"], spec["window_ratio"])
    if kind == "restorekv":  # RestoreKVPress with a folder's peft adapter and restore embeddings
        return restorekv_press(path, ratio, spec["layerwise"], spec["n_sink"], spec["chunk_size"])
    return lukv_press(path, ratio, spec["sink"], spec["window"], spec["epsilon"])  # budget curve of a .npy


def zeroed_channels(cache) -> dict[str, list[list[int]]]:
    """Per layer and kv head, the key channels every held key has at exactly 0 (a channel-pruning press's, ThinK's;
    batch row 0)."""
    return {str(i): [torch.nonzero((layer.keys[0, h] == 0).all(dim=0)).flatten().tolist()
                     for h in range(layer.keys.shape[1])] for i, layer in enumerate(cache.layers)}


def masked_kept(model, n: int) -> dict[str, list[list[int]]]:
    """Per layer and kv head, the prompt positions a key-masking press keeps (batch row 0): all but those in
    ``self_attn.masked_key_indices``, the (batch, head, position) triples kvpress's attention patch masks."""
    heads = model.config.num_key_value_heads
    out = {}
    for i, layer in enumerate(model.model.layers):
        dropped = [set() for _ in range(heads)]
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:
            for b, h, p in zip(*(t.tolist() for t in masked)):
                if b == 0:
                    dropped[h].add(p)
        out[str(i)] = [[p for p in range(n) if p not in dropped[h]] for h in range(heads)]
    return out


def removed_kept(cache, prompt_keys: list) -> dict[str, list[list[int]]]:
    """Per layer and kv head, the prompt positions whose key rows (`prompt_keys`, per layer ``[kv, n, d]``, taken
    before the press compressed) the compressed cache holds, matched by exact bytes (batch row 0)."""
    out = {}
    for i, (layer, before) in enumerate(zip(cache.layers, prompt_keys)):
        rows = []
        for h in range(before.shape[0]):
            index = {before[h, j].numpy().tobytes(): j for j in range(before.shape[1])}
            rows.append(sorted(index[row.numpy().tobytes()] for row in layer.keys[0, h].contiguous()))
        out[str(i)] = rows
    return out
