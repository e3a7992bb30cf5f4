"""`pack_weights` / `unpack_weights`: the weight push's form in Ray's object store."""

from __future__ import annotations

import pickle

import torch
from train_app.weight_wire import pack_weights, unpack_weights


def test_packed_weights_pickle_out_of_band_and_unpack_to_equal_tensors():
    weights = {
        "w": torch.randn(64, 32),
        "bf16": torch.randn(16, 8).to(torch.bfloat16),
        "scalar": torch.tensor(3, dtype=torch.int64),
        "strided": torch.randn(8, 4).t(),
    }
    buffers: list[pickle.PickleBuffer] = []
    # Protocol 5 with a buffer callback is how Ray serializes: buffers go to the store as is.
    stream = pickle.dumps(pack_weights(weights), protocol=5, buffer_callback=buffers.append)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())

    assert len(stream) < nbytes // 4  # the tensors' bytes are not in the stream
    assert sum(b.raw().nbytes for b in buffers) == nbytes
    packed = pickle.loads(stream, buffers=buffers)
    unpacked = unpack_weights(packed)
    for name, tensor in weights.items():
        assert unpacked[name].dtype == tensor.dtype, name
        assert torch.equal(unpacked[name], tensor), name


def test_unpacked_tensors_share_the_fetched_buffers():
    packed = pack_weights({"w": torch.zeros(4, dtype=torch.bfloat16)})
    tensor = unpack_weights(packed)["w"]
    tensor.fill_(1)
    assert torch.equal(
        torch.from_numpy(packed.arrays["w"]), torch.full((4,), 16256, dtype=torch.int16)
    )


def test_other_forms_pass_through():
    weights = {"w": 1}
    assert unpack_weights(weights) is weights
