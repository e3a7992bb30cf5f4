"""The async trainer loop on a real tiny Qwen2; sources and sinks are in-memory stand-ins."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

import pytest
from ppo_testkit import (
    ListSource,
    RecordingMetricsSink,
    RecordingWeightSink,
    make_group,
    tiny_qwen2,
)
from ppo_trainer import (
    MaxStaleness,
    PPOConfig,
    PPOTrainer,
    StalenessBound,
    Trajectory,
    export_weights,
)
from ppo_trainer.config import DEFAULT_MAX_STALENESS

DESIGN_METRICS = {
    "ppo/loss",
    "ppo/clipfrac",
    "ppo/approx_kl",
    "ppo/entropy",
    "ppo/is_weight_mean",
    "trainer/step_s",
    "trainer/idle_ratio",
    "staleness/mean",
    "staleness/max",
    "staleness/hist",
    "reward/mean",
    "weights/sync_s",
    "tokens/s",
}


class ProducerFailed(Exception):
    """Stands in for async_queue.ProducerFailed."""


class QueueClosed(Exception):
    """Stands in for async_queue.QueueClosed."""


def _groups(count: int, version: int = 0, prefix: str = "g") -> list[list[Trajectory]]:
    return [make_group(f"{prefix}{i}", n=4, version=version) for i in range(count)]


async def test_trains_until_the_stream_ends_and_pushes_weights() -> None:
    weights, metrics = RecordingWeightSink(), RecordingMetricsSink()
    cfg = PPOConfig(lr=1e-3, batch_size=2, sync_every=2, max_staleness=10)
    trainer = PPOTrainer(tiny_qwen2(), cfg, metrics_sink=metrics)
    before = trainer.model.lm_head.weight.detach().clone()
    summary = await trainer.train(ListSource(_groups(9)), weights)
    # 9 groups in batches of 2: 4 full steps + the partial last batch
    assert summary.reason == "end_of_stream"
    assert (summary.steps, summary.step, summary.groups, summary.samples) == (5, 5, 9, 36)
    assert weights.versions == [1, 2]  # pushed after steps 2 and 4
    assert summary.version == trainer.version == 2
    assert not (trainer.model.lm_head.weight == before).all()
    assert [step for step, _ in metrics.records] == [1, 2, 3, 4, 5]
    synced = metrics.records[1][1]
    assert synced.keys() >= DESIGN_METRICS
    assert "weights/sync_s" not in metrics.records[0][1]  # only logged when a push happens
    assert len(trainer.consumed_response_ids) == 36
    assert trainer.consumed_group_ids == tuple(f"g{i}" for i in range(9))
    assert summary.as_dict()["steps"] == 5
    stats = trainer.stats()
    assert stats["trainer/step"] == 5.0
    assert stats["trainer/running"] == 0.0
    assert 0.0 <= summary.idle_ratio <= 1.0
    pushed = weights.pushes[-1][1]
    assert (
        pushed["model.embed_tokens.weight"].data_ptr()
        != trainer.model.model.embed_tokens.weight.data_ptr()
    )


async def test_behav_logprob_diff_only_while_the_weights_are_the_version() -> None:
    """sync_every = 2: the weights equal version v only on the step right after a push (or at
    the start); only then, and only for samples of version v, is the metric logged."""
    metrics = RecordingMetricsSink()
    cfg = PPOConfig(lr=1e-2, batch_size=1, sync_every=2, max_staleness=10)
    trainer = PPOTrainer(tiny_qwen2(), cfg, metrics_sink=metrics)
    versions = [0, 0, 1, 1, 0]  # the last: staleness 2 at version 2, not on-policy
    groups = [make_group(f"g{i}", n=2, version=v) for i, v in enumerate(versions)]
    await trainer.train(ListSource(groups))
    present = ["ppo/behav_logprob_diff" in m for _, m in metrics.records]
    assert present == [True, False, True, False, False]
    # make_group's behaviour log-prob is -3.0; a fresh model is near uniform over 32 tokens
    assert metrics.records[0][1]["ppo/behav_logprob_diff"] == pytest.approx(
        abs(-3.0 + 3.466), abs=0.2
    )


async def test_gae_trainer_pushes_only_the_policy_weights() -> None:
    weights, metrics = RecordingWeightSink(), RecordingMetricsSink()
    cfg = PPOConfig(lr=1e-3, batch_size=2, advantage="gae", max_staleness=10)
    trainer = PPOTrainer(tiny_qwen2(), cfg, metrics_sink=metrics, weight_sink=weights)
    await trainer.train(ListSource(_groups(4)))
    assert weights.versions == [1, 2]
    assert set(weights.pushes[-1][1]) == set(export_weights(tiny_qwen2()))
    for _, m in metrics.records:
        assert {"ppo/value_loss", "ppo/vf_clipfrac", "ppo/value_mean", "ppo/ppo_kl"} <= m.keys()


async def test_stale_groups_are_dropped_and_staleness_is_recorded() -> None:
    cfg = PPOConfig(batch_size=3, max_staleness=2, initial_version=5)
    metrics = RecordingMetricsSink()
    trainer = PPOTrainer(tiny_qwen2(), cfg, metrics_sink=metrics)
    groups = [
        make_group("fresh", version=5),
        make_group("old", version=2),  # staleness 3 > 2: dropped
        make_group("ok", version=3),  # staleness 2
        make_group("one", version=4),  # staleness 1
    ]
    groups[2][0].token_versions[0] = 4  # min over tokens counts, not the max
    summary = await trainer.train(ListSource(groups))
    assert summary.dropped_groups == 1
    assert summary.groups == 3
    _, m = metrics.records[0]
    assert m["staleness/max"] == 2.0
    assert m["staleness/mean"] == pytest.approx(1.0)
    assert m["staleness/hist"] == [1, 1, 1]
    assert m["staleness/dropped"] == 1.0
    assert trainer.stats()["staleness/dropped"] == 1.0
    assert "old/0" in trainer.consumed_response_ids  # dropped ones are done too


def test_the_staleness_histogram_pads_to_a_small_bound_only() -> None:
    from ppo_trainer.staleness import HIST_PADDED_UP_TO, staleness_metrics

    assert staleness_metrics([0, 1, 1], max_staleness=4)["staleness/hist"] == [1, 2, 0, 0, 0]
    assert staleness_metrics([], max_staleness=2)["staleness/hist"] == [0, 0, 0]
    assert staleness_metrics([3], max_staleness=1)["staleness/hist"] == [0, 0, 0, 1]
    assert len(staleness_metrics([0], HIST_PADDED_UP_TO)["staleness/hist"]) == HIST_PADDED_UP_TO + 1
    # A bound meant as "no bound" gives a histogram as long as what was seen, not 10**6 zeros.
    assert staleness_metrics([0, 2], max_staleness=1_000_000)["staleness/hist"] == [1, 0, 1]


async def test_a_staleness_bound_value_decides_what_is_dropped() -> None:
    """Any object with `max_staleness` and `too_stale` (rollout-engine's `StalenessBound`
    in the app) replaces the config's bound; here one that only takes fresh groups."""

    @dataclasses.dataclass(frozen=True)
    class OnlyFresh:
        max_staleness: int = 0

        def too_stale(self, staleness: int) -> bool:
            return staleness > self.max_staleness

    bound = OnlyFresh()
    assert isinstance(bound, StalenessBound)
    metrics = RecordingMetricsSink()
    cfg = PPOConfig(batch_size=2, max_staleness=10, initial_version=3)
    trainer = PPOTrainer(tiny_qwen2(), cfg, metrics_sink=metrics, staleness_bound=bound)
    assert trainer.staleness_bound is bound
    groups = [make_group("a", version=3), make_group("b", version=2), make_group("c", version=3)]
    summary = await trainer.train(ListSource(groups))
    assert (summary.groups, summary.dropped_groups) == (2, 1)
    assert metrics.records[0][1]["staleness/hist"] == [2]


