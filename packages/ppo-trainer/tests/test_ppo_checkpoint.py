"""Checkpoint + resume reproduces an uninterrupted run exactly (same deterministic data)."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from ppo_testkit import ListSource, RecordingWeightSink, make_group, tiny_qwen2
from ppo_trainer import PPOConfig, PPOTrainer, read_checkpoint_meta

CONFIG = PPOConfig(
    lr=3e-3,
    batch_size=2,
    ppo_epochs=2,
    num_minibatches=2,
    lr_schedule="cosine",
    warmup_steps=2,
    total_steps=8,
    sync_every=3,
    max_staleness=100,
    seed=7,
)
GROUPS = [make_group(f"g{i}", n=4, seed=3) for i in range(16)]  # 8 steps of 2 groups


async def test_resume_matches_straight_run(tmp_path: Path) -> None:
    straight = PPOTrainer(tiny_qwen2(seed=0), CONFIG)
    await straight.train(ListSource(GROUPS))
    assert straight.step == 8

    first = PPOTrainer(tiny_qwen2(seed=0), CONFIG)
    await first.train(ListSource(GROUPS[:8]))
    assert first.step == 4
    await first.save_checkpoint(tmp_path / "ckpt")

    # a fresh, differently initialised model: everything must come from the checkpoint
    weights = RecordingWeightSink()
    resumed = await PPOTrainer.resume(
        tmp_path / "ckpt", tiny_qwen2(seed=123), CONFIG, weight_sink=weights
    )
    assert (resumed.step, resumed.version) == (4, 1)
    done = set(resumed.consumed_response_ids)
    assert len(done) == 32
    assert resumed.consumed_prompt_ids == tuple(f"prompt-g{i}" for i in range(8))
    remaining = [g for g in GROUPS if g[0].response_id not in done]
    assert len(remaining) == 8
    summary = await resumed.train(ListSource(remaining))
    assert summary.reason == "total_steps"
    assert resumed.step == 8
    assert resumed.version == straight.version == 2
    assert weights.versions == [2]  # step 6 is the next multiple of sync_every
    expected = dict(straight.model.named_parameters())
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param, expected[name], atol=1e-6, rtol=0)
    lr = resumed.optimizer.param_groups[0]["lr"]
    assert lr == pytest.approx(straight.optimizer.param_groups[0]["lr"])


async def test_checkpoint_restores_rng_states_and_files(tmp_path: Path) -> None:
    trainer = PPOTrainer(tiny_qwen2(), CONFIG)
    torch.manual_seed(11)
    np.random.seed(11)
    random.seed(11)
    path = await trainer.save_checkpoint(tmp_path / "c")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    await trainer.load_checkpoint(path)
    torch.testing.assert_close(torch.rand(3), expected[0])
    np.testing.assert_array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json",
        "model.pt",
        "optimizer.pt",
        "rng.pt",
        "scheduler.pt",
        "trainer_state.json",
    ]
    meta = json.loads((path / "trainer_state.json").read_text())
    assert meta["config"]["lr"] == CONFIG.lr
    # saving again over the same path replaces it atomically, leaving no temporaries
    await trainer.save_checkpoint(path)
    assert [p.name for p in tmp_path.iterdir()] == ["c"]


async def test_periodic_checkpoints_from_train(tmp_path: Path) -> None:
    cfg = PPOConfig(
        batch_size=1,
        checkpoint_dir=str(tmp_path),
        checkpoint_every=2,
        keep_checkpoints=2,
        max_staleness=100,
    )
    trainer = PPOTrainer(tiny_qwen2(), cfg)
    await trainer.train(ListSource(GROUPS[:6]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000004", "step_000006"]
    latest = tmp_path / "latest"
    assert latest.is_symlink()
    assert latest.resolve() == (tmp_path / "step_000006").resolve()
    meta = read_checkpoint_meta(latest)  # torch-free: what a driver reads before resuming
    assert (meta.step, meta.version) == (6, 6)
    assert meta.consumed_group_ids == tuple(f"g{i}" for i in range(6))
    assert meta.consumed_prompt_ids == tuple(f"prompt-g{i}" for i in range(6))
    assert meta.consumed_response_ids == tuple(t.response_id for g in GROUPS[:6] for t in g)


async def test_on_checkpoint_adds_files_before_latest_moves(tmp_path: Path) -> None:
    """The hook (the app's: rollouters' in-flight partials) runs after the directory is
    written and before `latest` names it, for periodic and explicit saves alike."""
    seen: list[tuple[str, str | None]] = []

    async def hook(path: Path) -> None:
        assert (path / "trainer_state.json").exists()
        latest = tmp_path / "latest"
        seen.append((path.name, latest.resolve().name if latest.exists() else None))
        (path / "extra.bin").write_bytes(b"mine")

    cfg = PPOConfig(
        batch_size=1, checkpoint_dir=str(tmp_path), checkpoint_every=2, max_staleness=100
    )
    trainer = PPOTrainer(tiny_qwen2(), cfg, on_checkpoint=hook)
    await trainer.train(ListSource(GROUPS[:4]))
    await trainer.save_checkpoint(tmp_path / "manual")
    assert seen == [
        ("step_000002", None),
        ("step_000004", "step_000002"),
        ("manual", "step_000004"),
    ]
    assert (tmp_path / "latest" / "extra.bin").read_bytes() == b"mine"


async def test_gae_resume_restores_the_value_head(tmp_path: Path) -> None:
    cfg = dataclasses.replace(CONFIG, advantage="gae", value_lr=1e-2)
    straight = PPOTrainer(tiny_qwen2(seed=0), cfg)
    await straight.train(ListSource(GROUPS))

    first = PPOTrainer(tiny_qwen2(seed=0), cfg)
    await first.train(ListSource(GROUPS[:8]))
    path = await first.save_checkpoint(tmp_path / "ckpt")
    assert (path / "value_head.pt").exists()
    assert torch.load(path / "model.pt").keys() == tiny_qwen2().state_dict().keys()

    resumed = await PPOTrainer.resume(path, tiny_qwen2(seed=123), cfg)
    done = set(resumed.consumed_response_ids)
    await resumed.train(ListSource([g for g in GROUPS if g[0].response_id not in done]))
    assert resumed.step == straight.step == 8
    expected = dict(straight.model.named_parameters())
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param, expected[name], atol=1e-6, rtol=0)
    straight_head = straight._updater.value_head
    resumed_head = resumed._updater.value_head
    assert straight_head is not None and resumed_head is not None
    torch.testing.assert_close(resumed_head.weight, straight_head.weight, atol=1e-6, rtol=0)
    assert float(straight_head.weight.detach().abs().sum()) > 0  # it did train

    # a GRPO checkpoint cannot resume a GAE trainer (no head), nor the other way round
    grpo_path = await PPOTrainer(tiny_qwen2(), CONFIG).save_checkpoint(tmp_path / "grpo")
    with pytest.raises(ValueError, match=r"value_head\.pt"):
        await PPOTrainer.resume(grpo_path, tiny_qwen2(), cfg)
    with pytest.raises(ValueError, match="advantage='gae'"):
        await PPOTrainer.resume(path, tiny_qwen2(), CONFIG)
