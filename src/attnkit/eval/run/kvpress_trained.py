"""kvpress's presses whose weights their authors trained, built on weights given as files instead of downloaded:
``FastKVzipPress`` (its gates, the authors' torch file ``{"module": [state dict per layer]}``), ``LUKVPress`` (its
budget curve, a ``.npy`` ``[99, layers, kv heads]``) and ``RestoreKVPress`` (a folder holding a peft LoRA adapter and
``restore_embeddings.safetensors``, as on the hub). Imported by :mod:`attnkit.eval.run.kvpress_worker` in
kvpress's own environment: only the standard library, torch, numpy and kvpress, never attnkit."""

from __future__ import annotations

import numpy as np
import torch


def fastkvzip_press(path: str, ratio: float, layerwise: bool, n_sink: int, window_ratio: float):
    """``FastKVzipPress`` whose ``gates`` are kvpress's own ``FastKVzipGate`` modules holding the file's weights (its
    ``post_init_from_model`` then downloads nothing)."""
    from kvpress.presses.fastkvzip_press import FastKVzipGate, FastKVzipPress

    layers = torch.load(path, map_location="cpu", weights_only=True)["module"]
    gates = []
    for i, state in enumerate(layers):
        heads, _, sinks, dim = state["k_base"].shape
        group = state["b"].shape[-1]
        gate = FastKVzipGate(i, state["k_proj.weight"].shape[1], heads, group, state["q_proj.weight"].dtype, dim,
                             sinks)
        gate.load_state_dict(state)
        gates.append(gate.eval())
    press = FastKVzipPress(compression_ratio=ratio, layerwise=layerwise, n_sink=n_sink, window_ratio=window_ratio)
    press.gates = gates
    return press


def lukv_press(path: str, ratio: float, sink: int, window: int, epsilon: float):
    """``LUKVPress(ExpectedAttentionPress(epsilon))`` with the curve of a ``.npy`` file set before its
    ``post_init_from_model`` would fetch the published one."""
    from kvpress import ExpectedAttentionPress
    from kvpress.presses.lukv_press import LUKVPress

    press = LUKVPress(press=ExpectedAttentionPress(epsilon=epsilon), compression_ratio=ratio, sink=sink, window=window)
    press._budget_curves = np.load(path, allow_pickle=False)
    return press



def restorekv_press(folder: str, ratio: float, layerwise: bool, n_sink: int, chunk_size: int):
    """``RestoreKVPress`` whose restore embeddings and LoRA adapter come from `folder` (``attnkit calibrate restorekv
    --kvpress-dir``) instead of ``higokri/RestoreKV-<model>``: its ``post_init_from_model`` is answered on the instance
    by loading the adapter into the model once (transformers' ``load_adapter``, peft), switched off as kvpress's own
    leaves it; the press switches it on for the restore pass only."""
    from kvpress.presses.restorekv_press import RestoreKVPress
    from safetensors.torch import load_file

    press = RestoreKVPress(compression_ratio=ratio, layerwise=layerwise, n_sink=n_sink, chunk_size=chunk_size)

    def given(model):
        if press.restore_embeddings is None:
            embeddings = load_file(f"{folder}/restore_embeddings.safetensors")["restore_embeddings"]
            press.restore_embeddings = embeddings.to(model.device, dtype=model.dtype)
        if press.adapter_name not in getattr(model, "peft_config", {}):
            model.load_adapter(folder, adapter_name=press.adapter_name)
        model.disable_adapters()

    press.post_init_from_model = given
    return press