def test_the_default_bound_is_the_stacks_one() -> None:
    trainer = PPOTrainer(tiny_qwen2())
    assert PPOConfig().max_staleness == DEFAULT_MAX_STALENESS == 2
    assert trainer.staleness_bound == MaxStaleness(2)
    assert trainer.staleness_bound.too_stale(3) and not trainer.staleness_bound.too_stale(2)


async def test_source_failure_propagates_with_its_cause() -> None:
    cause = RuntimeError("rollouter died")
    error = ProducerFailed("producer failed")
    error.__cause__ = cause
    weights = RecordingWeightSink()
    trainer = PPOTrainer(tiny_qwen2(), PPOConfig(batch_size=2), weight_sink=weights)
    with pytest.raises(ProducerFailed) as info:
        await trainer.train(ListSource(_groups(3), error=error))
    assert info.value is error
    assert info.value.__cause__ is cause
    assert trainer.step == 1  # the full batch before the failure was trained
    assert trainer.stats()["trainer/running"] == 0.0


async def test_batch_source_with_end_of_stream_exception() -> None:
    class Queue:
        def __init__(self, groups: list[list[Trajectory]], error: Exception) -> None:
            self.groups, self.error, self.calls = groups, error, []

        async def next_batch(self, n: int, current_version: int) -> list[list[Trajectory]]:
            self.calls.append((n, current_version))
            if not self.groups:
                raise self.error
            out, self.groups = self.groups[:n], self.groups[n:]
            return out

    queue = Queue(_groups(4), QueueClosed())
    trainer = PPOTrainer(tiny_qwen2(), PPOConfig(batch_size=2))
    summary = await trainer.train(queue, end_of_stream=(QueueClosed,))
    assert summary.reason == "end_of_stream"
    assert summary.steps == 2
    assert queue.calls == [(2, 0), (2, 1), (2, 2)]  # the trainer's version at each pull

    failing = Queue(_groups(2), ProducerFailed("boom"))
    with pytest.raises(ProducerFailed):
        await PPOTrainer(tiny_qwen2(), PPOConfig(batch_size=2)).train(
            failing, end_of_stream=(QueueClosed,)
        )


