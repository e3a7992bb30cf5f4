"""The "flat" weight transport's file format: written by the engine, mapped by the worker."""

from __future__ import annotations

import os

import torch
from rollout_engine.vllm_engine import FLAT_ALIGNMENT, _save_flat_file
from rollout_engine.vllm_worker import _map_flat


def test_flat_file_round_trips_every_dtype_and_shape(tmp_path):
    embed = torch.randn(7, 5)
    weights = {
        "embed": embed,
        "tied_head": embed,  # the same storage under two names is written twice
        "bf16": torch.randn(3, 4, 2).to(torch.bfloat16),
        "half_odd": torch.randn(3).half(),  # 6 bytes: the next tensor must be realigned
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "ints": torch.arange(5, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(4, 6).t(),  # not contiguous
    }

    path, layout = _save_flat_file(weights, str(tmp_path))
    loaded = _map_flat(path, [list(entry) for entry in layout])  # the RPC turns tuples to lists

    assert list(loaded) == list(weights)
    for name, tensor in weights.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name
    assert all(offset % FLAT_ALIGNMENT == 0 for *_, offset in layout)
    loaded["embed"].add_(1)  # copy-on-write: the file keeps the pushed values
    assert torch.equal(_map_flat(path, layout)["embed"], embed)
    os.remove(path)


def test_flat_file_of_no_weights(tmp_path):
    path, layout = _save_flat_file({}, str(tmp_path))
    assert (layout, _map_flat(path, layout)) == ([], {})
    os.remove(path)
