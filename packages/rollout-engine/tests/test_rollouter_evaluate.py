"""`Rollouter.evaluate`: held-out prompts beside training, a separate admission class.

The engine is `rollout_engine.testing.FakeEngine`, a fake: these test the rollouter's
scheduling and accounting (admission, the staleness budget, the ledger, the sink), which do
not depend on what the tokens are.
"""

from __future__ import annotations

import asyncio

import pytest
from rollout_engine import (
    PromptSample,
    RolloutConfig,
    Rollouter,
    SamplingConfig,
    Trajectory,
    pass_at_k,
)
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink, make_prompts, wait_until


def length_reward(sample: PromptSample, trajectory: Trajectory) -> float:
    return len(trajectory.response_ids) / 10


def budget_config(**overrides: object) -> RolloutConfig:
    """k = 0 and two groups per version: admission stops after two groups until a push."""
    options: dict = {
        "group_size": 2,
        "max_concurrency": 8,
        "groups_per_step": 2,
        "max_staleness": 0,
        "pacing": "eager",
        "sampling": SamplingConfig(max_tokens=6),
    }
    return RolloutConfig(**{**options, **overrides})


async def test_evaluation_leaves_admission_budget_and_ledger_alone() -> None:
    engine = FakeEngine(FakeEngineConfig(seed=1, time_per_token_s=0.002, median_length=4))
    sink = ListSink()
    rollouter = Rollouter(engine, make_prompts(50), sink, length_reward, budget_config())
    run = asyncio.create_task(rollouter.run())
    try:
        # The budget is spent: two groups admitted, the loop drains until a weight push.
        await wait_until(lambda: rollouter.state == "draining" and not rollouter.stats().in_flight)
        before = rollouter.stats()
        assert (before.admitted, before.delivered, before.budget) == (2, 2, 0)

        held_out = make_prompts(5, prefix="held-")
        result = await asyncio.wait_for(
            rollouter.evaluate(held_out, SamplingConfig(max_tokens=6, temperature=0.0), n=3),
            timeout=10,
        )
        # Decoded while admission stayed closed: evaluation spends no budget.
        after = rollouter.stats()
        for field in ("admitted", "delivered", "failed", "dropped", "in_flight", "budget"):
            assert getattr(after, field) == getattr(before, field), field
        assert (after.trajectories, after.generated_tokens) == (
            before.trajectories,
            before.generated_tokens,
        )
        assert rollouter.state == "draining"
        assert len(rollouter.failures) == 0

        assert [g[0].prompt_id for g in result.scored] == [p.prompt_id for p in held_out]
        assert all(len(g) == 3 for g in result.scored) and result.failed == 0
        for group in result.scored:
            for t in group:
                assert t.reward == pytest.approx(len(t.response_ids) / 10)
                assert t.group_id.startswith("eval1:held-")
        assert result.version == 0 and result.seconds >= 0
        # Nothing of the evaluation reached the sink (the training queue).
        assert all(not g[0].prompt_id.startswith("held-") for g in sink.groups)
        eval_calls = [c for c in engine.calls if c.request_id.startswith("eval")]
        assert len(eval_calls) == 5 and {c.n for c in eval_calls} == {3}

        # Training goes on exactly as before: one push admits the next two groups.
        await rollouter.update_weights({}, 1)
        await wait_until(lambda: rollouter.stats().delivered == 4)
        assert rollouter.stats().admitted == 4
    finally:
        await rollouter.stop()
        await run


async def test_evaluation_continues_across_a_weight_push_and_counts_no_resubmit() -> None:
    """A push in abort mode aborts evaluation requests too; they continue with the new
    weights and are not counted in training's `resumed`."""
    engine = FakeEngine(FakeEngineConfig(seed=3, time_per_token_s=0.01, fixed_length=30))
    config = budget_config(
        partial_rollout=True, pause_mode="abort", sampling=SamplingConfig(max_tokens=30)
    )
    rollouter = Rollouter(engine, make_prompts(4), ListSink(), length_reward, config)
    evaluation = asyncio.create_task(rollouter.evaluate(make_prompts(2, prefix="e"), n=2))
    await wait_until(lambda: len(engine.running_request_ids) == 2)
    await asyncio.sleep(0.05)  # a few tokens of version 0 (0.01 s each)
    await rollouter.update_weights({}, 1)
    result = await asyncio.wait_for(evaluation, timeout=10)
    assert result.failed == 0 and result.version == 0
    versions = {v for g in result.scored for t in g for v in t.token_versions}
    assert versions == {0, 1}  # tokens before and after the push
    assert all(len(t.response_ids) == 30 for g in result.scored for t in g)
    assert rollouter.stats().resumed == 0 and rollouter.stats().admitted == 0


async def test_a_failing_evaluation_group_is_reported_not_raised() -> None:
    def picky(sample: PromptSample, trajectory: Trajectory) -> float:
        if sample.prompt_id == "x1":
            raise ValueError("no answer")
        return 1.0

    rollouter = Rollouter(FakeEngine(), make_prompts(1), ListSink(), length_reward)
    result = await rollouter.evaluate(make_prompts(3, prefix="x"), n=2, reward_fn=picky)
    assert result.failed == 1 and result.groups[1] is None
    assert result.errors[1] == "ValueError: no answer"
    assert result.mean_reward() == 1.0 and result.pass_at_k(1.0) == 1.0
    assert rollouter.failure_counts == {} and rollouter.stats().failed == 0


def test_pass_at_k() -> None:
    assert pass_at_k([[0.0, 1.0], [0.5, 0.2], [1.0, 1.0]], 1.0) == pytest.approx(2 / 3)
    assert pass_at_k([[0.5]], 0.5) == 1.0
    assert pass_at_k([], 1.0) != pass_at_k([], 1.0)  # NaN
