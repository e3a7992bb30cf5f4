"""On a CUDA machine the trainer's steps match the CPU's (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from ppo_testkit import ListSource, RecordingWeightSink, make_group, tiny_qwen2
from ppo_trainer import PPOConfig, PPOTrainer

pytestmark = pytest.mark.gpu


async def _train(device: str) -> dict[str, torch.Tensor]:
    model = tiny_qwen2(seed=0).to(device)
    config = PPOConfig(lr=1e-3, batch_size=2, ppo_epochs=2, total_steps=3, seed=0)
    trainer = PPOTrainer(model, config, weight_sink=RecordingWeightSink())
    groups = [make_group(f"g{i}", seed=i) for i in range(6)]
    summary = await trainer.train(ListSource(groups))
    assert summary.steps == 3
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


async def test_cuda_steps_match_cpu_steps() -> None:
    cpu = await _train("cpu")
    cuda = await _train("cuda")
    for name, tensor in cpu.items():
        torch.testing.assert_close(cuda[name], tensor, atol=2e-4, rtol=1e-3, msg=name)