async def test_total_steps_ends_training() -> None:
    trainer = PPOTrainer(tiny_qwen2(), PPOConfig(batch_size=1, total_steps=2))
    source = ListSource(_groups(5))
    summary = await trainer.train(source)
    assert summary.reason == "total_steps"
    assert trainer.step == 2
    assert source.yielded == 2


async def test_stop_while_waiting_for_data_returns_promptly() -> None:
    never = asyncio.Event()

    async def slow_source():  # two groups, then waits forever
        for group in _groups(2):
            yield group
        await never.wait()

    trainer = PPOTrainer(tiny_qwen2(), PPOConfig(batch_size=2))
    task = asyncio.create_task(trainer.train(slow_source()))
    while trainer.step < 1:
        await asyncio.sleep(0.01)
    trainer.stop()
    summary = await asyncio.wait_for(task, timeout=30)
    assert summary.reason == "stopped"
    assert summary.steps == 1


async def test_stop_during_a_step_finishes_the_step_first() -> None:
    weights = RecordingWeightSink()
    trainer = PPOTrainer(tiny_qwen2(), PPOConfig(batch_size=4), weight_sink=weights)
    task = asyncio.create_task(trainer.train(ListSource(_groups(40))))
    while trainer.stats()["trainer/in_step"] != 1.0:
        await asyncio.sleep(0.001)
    trainer.stop()
    summary = await asyncio.wait_for(task, timeout=30)
    assert summary.reason == "stopped"
    assert summary.steps == 1
    assert weights.versions == [1]


