"""Weights through Ray's object store without copying them in-band.

Ray pickles a torch tensor in-band: every byte is copied into the pickle stream, then again
into the object store, then once more on the way out. A numpy array is pickled out-of-band
(protocol 5): the store takes one write of its buffer and a fetch maps it, zero-copy. So a
state dict crosses as `PackedWeights` (numpy views of the tensors, with the torch dtype
names) and `unpack_weights` rebuilds tensors over the fetched buffers, again without a copy.
Dtypes numpy lacks (bfloat16, float8) travel as integers of the same width.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import msgspec
import numpy as np
import torch

__all__ = ["PackedWeights", "pack_weights", "unpack_weights"]

# A same-width integer dtype to view tensors as when numpy has no dtype of theirs.
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PackedWeights(msgspec.Struct, frozen=True):
    """A state dict as numpy views: `arrays[name]` holds the bytes of a tensor of dtype
    `torch.<dtypes[name]>` and the array's shape."""

    arrays: dict[str, Any]
    dtypes: dict[str, str]


def pack_weights(weights: Mapping[str, torch.Tensor]) -> PackedWeights:
    """Numpy views of `weights` (CPU, contiguous; a tensor that is neither is copied once)."""
    arrays: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for name, tensor in weights.items():
        tensor = tensor.detach().to("cpu").contiguous()
        dtypes[name] = str(tensor.dtype).removeprefix("torch.")
        arrays[name] = _as_numpy(tensor)
    return PackedWeights(arrays=arrays, dtypes=dtypes)


def unpack_weights(weights: Any) -> Any:
    """Tensors over the buffers of a fetched `PackedWeights` (no copy); anything else is
    returned as is (a caller may push weights in another form)."""
    if not isinstance(weights, PackedWeights):
        return weights
    tensors: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        # Fetched arrays are read-only views of the object store; the loaders only read them.
        warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
        for name, array in weights.arrays.items():
            dtype = getattr(torch, weights.dtypes[name])
            tensors[name] = torch.from_numpy(array).view(dtype)
    return tensors


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    try:
        return tensor.numpy()
    except TypeError:  # bfloat16, float8...: numpy has no such dtype
        return tensor.view(_INT_OF_WIDTH[tensor.element_size()]).numpy()
