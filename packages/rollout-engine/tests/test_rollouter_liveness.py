"""Liveness at the edges: a dead engine or sink ends `run()` with `RolloutFailed`.

These are scheduling tests, so the engine is `rollout_engine.testing.FakeEngine` (a fake) or a
tiny wrapper of it that misbehaves; the sinks are small fakes of the queue client.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections.abc import Iterator

import pytest
from rollout_engine import (
    PromptSample,
    RolloutConfig,
    Rollouter,
    RolloutFailed,
    SamplingConfig,
    Trajectory,
)
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink, make_prompts, wait_until


def zero_reward(sample: PromptSample, trajectory: Trajectory) -> float:
    return 0.0


def _assert_books(rollouter: Rollouter) -> None:
    s = rollouter.stats()
    assert s.admitted == s.delivered + s.failed + s.dropped + s.in_flight


# ------------------------------------------------------------------ consecutive failures


async def test_an_always_raising_engine_ends_run_with_rollout_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = FakeEngine(fail_request=lambda request_id: RuntimeError("engine core died"))
    config = RolloutConfig(group_size=2, max_concurrency=4, groups_per_step=1000)
    rollouter = Rollouter(engine, make_prompts(100_000), ListSink(), zero_reward, config)
    started = time.monotonic()
    with (
        caplog.at_level(logging.DEBUG, logger="rollout_engine"),
        pytest.raises(RolloutFailed) as raised,
    ):
        await asyncio.wait_for(rollouter.run(), timeout=10)
    assert time.monotonic() - started < 10
    error = raised.value
    assert isinstance(error.__cause__, RuntimeError)
    assert str(error.__cause__) == "engine core died"
    assert "RuntimeError: engine core died" in str(error)
    assert "32 consecutive" in str(error)
    assert error.consecutive_failures == 32
    stats = rollouter.stats()
    assert stats.state == "failed" == rollouter.state
    assert stats.in_flight == 0
    assert 32 <= stats.failed <= 32 + config.max_concurrency
    assert stats.delivered == 0
    _assert_books(rollouter)
    # Logged once with its traceback, then as a count: not once per group.
    records = [r for r in caplog.records if "engine core died" in r.getMessage()]
    assert sum(r.exc_info is not None for r in records) == 1
    assert len(records) <= 3
    assert any("repeated" in r.getMessage() for r in records)


class ClosedSink:
    """A queue client whose queue is closed: every put raises."""

    def __init__(self) -> None:
        self.puts = 0

    async def put(self, group: list[Trajectory]) -> None:
        self.puts += 1
        raise ConnectionError("queue is closed")


async def test_an_always_raising_sink_ends_run_with_rollout_failed() -> None:
    sink = ClosedSink()
    config = RolloutConfig(group_size=2, max_concurrency=3, max_consecutive_failures=5)
    rollouter = Rollouter(FakeEngine(), make_prompts(100_000), sink, zero_reward, config)
    with pytest.raises(RolloutFailed, match="ConnectionError: queue is closed") as raised:
        await asyncio.wait_for(rollouter.run(), timeout=10)
    assert isinstance(raised.value.__cause__, ConnectionError)
    assert 5 <= sink.puts <= 5 + config.max_concurrency
    assert rollouter.stats().in_flight == 0
    _assert_books(rollouter)


async def test_a_failure_streak_below_the_limit_does_not_stop_the_run() -> None:
    # Requests 0-9 fail, then everything works: 10 in a row < 11.
    failing = {f"p{i}" for i in range(10)}

    def fail(request_id: str) -> BaseException | None:
        return RuntimeError("warming up") if request_id.split(":")[0] in failing else None

    config = RolloutConfig(
        group_size=2, max_concurrency=1, groups_per_step=100, max_consecutive_failures=11
    )
    sink = ListSink()
    rollouter = Rollouter(
        FakeEngine(fail_request=fail), make_prompts(30), sink, zero_reward, config
    )
    stats = await asyncio.wait_for(rollouter.run(), timeout=10)
    assert (stats.state, stats.failed, stats.delivered) == ("finished", 10, 20)


async def test_deliveries_reset_the_streak() -> None:
    # Every other group fails: 15 failures in all, never 2 in a row.
    def fail(request_id: str) -> BaseException | None:
        index = int(request_id.split(":")[0][1:])
        return RuntimeError("flaky") if index % 2 else None

    config = RolloutConfig(
        group_size=1, max_concurrency=1, groups_per_step=100, max_consecutive_failures=2
    )
    rollouter = Rollouter(
        FakeEngine(fail_request=fail), make_prompts(30), ListSink(), zero_reward, config
    )
    stats = await asyncio.wait_for(rollouter.run(), timeout=10)
    assert (stats.state, stats.failed, stats.delivered) == ("finished", 15, 15)


async def test_cancellations_by_stop_do_not_count() -> None:
    engine = FakeEngine(FakeEngineConfig(time_per_token_s=0.05, fixed_length=1000))
    config = RolloutConfig(group_size=2, max_concurrency=4, max_consecutive_failures=1)
    rollouter = Rollouter(engine, make_prompts(100), ListSink(), zero_reward, config)
    run = asyncio.create_task(rollouter.run())
    await wait_until(lambda: len(engine.running_request_ids) == 4)
    await rollouter.stop()
    stats = await asyncio.wait_for(run, timeout=5)  # no RolloutFailed
    assert (stats.state, stats.failed) == ("stopped", 4)


def test_max_consecutive_failures_is_validated() -> None:
    with pytest.raises(ValueError, match="max_consecutive_failures"):
        RolloutConfig(max_consecutive_failures=0)
    assert RolloutConfig().max_consecutive_failures == 32


def test_rollout_failed_survives_pickling() -> None:
    import pickle

    error = RolloutFailed.after(3, KeyError("x"))
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error)
    assert copy.consecutive_failures == 3


# ------------------------------------------------------------------ weight pushes


class ResumeFailsOnce(FakeEngine):
    """The fake engine, but the first `resume()` raises after resuming (a flaky RPC)."""

    def __init__(self, config: FakeEngineConfig) -> None:
        super().__init__(config)
        self.resume_failures = 1

    async def resume(self) -> None:
        await super().resume()
        if self.resume_failures:
            self.resume_failures -= 1
            raise ConnectionError("resume RPC lost")


async def test_a_failing_resume_does_not_leave_the_rollouter_paused() -> None:
    engine = ResumeFailsOnce(FakeEngineConfig(time_per_token_s=0.001, fixed_length=5))
    config = RolloutConfig(group_size=2, max_concurrency=2, groups_per_step=2, max_staleness=0)
    sink = ListSink()
    rollouter = Rollouter(engine, make_prompts(40), sink, zero_reward, config)
    run = asyncio.create_task(rollouter.run())
    try:
        await wait_until(lambda: rollouter.state == "draining")
        with pytest.raises(ConnectionError, match="resume RPC lost"):
            await rollouter.update_weights(None, 1)
        # The weights were loaded: the rollouter reports them and admits again.
        assert rollouter.version == 1 == engine.version
        assert rollouter.state != "paused"
        await wait_until(lambda: rollouter.stats().admitted > 2, within_s=2)
        await rollouter.update_weights(None, 2)  # and later pushes work as usual
        assert rollouter.version == 2
    finally:
        await rollouter.stop()
        await asyncio.wait_for(run, timeout=5)
    _assert_books(rollouter)


# ------------------------------------------------------------------ stop


class StubbornSink:
    """A put that ignores cancellation (every one) for `linger_s`, then fails."""

    def __init__(self, linger_s: float) -> None:
        self.linger_s = linger_s
        self.entered = 0
        self.ended = 0

    async def put(self, group: list[Trajectory]) -> None:
        self.entered += 1
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(30)
        deadline = time.monotonic() + self.linger_s
        while (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(asyncio.CancelledError):  # ignores every cancellation
                await asyncio.sleep(left)
        self.ended += 1
        raise RuntimeError("ended late")


async def test_tasks_that_do_not_unwind_within_stop_timeout_are_counted_and_released() -> None:
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    sink = StubbornSink(linger_s=0.5)
    config = RolloutConfig(group_size=1, max_concurrency=3, stop_timeout_s=0.1)
    rollouter = Rollouter(FakeEngine(), make_prompts(50), sink, zero_reward, config)
    run = asyncio.create_task(rollouter.run())
    await wait_until(lambda: sink.entered == 3)
    started = time.monotonic()
    await rollouter.stop()
    stats = await asyncio.wait_for(run, timeout=5)
    assert time.monotonic() - started < 0.45  # did not wait for the stubborn tasks
    assert (stats.state, stats.in_flight, stats.failed, stats.admitted) == ("stopped", 0, 3, 3)
    assert all(f.cancelled and "did not unwind" in f.message for f in rollouter.failures)
    _assert_books(rollouter)
    await wait_until(lambda: sink.ended == 3, within_s=3)
    await asyncio.sleep(0.01)  # let the done-callbacks run
    del run
    gc.collect()
    await asyncio.sleep(0)
    assert not [c for c in unhandled if "never retrieved" in str(c.get("message"))]
    assert rollouter.stats().in_flight == 0


# ------------------------------------------------------------------ nothing grows with the run


async def test_failures_keep_the_last_n_counts_per_type_and_a_callback_sees_all() -> None:
    def fail(request_id: str) -> BaseException | None:
        index = int(request_id.split(":")[0][1:])
        return (KeyError if index % 3 else ValueError)(f"bad {index}") if index % 2 else None

    seen = []
    # batch_size 100: the staleness budget never blocks (there are no weight pushes here).
    config = RolloutConfig(group_size=1, max_concurrency=2, groups_per_step=100, recent_failures=5)
    rollouter = Rollouter(
        FakeEngine(fail_request=fail),
        make_prompts(80),
        ListSink(),
        zero_reward,
        config,
        on_failure=seen.append,
    )
    stats = await asyncio.wait_for(rollouter.run(), timeout=10)
    assert stats.failed == 40
    assert len(rollouter.failures) == 5
    assert list(rollouter.failures) == seen[-5:]
    assert len(seen) == 40
    expected = {"KeyError": 27, "ValueError": 13}
    assert rollouter.failure_counts == stats.failure_counts == expected


async def test_a_raising_on_failure_callback_is_ignored() -> None:
    def broken(failure: object) -> None:
        raise OSError("disk full")

    rollouter = Rollouter(
        FakeEngine(fail_request=lambda r: RuntimeError("x") if r.startswith("p1:") else None),
        make_prompts(4),
        ListSink(),
        zero_reward,
        RolloutConfig(group_size=1),
        on_failure=broken,
    )
    stats = await asyncio.wait_for(rollouter.run(), timeout=10)
    assert (stats.delivered, stats.failed) == (3, 1)


def test_drain_interrupt_latencies_are_a_bounded_window_with_a_running_max() -> None:
    from rollout_engine.metrics import DRAIN_INTERRUPT_WINDOW, RolloutCounters

    counters = RolloutCounters()
    for i in range(3 * DRAIN_INTERRUPT_WINDOW):
        counters.record_drain_interrupt(1000.0 if i == 7 else float(i % 10))
    assert len(counters.drain_interrupts_ms) == DRAIN_INTERRUPT_WINDOW
    assert counters.drain_interrupt_ms_max == 1000.0
    assert counters.last_drain_interrupt_ms == float((3 * DRAIN_INTERRUPT_WINDOW - 1) % 10)


# ------------------------------------------------------------------ CPU work off the loop


def slow_prompts(count: int) -> Iterator[PromptSample]:
    """A sync prompt generator that 'tokenizes' for 0.2 s per prompt."""
    for prompt in make_prompts(count):
        time.sleep(0.2)
        yield prompt


def slow_reward(sample: PromptSample, trajectory: Trajectory) -> float:
    """A reward function (not marked in any way) that takes 0.2 s."""
    time.sleep(0.2)
    return 1.0


async def _tick_gaps(until: asyncio.Task[object], interval_s: float = 0.01) -> list[float]:
    """How late each tick of a 10 ms ticker on the loop was, while `until` runs."""
    gaps = []
    last = time.monotonic()
    while not until.done():
        await asyncio.sleep(interval_s)
        now = time.monotonic()
        gaps.append(now - last - interval_s)
        last = now
    return gaps


async def test_slow_prompt_iterators_and_reward_functions_do_not_block_the_loop() -> None:
    sink = ListSink()
    config = RolloutConfig(group_size=2, max_concurrency=2)
    rollouter = Rollouter(FakeEngine(), slow_prompts(4), sink, slow_reward, config)
    run = asyncio.create_task(rollouter.run())
    gaps = await _tick_gaps(run)
    stats = await run
    assert stats.delivered == 4
    assert all(t.reward == 1.0 for t in sink.trajectories)
    # On the loop, each of the 4 prompts and 8 rewards would stall it for >= 0.2 s; allow
    # one long gap for a loaded machine.
    assert len([gap for gap in gaps if gap >= 0.15]) <= 1, sorted(gaps)[-5:]


async def test_a_reward_marked_non_blocking_runs_on_the_loop() -> None:
    loop_thread = threading.get_ident()
    threads: set[int] = set()

    def cheap_reward(sample: PromptSample, trajectory: Trajectory) -> float:
        threads.add(threading.get_ident())
        return 0.5

    cheap_reward.blocking = False  # type: ignore[attr-defined]
    rollouter = Rollouter(FakeEngine(), make_prompts(3), ListSink(), cheap_reward, RolloutConfig(2))
    await asyncio.wait_for(rollouter.run(), timeout=10)
    assert threads == {loop_thread}


# ------------------------------------------------------------------ staleness at delivery


class GatedSink(ListSink):
    """The first put waits until `release` is set (a full queue)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = asyncio.Event()
        self.release = asyncio.Event()

    async def put(self, group: list[Trajectory]) -> None:
        if not self.groups:
            self.waiting.set()
            await self.release.wait()
        await super().put(group)


async def test_staleness_is_measured_when_a_blocked_put_completes() -> None:
    sink = GatedSink()
    config = RolloutConfig(
        group_size=2, groups_per_step=1, max_staleness=0, sampling=SamplingConfig(max_tokens=8)
    )
    rollouter = Rollouter(FakeEngine(), make_prompts(1), sink, zero_reward, config)
    run = asyncio.create_task(rollouter.run())
    await asyncio.wait_for(sink.waiting.wait(), timeout=5)
    await rollouter.update_weights(None, 1)  # while the put waits
    sink.release.set()
    stats = await asyncio.wait_for(run, timeout=5)
    # Fresh when judged (just before the put), so delivered, not dropped; one version
    # old when the sink took it, and that is what the metrics report.
    assert (stats.delivered, stats.dropped) == (1, 0)
    assert {min(t.token_versions) for t in sink.trajectories} == {0}
    assert stats.staleness_max == 1
    assert rollouter.metrics()["staleness/max"] == 1.0
    assert stats.staleness_mean == 1.0
