"""The trainer on a CUDA GPU: a bf16 step, FSDP2 over one rank, a checkpoint round trip and
the loss numerics against the CPU (all skipped without a GPU; `gpu_check.sh` runs them on a
bare GPU machine)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
from ppo_testkit import ListSource, RecordingWeightSink, make_group, tiny_qwen2
from ppo_trainer import PPOConfig, PPOTrainer, policy_loss, token_logprobs

pytestmark = pytest.mark.gpu

CONFIG = PPOConfig(lr=1e-3, batch_size=2, ppo_epochs=2, total_steps=3, seed=0)


def _groups(count: int, offset: int = 0) -> list:
    return [make_group(f"g{i}", seed=i) for i in range(offset, offset + count)]


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_bf16_step_changes_weights_and_keeps_dtype() -> None:
    model = tiny_qwen2(seed=0).to("cuda", torch.bfloat16)
    before = _state(model)
    trainer = PPOTrainer(model, CONFIG, weight_sink=RecordingWeightSink())
    try:
        summary = await trainer.train(ListSource(_groups(6)))
    finally:
        trainer.close()
    assert summary.steps == 3
    loss = float(summary.metrics["ppo/loss"])  # type: ignore[arg-type]
    assert loss == loss and abs(loss) < 1e3, loss  # finite, not blown up
    assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in model.parameters())
    after = _state(model)
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert changed, "no weight moved in three bf16 steps"


async def test_fsdp2_with_one_rank_matches_a_plain_trainer() -> None:
    from ppo_trainer import DataParallel

    plain_model = tiny_qwen2(seed=0).cuda()
    plain = PPOTrainer(plain_model, CONFIG)
    try:
        await plain.train(ListSource(_groups(6)))
    finally:
        plain.close()
    dp = DataParallel.init(0, 1, init_method=f"tcp://127.0.0.1:{_free_port()}", strategy="fsdp2")
    try:
        assert dp.strategy == "fsdp2" and dp.backend == "nccl"
        sharded = PPOTrainer(tiny_qwen2(seed=0).cuda(), CONFIG, data_parallel=dp)
        try:
            await sharded.train(ListSource(_groups(6)))
            full = dp.full_state_dict(sharded.model)
        finally:
            sharded.close()
    finally:
        dp.close()
    assert full is not None
    expected = _state(plain_model)
    for name, tensor in full.items():
        torch.testing.assert_close(tensor.float(), expected[name], atol=1e-5, rtol=1e-4, msg=name)


async def test_checkpoint_round_trip_on_cuda(tmp_path: Path) -> None:
    config = PPOConfig(lr=1e-3, batch_size=2, ppo_epochs=1, seed=0)
    first = PPOTrainer(tiny_qwen2(seed=0).cuda(), config)
    try:
        await first.train(ListSource(_groups(4)))
        saved = await first.save_checkpoint(tmp_path / "ckpt")
        await first.train(ListSource(_groups(2, offset=4)))
        continued = _state(first.model)
    finally:
        first.close()
    resumed = await PPOTrainer.resume(saved, tiny_qwen2(seed=1).cuda(), config)
    try:
        assert resumed.step == 2
        assert all(p.is_cuda for p in resumed.model.parameters())
        await resumed.train(ListSource(_groups(2, offset=4)))
        # Not bit-exact: CUDA's embedding backward accumulates with atomics (any order).
        for name, tensor in _state(resumed.model).items():
            torch.testing.assert_close(tensor, continued[name], atol=2e-4, rtol=1e-3, msg=name)
    finally:
        resumed.close()


def test_loss_numerics_on_cuda_match_cpu() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 48, 1000, generator=generator) * 4
    targets = torch.randint(0, 1000, (4, 48), generator=generator)
    prox = token_logprobs(logits, targets) + 0.05 * torch.randn(4, 48, generator=generator)
    behav = prox - 0.3 * torch.rand(4, 48, generator=generator)
    advantages = torch.randn(4, 1, generator=generator).expand(4, 48)
    mask = (torch.rand(4, 48, generator=generator) > 0.2).float()

    def compute(device: str) -> list[torch.Tensor]:
        moved = [t.to(device) for t in (logits, targets, prox, behav, advantages, mask)]
        lg, tg, px, bh, adv, m = moved
        logp = token_logprobs(lg, tg, temperature=0.7)
        loss, metrics = policy_loss(logp, px, adv, m, behav_logp=bh, clip_eps=0.2, is_cap=2.0)
        return [logp.cpu(), loss.cpu(), *(v.cpu() for _, v in sorted(metrics.items()))]

    for cpu, cuda in zip(compute("cpu"), compute("cuda"), strict=True):
        torch.testing.assert_close(cuda, cpu, atol=1e-5, rtol=1e-5)
