"""Dynamic sampling (`rollout_engine.group_filter`): groups whose rewards all match are
dropped at delivery, counted, and replaced, without stalling the consumer or loosening the
staleness bound.

Scheduling tests: FakeEngine decodes on `asyncio.sleep`, the trainer is simulated, and
`looptime` runs the loop on a virtual clock (figures do not depend on the machine's load).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import looptime
import pytest
from rollout_engine import (
    GroupFilter,
    PromptSample,
    RolloutConfig,
    Rollouter,
    RolloutStats,
    Trajectory,
    ZeroVarianceFilter,
)
from rollout_engine.group_filter import KeepEveryGroup, make_group_filter
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink, make_prompts

GROUP = 4


def _group(*rewards: float) -> list[Trajectory]:
    from rollout_engine import Timings

    return [
        Trajectory(
            response_id=f"g:{i}",
            group_id="g",
            prompt_token_ids=[1],
            response_ids=[2],
            behaviour_logprobs=[0.0],
            token_versions=[0],
            finish_reason="stop",
            reward=r,
            timings=Timings(admitted_at=0.0),
        )
        for i, r in enumerate(rewards)
    ]


def test_zero_variance_keeps_only_groups_with_a_reward_spread() -> None:
    zero = make_group_filter("zero-variance")
    assert isinstance(zero, GroupFilter) and isinstance(KeepEveryGroup(), GroupFilter)
    assert not zero.keep(_group(1.0, 1.0, 1.0))
    assert not zero.keep(_group(0.0, 0.0))
    assert not zero.keep(_group(0.5))  # one response: nothing to compare
    assert zero.keep(_group(0.0, 1.0, 1.0))
    assert not ZeroVarianceFilter(tolerance=0.2).keep(_group(0.0, 0.1))
    assert make_group_filter("none").keep(_group(1.0, 1.0))
    with pytest.raises(ValueError):
        make_group_filter("bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RolloutConfig(filter_groups="bogus")  # type: ignore[arg-type]


def _index(sample: PromptSample) -> int:
    return int(sample.prompt_id[1:])


def _reward(sample: PromptSample, trajectory: Trajectory) -> float:
    """Every third prompt is 'solved by all' (reward 1 for each response); the others reward
    only their first response, so their group has a spread."""
    if _index(sample) % 3 == 0:
        return 1.0
    return 1.0 if trajectory.response_id.endswith(":0") else 0.0


_reward.blocking = False  # type: ignore[attr-defined]


def _virtual(coro: Coroutine[Any, Any, Any]) -> Any:
    loop = looptime.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


async def _train(
    rollouter: Rollouter, sink: ListSink, steps: int, batch: int, k: int, step_s: float
) -> tuple[list[list[int]], int]:
    """A trainer as the real one behaves: it takes groups in delivery order, drops a group
    staler than `k` at consumption (and tells the rollouter, which frees its slot), trains
    `step_s` on `batch` groups and pushes a new version. Returns the per-step staleness of
    what it trained on and how many groups it dropped."""
    run = asyncio.create_task(rollouter.run())
    taken, dropped, staleness = 0, 0, []
    for version in range(steps):
        trained: list[int] = []
        while len(trained) < batch * GROUP:
            while len(sink.groups) <= taken:
                assert not run.done(), "the rollouter ended before the trainer was fed"
                await asyncio.sleep(0.01)
            group, taken = sink.groups[taken], taken + 1
            ages = [version - t.min_version for t in group]
            if max(ages) > k:
                dropped += 1
                rollouter.on_downstream_drop(1)
                continue
            trained.extend(ages)
        staleness.append(trained)
        await asyncio.sleep(step_s)
        await rollouter.update_weights(None, version + 1)
    await rollouter.stop()
    await run
    return staleness, dropped


@pytest.mark.parametrize("pacing", ["fresh", "eager"])
def test_filtered_groups_are_counted_replaced_and_the_bound_holds(pacing: str) -> None:
    """A third of the prompts give zero-variance groups. With the filter on, every step
    still gets a full batch within the bound, none of it zero-variance, and the books
    balance with the filtered groups counted.

    Replacements admitted after a filtered group can overtake an older group in flight,
    which then reaches the trainer one version late: as with any out-of-order completion the
    consumer's own check drops it (a few percent of groups here) and its slot is refilled."""
    k, batch, steps = 1, 4, 30
    sink = ListSink()
    config = RolloutConfig(
        group_size=GROUP,
        max_concurrency=4,
        groups_per_step=batch,
        max_staleness=k,
        pacing=pacing,  # type: ignore[arg-type]
        filter_groups="zero-variance",
    )
    engine = FakeEngine(FakeEngineConfig(seed=3, time_per_token_s=0.01))
    rollouter = Rollouter(engine, make_prompts(400), sink, _reward, config)

    async def main() -> tuple[list[list[int]], int, RolloutStats, dict[str, float]]:
        staleness, dropped = await _train(rollouter, sink, steps, batch, k, step_s=0.3)
        return staleness, dropped, rollouter.stats(), rollouter.metrics()

    staleness, dropped, stats, metrics = _virtual(main())
    assert len(staleness) == steps  # the trainer was never starved
    assert max(max(s) for s in staleness) <= k
    assert dropped <= 0.1 * steps * batch, dropped
    assert stats.downstream_dropped == dropped
    assert all(len({t.reward for t in g}) > 1 for g in sink.groups)
    assert stats.filtered > 0 and metrics["rollout/filtered_groups"] == stats.filtered
    assert all(int(g[0].prompt_id[1:]) % 3 != 0 for g in sink.groups)
    assert stats.admitted == stats.delivered + stats.failed + stats.dropped + stats.filtered
    assert stats.in_flight == 0


def test_without_the_filter_zero_variance_groups_are_delivered() -> None:
    sink = ListSink()
    config = RolloutConfig(
        group_size=GROUP, max_concurrency=4, groups_per_step=4, generation_only=True
    )
    engine = FakeEngine(FakeEngineConfig(seed=3, time_per_token_s=0.01))
    rollouter = Rollouter(engine, make_prompts(12), sink, _reward, config)
    stats = _virtual(rollouter.run())
    assert stats.delivered == 12 and stats.filtered == 0
    assert sum(1 for g in sink.groups if len({t.reward for t in g}) == 1) == 4


def test_generated_reward_counts_every_response_the_filter_left_out() -> None:
    """`rollout/generated_reward_sum` / `rollout/generated_responses` is the reward of what
    the policy generated, filtered groups included: here 4 of 12 prompts are solved by every
    response (reward 1 each) and filtered out, the other 8 reward one response of 4, so the
    delivered groups average 0.25 while everything generated averages 0.5."""
    sink = ListSink()
    config = RolloutConfig(
        group_size=GROUP,
        max_concurrency=4,
        groups_per_step=4,
        generation_only=True,
        filter_groups="zero-variance",
    )
    engine = FakeEngine(FakeEngineConfig(seed=3, time_per_token_s=0.01))
    rollouter = Rollouter(engine, make_prompts(12), sink, _reward, config)
    stats = _virtual(rollouter.run())
    assert (stats.delivered, stats.filtered) == (8, 4)
    delivered = [t.reward for g in sink.groups for t in g]
    assert sum(delivered) / len(delivered) == 0.25
    metrics = rollouter.metrics()
    assert metrics["rollout/generated_responses"] == stats.generated_responses == 12 * GROUP
    assert metrics["rollout/generated_reward_sum"] == stats.generated_reward_sum == 24.0
