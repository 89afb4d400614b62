"""KVCache: preallocation, per-head keep, in-place slot writes, ring mode, exact byte counts."""

import torch

from attnkit.cache import KVCache, LayerKV


def kv(n, heads=2, d=4, start=0):
    pos = torch.arange(start, start + n)
    k = pos.float().view(1, 1, n, 1).expand(1, heads, n, d).clone()
    return k, k + 0.5, pos


def test_append_fills_preallocated_storage_without_reallocating():
    layer = LayerKV.allocate(1, 2, 10, 4, torch.float32, "cpu")
    ptr = layer.keys.data_ptr()
    for i in range(10):
        k, v, pos = kv(1, start=i)
        layer.append(k, v, pos)
    assert layer.keys.data_ptr() == ptr
    assert layer.length == 10
    keys, values, positions = layer.view()
    assert positions[0, 0].tolist() == list(range(10))
    assert torch.equal(values, keys + 0.5)
    assert layer.nbytes() == 2 * 1 * 2 * 10 * 4 * 4


def test_keep_per_head_compacts_and_frees():
    layer = LayerKV.allocate(1, 2, 8, 4, torch.float32, "cpu")
    layer.append(*kv(8))
    layer.extras["score"] = torch.arange(16.0).view(1, 2, 8)
    before = layer.nbytes()
    keep = torch.tensor([[[0, 5, 7], [1, 2, 3]]])
    layer.keep(keep, spare=1)
    assert layer.capacity == 4 and layer.length == 3
    assert layer.positions[0, 0, :3].tolist() == [0, 5, 7]
    assert layer.positions[0, 1, :3].tolist() == [1, 2, 3]
    assert layer.keys[0, 1, :3, 0].tolist() == [1.0, 2.0, 3.0]
    assert layer.extras["score"][0, 0, :3].tolist() == [0.0, 5.0, 7.0]
    assert layer.nbytes() == before * 4 // 8


def test_write_slots_overwrites_per_head_in_place():
    layer = LayerKV.allocate(1, 2, 4, 4, torch.float32, "cpu")
    layer.append(*kv(4))
    ptr = layer.keys.data_ptr()
    k, v, pos = kv(1, start=9)
    layer.write_slots(torch.tensor([[[2], [0]]]), k, v, pos)
    assert layer.keys.data_ptr() == ptr
    assert layer.positions[0].tolist() == [[0, 1, 9, 3], [9, 1, 2, 3]]
    assert layer.keys[0, 0, 2, 0].item() == 9.0


def test_ring_overwrites_oldest_slot():
    layer = LayerKV.allocate(1, 1, 4, 2, torch.float32, "cpu", ring=True)
    layer.append(*kv(6, heads=1, d=2))  # longer than the ring: the last 4 survive
    assert sorted(layer.view()[2][0, 0].tolist()) == [2, 3, 4, 5]
    layer.append(*kv(1, heads=1, d=2, start=6))
    assert sorted(layer.view()[2][0, 0].tolist()) == [3, 4, 5, 6]
    assert layer.positions[0, 0, 6 % 4].item() == 6


def test_kvcache_bytes_and_peak():
    cache = KVCache(3)
    cache.layers[0] = LayerKV.allocate(1, 2, 10, 4, torch.float32, "cpu")
    cache.layers[2] = LayerKV.allocate(1, 2, 5, 4, torch.float32, "cpu")
    cache.track_peak()
    assert cache.nbytes() == (10 + 5) * 2 * 2 * 4 * 4
    cache.layers[0].append(*kv(10))
    cache.layers[0].keep(torch.tensor([[[0, 1], [2, 3]]]))
    cache.track_peak()
    assert cache.nbytes() == (2 + 5) * 2 * 2 * 4 * 4
    assert cache.peak_bytes == (10 + 5) * 2 * 2 * 4 * 4
    assert cache.lengths() == [2, 0, 0]