async def test_event_loop_stays_responsive_during_a_step() -> None:
    """A ticker coroutine keeps running (and reading stats()) while the torch step computes."""
    weights = RecordingWeightSink()
    cfg = PPOConfig(batch_size=8, ppo_epochs=2, num_minibatches=2)
    trainer = PPOTrainer(tiny_qwen2(), cfg, weight_sink=weights)
    groups = [make_group(f"g{i}", n=4, prompt_len=16, response_lens=[48] * 4) for i in range(8)]
    source = ListSource(groups)
    ticks: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            trainer.stats()
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.002)

    tick_task = asyncio.create_task(ticker())
    summary = await trainer.train(source)
    done.set()
    await tick_task
    step_s = summary.metrics["trainer/step_s"]
    step_end = weights.pushes[0][2]
    step_start = source.last_yield_at
    during = [t for t in ticks if step_start <= t <= step_end]
    assert step_s > 0.05
    # a blocked loop would tick ~once; a free one ticks every few ms of the step
    assert len(during) >= 10, (len(during), step_s)
    gaps = [b - a for a, b in itertools.pairwise(during)]
    assert max(gaps) < max(0.5, step_s / 2)


class SlowWeightSink:
    """A push that takes `delay_s`; records when each push starts and ends, and how many
    overlap (the trainer must never run two at once)."""

    def __init__(self, delay_s: float, fail_at: int | None = None) -> None:
        self.delay_s, self.fail_at = delay_s, fail_at
        self.spans: list[tuple[int, float, float]] = []
        self.concurrent = self.max_concurrent = 0

    async def push_weights(self, weights: dict, version: int) -> None:
        started = time.perf_counter()
        self.concurrent += 1
        self.max_concurrent = max(self.max_concurrent, self.concurrent)
        try:
            await asyncio.sleep(self.delay_s)
            if version == self.fail_at:
                raise RuntimeError(f"push {version} failed")
        finally:
            self.concurrent -= 1
        self.spans.append((version, started, time.perf_counter()))


async def test_background_push_overlaps_the_next_step_in_version_order() -> None:
    sink, metrics = SlowWeightSink(0.3), RecordingMetricsSink()
    trainer = PPOTrainer(
        tiny_qwen2(), PPOConfig(batch_size=1, max_staleness=10), metrics_sink=metrics
    )
    source = ListSource(_groups(4))
    summary = await trainer.train(source, sink)
    assert summary.steps == 4
    # Every push landed before train() returned, one at a time, in version order.
    assert [v for v, _, _ in sink.spans] == [1, 2, 3, 4]
    assert sink.max_concurrent == 1
    assert sink.spans[1][1] >= sink.spans[0][2]  # push 2 started after push 1 ended
    # The push's own duration is reported once a push has landed.
    assert metrics.records[-1][1]["weights/push_s"] >= 0.3


async def test_background_push_lets_the_source_run_during_a_push() -> None:
    sink = SlowWeightSink(0.5)
    trainer = PPOTrainer(tiny_qwen2(), PPOConfig(batch_size=1, max_staleness=10))
    source = ListSource(_groups(2))
    await trainer.train(source, sink)
    # Group 2 was taken before push 1 ended (the trainer did not wait for it).
    assert source.last_yield_at < sink.spans[0][2]


async def test_foreground_push_waits_for_each_push() -> None:
    sink = SlowWeightSink(0.3)
    cfg = PPOConfig(batch_size=1, max_staleness=10, background_push=False)
    source = ListSource(_groups(2))
    await PPOTrainer(tiny_qwen2(), cfg).train(source, sink)
    assert source.last_yield_at > sink.spans[0][2]


async def test_a_failed_background_push_is_raised_by_train() -> None:
    sink = SlowWeightSink(0.05, fail_at=2)
    trainer = PPOTrainer(tiny_qwen2(), PPOConfig(batch_size=1, max_staleness=10))
    with pytest.raises(RuntimeError, match="push 2 failed"):
        await trainer.train(ListSource(_groups(5)), sink)
    assert [v for v, _, _ in sink.spans] == [1]
