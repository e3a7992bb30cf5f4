"""Packing groups into padded tensors."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from ppo_testkit import make_group
from ppo_trainer import MultiModalRef, pack_batch


def test_layout_of_prompt_response_and_padding() -> None:
    a, b = make_group("g", n=2, prompt_len=3, response_lens=[2, 4])
    a.behaviour_logprobs[:] = [-0.1, -0.2]
    b.behaviour_logprobs[:] = [-1.0, -2.0, -3.0, -4.0]
    batch = pack_batch([a, b], [0.5, -0.5], pad_token_id=0)
    assert batch.input_ids.shape == (2, 7)
    assert batch.input_ids[0].tolist() == [*a.prompt_token_ids, *a.response_ids, 0, 0]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0], [1] * 7]
    # target j predicts token j+1: the response starts at token 3, i.e. j = 2
    assert batch.response_mask.tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]
    assert batch.behav_logp[0].tolist() == pytest.approx([0, 0, -0.1, -0.2, 0, 0])
    assert batch.behav_logp[1].tolist() == pytest.approx([0, 0, -1, -2, -3, -4])
    assert batch.input_ids[1, 1:][batch.response_mask[1].bool()].tolist() == b.response_ids
    assert batch.advantages.tolist() == [0.5, -0.5]
    assert batch.num_response_tokens == 6
    assert batch.num_tokens == 12


def test_select_trims_to_the_rows_longest_sequence() -> None:
    group = make_group("g", n=3, prompt_len=2, response_lens=[1, 6, 2])
    batch = pack_batch(group, [1.0, 2.0, 3.0])
    sub = batch.select(torch.tensor([2, 0]))
    assert sub.input_ids.shape == (2, 4)
    assert sub.response_mask.shape == (2, 3)
    assert sub.advantages.tolist() == [3.0, 1.0]
    assert sub.input_ids[0].tolist() == [*group[2].prompt_token_ids, *group[2].response_ids]


def test_token_staleness_is_the_steps_version_minus_each_tokens() -> None:
    a, b = make_group("g", n=2, prompt_len=3, response_lens=[2, 4], version=1)
    b.token_versions[:] = [1, 2, 3, 5]  # tokens of several versions (partial rollout)
    assert pack_batch([a, b], [0.5, -0.5]).token_staleness is None  # no version given
    batch = pack_batch([a, b], [0.5, -0.5], version=3)
    assert batch.token_staleness is not None
    # at the response's target positions; a token newer than the step counts as 0
    assert batch.token_staleness.tolist() == [[0, 0, 2, 2, 0, 0], [0, 0, 2, 1, 0, 0]]
    assert batch.select(torch.tensor([1])).token_staleness.tolist() == [[0, 0, 2, 1, 0, 0]]


def test_validation() -> None:
    (t,) = make_group("g", n=1, response_lens=[3])
    with pytest.raises(ValueError, match="one advantage"):
        pack_batch([t], [])
    t.behaviour_logprobs.pop()
    with pytest.raises(ValueError, match="behaviour"):
        pack_batch([t], [0.0])
    (m,) = make_group("h", n=1)
    m.multimodal = MultiModalRef(messages_json="[]")
    with pytest.raises(ValueError, match="mm_inputs_fn"):
        pack_batch([m], [0.0])


def test_multimodal_inputs_are_built_once_per_ref_and_concatenated() -> None:
    group = make_group("g", n=3)
    for t in group:
        t.multimodal = MultiModalRef(messages_json='[{"image": "a.png"}]', image_sources=["a.png"])
    calls: list[MultiModalRef] = []

    def mm_fn(ref: MultiModalRef) -> Mapping[str, torch.Tensor]:
        calls.append(ref)
        return {"pixel_values": torch.ones(4, 6), "image_grid_thw": torch.tensor([[1, 2, 2]])}

    batch = pack_batch(group, [0.0] * 3, mm_inputs_fn=mm_fn)
    assert len(calls) == 1
    inputs = batch.select(torch.tensor([0, 2])).model_inputs()
    assert inputs["pixel_values"].shape == (8, 6)
    assert inputs["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2]]
