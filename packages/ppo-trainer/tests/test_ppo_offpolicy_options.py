"""Off-policy options of a step on a real tiny Qwen2: clip-higher, the old-token fraction
metric, and deterministic (repeatable) steps."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ppo_testkit import ListSource, RecordingMetricsSink, make_group, tiny_qwen2
from ppo_trainer import PPOConfig, PPOTrainer
from ppo_trainer.staleness import old_token_fraction

# Several updates per step, so the ratios leave 1 and the clip range matters.
BASE = dict(lr=3e-2, batch_size=2, ppo_epochs=3, num_minibatches=2, max_staleness=10)


@pytest.fixture
def restore_determinism() -> Iterator[None]:
    """`deterministic=True` is process-wide: leave torch as the other tests expect it."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


async def _train(steps: int = 3, **overrides: Any) -> tuple[list[dict[str, Any]], PPOTrainer]:
    metrics = RecordingMetricsSink()
    trainer = PPOTrainer(tiny_qwen2(), PPOConfig(**{**BASE, **overrides}), metrics_sink=metrics)
    groups = [make_group(f"g{i}", seed=i, logprob=-3.4) for i in range(2 * steps)]
    await trainer.train(ListSource(groups))
    rows = [{k: v for k, v in m.items() if k.startswith("ppo/")} for _, m in metrics.records]
    return rows, trainer


async def test_clip_higher_defaults_to_the_symmetric_clip_and_changes_it_when_set() -> None:
    default, _ = await _train()
    symmetric, _ = await _train(clip_eps_high=0.2)
    assert default == symmetric
    higher, _ = await _train(clip_eps_high=0.6)
    assert higher != default
    # a wider upper bound clips fewer tokens over the run
    assert sum(r["ppo/clipfrac"] for r in higher) < sum(r["ppo/clipfrac"] for r in default)
    with pytest.raises(ValueError, match="clip_eps_high"):
        PPOConfig(clip_eps_high=-0.1)


def test_old_token_fraction_counts_generated_tokens_of_older_weights() -> None:
    group = make_group("a", n=2, response_lens=[4, 2], version=3)
    group[0].token_versions[:] = [1, 2, 3, 3]  # two tokens older than version 3
    group[1].token_versions[:] = [3, 2]
    group[1].loss_mask[:] = [1, 0]  # the old one is an observation: not generated
    assert old_token_fraction([group], 3) == pytest.approx(2 / 5)
    assert old_token_fraction([group], 1) == 0.0
    assert old_token_fraction([], 3) == 0.0


async def test_old_token_fraction_is_a_step_metric() -> None:
    metrics = RecordingMetricsSink()
    cfg = PPOConfig(batch_size=2, initial_version=2, max_staleness=10)
    trainer = PPOTrainer(tiny_qwen2(), cfg, metrics_sink=metrics)
    fresh, old = make_group("fresh", version=2), make_group("old", version=1)
    await trainer.train(ListSource([fresh, old]))
    total = sum(len(t.response_ids) for t in fresh + old)
    expected = sum(len(t.response_ids) for t in old) / total
    assert metrics.records[0][1]["staleness/old_token_frac"] == pytest.approx(expected)


@pytest.mark.usefixtures("restore_determinism")
async def test_two_deterministic_runs_give_identical_losses() -> None:
    first, a = await _train(deterministic=True, seed=5)
    assert torch.are_deterministic_algorithms_enabled()
    second, b = await _train(deterministic=True, seed=5)
    assert first == second  # exactly, every metric of every step
    theirs = b.model.state_dict()
    for name, tensor in a.model.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
    other, _ = await _train(deterministic=True, seed=6)  # the seed orders the minibatches
    assert other != first


async def test_clip_staleness_scale_tightens_the_clip_of_stale_tokens_only() -> None:
    default, _ = await _train()
    off, _ = await _train(clip_staleness_scale=0.0)
    assert off == default
    scaled, _ = await _train(clip_staleness_scale=1.0)
    # Step 1 trains at version 0 on tokens of version 0: nothing is stale, the same step.
    assert scaled[0] == default[0]
    # Later steps train on version-0 tokens at versions 1 and 2: a clip range of 0.1 and
    # 0.067 instead of 0.2 clips more of them.
    assert sum(r["ppo/clipfrac"] for r in scaled[1:]) > sum(r["ppo/clipfrac"] for r in default[1:])
    with pytest.raises(ValueError, match="clip_staleness_scale"):
        PPOConfig(clip_staleness_scale=-1.0)
