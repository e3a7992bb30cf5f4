"""Freshness-paced admission (rollout_engine.admission): the policy's arithmetic, and the real
Rollouter + FakeEngine + a simulated trainer on a virtual clock (`looptime`).

The pipeline tests are about scheduling, so the engine and the trainer are fakes: FakeEngine
decodes on `asyncio.sleep`, the trainer sleeps for its step time. `looptime` fast-forwards the
loop's clock whenever every coroutine is waiting, so hundreds of simulated seconds take well
under a second of CPU and the figures do not depend on the machine's load.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import looptime
import pytest
from rollout_engine import PromptSample, RolloutConfig, Rollouter, Trajectory
from rollout_engine.admission import (
    AdmissionPolicy,
    EagerPacing,
    FreshPacing,
    PacingPolicy,
    make_pacing,
)
from rollout_engine.testing import FakeEngine, FakeEngineConfig, make_prompts

# ---------------------------------------------------------------- the policy on its own


def test_eager_always_answers_k() -> None:
    eager = EagerPacing()
    eager.on_version(1.0)
    eager.on_group_generated(5.0)
    assert [eager.lookahead(k) for k in (0, 1, 2, 4)] == [0, 1, 2, 4]
    assert isinstance(eager, PacingPolicy)


def test_fresh_starts_at_one_and_never_leaves_zero_to_k() -> None:
    fresh = FreshPacing(samples_per_version=16, max_concurrency=16)
    assert isinstance(fresh, PacingPolicy)
    assert [fresh.lookahead(k) for k in (0, 1, 2, 4)] == [0, 1, 1, 1]


def test_fresh_lookahead_follows_latency_over_interval() -> None:
    fresh = FreshPacing(samples_per_version=16, max_concurrency=16, margin=0.25, smoothing=1.0)
    fresh.on_version(0.0)
    fresh.on_version(10.0)  # one version every 10 s
    fresh.on_group_generated(4.0)  # a batch takes 4 s: 4 * 1.25 / 10 -> 1
    assert fresh.lookahead(4) == 1
    fresh.on_group_generated(9.0)  # 9 * 1.25 / 10 = 1.125 -> 2
    assert fresh.lookahead(4) == 2
    fresh.on_group_generated(30.0)  # 3.75 -> 4, but never beyond k
    assert fresh.lookahead(4) == 4
    assert fresh.lookahead(2) == 2
    assert fresh.lookahead(0) == 0


def test_fresh_counts_generation_waves() -> None:
    # 16 groups a version, 4 at a time: a batch is 4 waves of the group latency.
    fresh = FreshPacing(samples_per_version=16, max_concurrency=4, margin=0.0, smoothing=1.0)
    fresh.on_version(0.0)
    fresh.on_version(10.0)
    fresh.on_group_generated(2.0)
    assert fresh.batch_latency_s == 8.0
    assert fresh.lookahead(3) == 1
    fresh.on_group_generated(3.0)  # 12 s a batch: 2 versions ahead
    assert fresh.lookahead(3) == 2


def test_fresh_smooths_observations() -> None:
    fresh = FreshPacing(samples_per_version=1, max_concurrency=1, smoothing=0.5)
    fresh.on_group_generated(2.0)
    fresh.on_group_generated(4.0)
    assert fresh.latency_s == 3.0
    fresh.on_version(0.0)
    assert fresh.interval_s is None  # one version is no interval yet
    fresh.on_version(2.0)
    fresh.on_version(6.0)
    assert fresh.interval_s == 3.0


@pytest.mark.parametrize(
    "bad",
    [
        {"samples_per_version": 0},
        {"max_concurrency": 0},
        {"margin": -0.1},
        {"smoothing": 0.0},
        {"smoothing": 1.5},
        {"initial_lookahead": -1},
    ],
)
def test_fresh_rejects_bad_parameters(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        FreshPacing(**{"samples_per_version": 4, "max_concurrency": 4, **bad})  # type: ignore[arg-type]


def test_make_pacing_and_config_validation() -> None:
    assert isinstance(make_pacing("eager", 4, 4), EagerPacing)
    assert isinstance(make_pacing("fresh", 4, 4), FreshPacing)
    with pytest.raises(ValueError, match="unknown pacing"):
        make_pacing("lazy", 4, 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pacing"):
        RolloutConfig(pacing="lazy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pacing_margin"):
        RolloutConfig(pacing_margin=-1.0)
    assert RolloutConfig().pacing == "fresh"


def test_budget_uses_the_lookahead_but_never_beyond_k() -> None:
    policy = AdmissionPolicy(max_staleness=2, samples_per_version=4)
    assert policy.budget(version=0, delivered=0, in_flight=0, lookahead=1) == 8
    assert policy.budget(version=0, delivered=0, in_flight=0, lookahead=0) == 4
    assert policy.budget(version=0, delivered=0, in_flight=0, lookahead=7) == 12
    assert policy.budget(version=0, delivered=0, in_flight=0) == 12


# ---------------------------------------------------------------- the pipeline, virtual clock


@dataclass
class PipelineResult:
    steps: int = 0
    wall_s: float = 0.0
    consumer_idle_s: float = 0.0
    # Per step: staleness of each response (v_trainer - min(token versions)), the
    # rollouter's lookahead at consumption, seconds waited for the batch, step seconds.
    staleness: list[list[int]] = field(default_factory=list)
    lookahead: list[int] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)

    @property
    def consumer_idle_ratio(self) -> float:
        return self.consumer_idle_s / self.wall_s

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s

    def staleness_mean(self, first: int = 0, last: int | None = None) -> float:
        return statistics.fmean(s for step in self.staleness[first:last] for s in step)

    def idle_ratio(self, first: int, last: int | None = None) -> float:
        """Seconds waited / seconds spent, over steps [first, last)."""
        return sum(self.waits[first:last]) / sum(self.step_s[first:last])


def _reward(sample: PromptSample, trajectory: Trajectory) -> float:
    return float(len(trajectory.response_ids))


async def _pipeline(
    pacing: str,
    *,
    steps: int,
    train_s: Callable[[int], float],
    time_per_token_s: float,
    k: int = 2,
    batch_size: int = 8,
    group_size: int = 4,
    max_concurrency: int = 8,
    seed: int = 0,
) -> PipelineResult:
    """The real Rollouter feeding a simulated trainer: take `batch_size` groups, "train" for
    `train_s(step)` seconds, push the next version; all on the running (virtual) clock."""
    loop = asyncio.get_running_loop()
    engine = FakeEngine(
        FakeEngineConfig(
            seed=seed,
            time_per_token_s=time_per_token_s,
            median_length=12,
            length_sigma=0.5,
            load_delay_s=0.005,
        )
    )
    delivered: asyncio.Queue[list[Trajectory]] = asyncio.Queue()

    class Sink:
        async def put(self, group: list[Trajectory]) -> None:
            delivered.put_nowait(group)

    rollouter = Rollouter(
        engine,
        make_prompts(steps * batch_size * 4),
        Sink(),
        _reward,
        RolloutConfig(
            group_size=group_size,
            max_concurrency=max_concurrency,
            groups_per_step=batch_size,
            max_staleness=k,
            pacing=pacing,  # type: ignore[arg-type]
        ),
        clock=loop.time,
    )
    run = asyncio.create_task(rollouter.run())
    result = PipelineResult()
    started = loop.time()
    for version in range(steps):  # the trainer trains step v at version v
        step_started = loop.time()
        groups = [await delivered.get() for _ in range(batch_size)]
        waited = loop.time() - step_started
        result.waits.append(waited)
        result.consumer_idle_s += waited
        result.lookahead.append(rollouter.lookahead)
        result.staleness.append(
            [version - min(t.token_versions) for g in groups for t in g if t.token_versions]
        )
        await asyncio.sleep(train_s(version))
        await rollouter.update_weights(None, version + 1)
        result.step_s.append(loop.time() - step_started)
    result.steps = steps
    result.wall_s = loop.time() - started
    await rollouter.stop()
    await run
    return result


def _virtual(coro: object) -> PipelineResult:
    loop = looptime.new_event_loop()
    try:
        return loop.run_until_complete(coro)  # type: ignore[arg-type]
    finally:
        loop.close()


# A group's responses take ~12 tokens (median; lognormal) at 10 ms a token: ~0.2 s a batch.
TOKEN_S = 0.01


def test_trainer_bound_fresh_keeps_samples_fresh_and_the_trainer_fed() -> None:
    """The trainer takes 0.5 s a step, a batch ~0.2 s to generate: eager runs k = 2 versions
    ahead (staleness ~2); fresh generates the next batch during the current step (~1)."""
    kwargs = {"steps": 120, "train_s": lambda _: 0.5, "time_per_token_s": TOKEN_S, "k": 2}
    fresh = _virtual(_pipeline("fresh", **kwargs))
    eager = _virtual(_pipeline("eager", **kwargs))
    assert fresh.staleness_mean() <= 1.1, fresh.staleness_mean()
    assert fresh.consumer_idle_ratio <= 0.05, fresh.consumer_idle_ratio
    assert eager.staleness_mean() >= 1.5  # the eager failure mode: the budget spent early
    assert max(max(s) for s in fresh.staleness) <= 2  # never beyond k
    assert fresh.steps_per_s >= 0.97 * eager.steps_per_s


def test_generator_bound_fresh_matches_eager_throughput() -> None:
    """The trainer takes 20 ms a step and generation is the bottleneck: fresh must run as
    far ahead as eager does, so steps/s stay within 5 %."""
    kwargs = {
        "steps": 80,
        "train_s": lambda _: 0.02,
        "time_per_token_s": TOKEN_S,
        "k": 2,
        "max_concurrency": 16,  # room for two batches in flight
    }
    fresh = _virtual(_pipeline("fresh", **kwargs))
    eager = _virtual(_pipeline("eager", **kwargs))
    assert fresh.steps_per_s >= 0.95 * eager.steps_per_s, (fresh.steps_per_s, eager.steps_per_s)
    assert fresh.lookahead[-1] == 2  # it opened up to k


def test_demand_that_changes_mid_run() -> None:
    """Fast trainer (generation-bound) for 60 steps, then a slow one (trainer-bound) for 60,
    then fast again: the lookahead follows the demand each way."""

    def train_s(step: int) -> float:
        return 0.5 if 60 <= step < 120 else 0.02

    result = _virtual(
        _pipeline("fresh", steps=180, train_s=train_s, time_per_token_s=TOKEN_S, max_concurrency=16)
    )
    assert max(result.lookahead[40:60]) == 2  # generation-bound: eager
    assert result.lookahead[110] == 1  # trainer-bound: fresh
    assert result.staleness_mean(90, 120) <= 1.1
    assert result.idle_ratio(90, 120) <= 0.05
    assert max(result.lookahead[160:180]) == 2  # generation-bound again


@pytest.mark.parametrize("k", [0, 1, 3])
def test_fresh_with_other_bounds(k: int) -> None:
    """k = 0 is sync (lookahead 0, staleness 0); larger k never lets staleness exceed k."""
    result = _virtual(
        _pipeline("fresh", steps=40, train_s=lambda _: 0.3, time_per_token_s=TOKEN_S, k=k)
    )
    assert max(max(s) for s in result.staleness) <= k
    assert set(result.lookahead) <= set(range(k + 1))
    if k == 0:
        assert result.staleness_mean() == 0


def test_batch_that_does_not_divide_the_concurrency() -> None:
    """batch 7, at most 3 groups in flight: three waves a version; the trainer stays fed."""
    result = _virtual(
        _pipeline(
            "fresh",
            steps=60,
            train_s=lambda _: 1.5,
            time_per_token_s=TOKEN_S,
            batch_size=7,
            max_concurrency=3,
        )
    )
    assert result.staleness_mean(10) <= 1.1
    assert result.consumer_idle_ratio <= 0.05
