"""Training a tiny random Qwen2-VL on trajectories with images (fabricated pixel tensors)."""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch
from ppo_testkit import ListSource, RecordingMetricsSink
from ppo_trainer import MultiModalRef, PPOConfig, PPOTrainer, Timings, Trajectory

IMAGE, VIDEO, VISION_START, VISION_END = 35, 36, 37, 38
PATCH, TEMPORAL, MERGE = 2, 2, 2
GRID = (1, 4, 4)  # t, h, w patches -> 16 patches -> 16 / MERGE**2 = 4 image tokens
PATCH_DIM = 3 * TEMPORAL * PATCH * PATCH


def tiny_qwen2_vl() -> torch.nn.Module:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": 40,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
            },
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": PATCH,
            "temporal_patch_size": TEMPORAL,
            "spatial_merge_size": MERGE,
            "in_channels": 3,
        },
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=True,
    )

    class TokenTypedQwen2VL(Qwen2VLForConditionalGeneration):
        """The trainer passes only input_ids, attention_mask and the `mm_inputs_fn` tensors;
        transformers' Qwen2-VL also wants `mm_token_type_ids` (1 on image placeholders), so
        the model derives it, as the README says a model-specific argument should be."""

        def forward(self, input_ids=None, mm_token_type_ids=None, **kwargs):  # type: ignore[override]
            if mm_token_type_ids is None and input_ids is not None:
                mm_token_type_ids = (input_ids == self.config.image_token_id).long()
            return super().forward(
                input_ids=input_ids, mm_token_type_ids=mm_token_type_ids, **kwargs
            )

    return TokenTypedQwen2VL(config)


class FabricatedPixels:
    """A `MultiModalInputsFn`: one image of GRID patches per reference, seeded by its path."""

    def __init__(self) -> None:
        self.calls: list[MultiModalRef] = []

    def __call__(self, ref: MultiModalRef) -> Mapping[str, torch.Tensor]:
        self.calls.append(ref)
        seed = sum(map(ord, ref.image_sources[0]))
        g = torch.Generator().manual_seed(seed)
        patches = GRID[0] * GRID[1] * GRID[2]
        return {
            "pixel_values": torch.randn(patches, PATCH_DIM, generator=g),
            "image_grid_thw": torch.tensor([GRID]),
        }


def _vl_group(index: int, n: int = 3) -> list[Trajectory]:
    image = f"/images/{index}.png"
    ref = MultiModalRef(
        messages_json=json.dumps([{"role": "user", "content": [{"image": image}]}]),
        image_sources=[image],
    )
    n_tokens = GRID[1] * GRID[2] // MERGE**2
    prompt = [1, VISION_START, *([IMAGE] * n_tokens), VISION_END, 5 + index, 6]
    return [
        Trajectory(
            response_id=f"v{index}/{i}",
            group_id=f"v{index}",
            prompt_token_ids=prompt,
            response_ids=[7 + i, 8, 9 + i][: 2 + i % 2],
            behaviour_logprobs=[-3.5] * (2 + i % 2),
            token_versions=[0] * (2 + i % 2),
            finish_reason="stop",
            reward=float(i),
            timings=Timings(admitted_at=0.0),
            multimodal=ref,
        )
        for i in range(n)
    ]


async def test_qwen2_vl_trains_on_image_trajectories() -> None:
    model = tiny_qwen2_vl()
    vision_before = {k: v.detach().clone() for k, v in model.model.visual.named_parameters()}
    mm_fn = FabricatedPixels()
    metrics = RecordingMetricsSink()
    cfg = PPOConfig(lr=1e-2, batch_size=2, ppo_epochs=2, num_minibatches=2, grad_accum=2)
    trainer = PPOTrainer(model, cfg, mm_inputs_fn=mm_fn, metrics_sink=metrics)
    summary = await trainer.train(ListSource([_vl_group(0), _vl_group(1)]))
    assert summary.steps == 1
    assert sorted(ref.image_sources[0] for ref in mm_fn.calls) == ["/images/0.png", "/images/1.png"]
    # gradients reached the vision tower: the pixel inputs were part of the forward pass
    changed = [
        k for k, v in model.model.visual.named_parameters() if not torch.equal(v, vision_before[k])
    ]
    assert changed
    _, m = metrics.records[0]
    assert m["ppo/is_weight_mean"] > 0
    assert torch.isfinite(torch.tensor(m["ppo/loss"]))


async def test_qwen2_vl_with_a_value_head() -> None:
    """GAE on Qwen2-VL: the head reads the language model's last hidden state."""
    model = tiny_qwen2_vl()
    keys = set(model.state_dict())
    metrics = RecordingMetricsSink()
    cfg = PPOConfig(lr=1e-2, batch_size=2, num_minibatches=2, advantage="gae")
    trainer = PPOTrainer(model, cfg, mm_inputs_fn=FabricatedPixels(), metrics_sink=metrics)
    await trainer.train(ListSource([_vl_group(0), _vl_group(1)]))
    _, m = metrics.records[0]
    assert torch.isfinite(torch.tensor([m["ppo/loss"], m["ppo/value_loss"]])).all()
    assert set(trainer._updater.export_weights()) <= keys
