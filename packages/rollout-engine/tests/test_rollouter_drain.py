"""The drain loop is interrupted by a weight push (the original bug: after a weight sync the
drain loop waited for the slowest in-flight sequence, holding a lock, before idle replicas got
new prompts).

The engine is `rollout_engine.testing.FakeEngine`, a fake: these are scheduling tests. Each
in-flight group lasts 5 s of real time; the admission budget (k = 0, two groups per version)
is exhausted, so the loop sits in its drain wait when the push arrives.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from rollout_engine import RolloutConfig, Rollouter, SamplingConfig
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink, make_prompts, wait_until

# 100 tokens at 50 ms each: every in-flight group takes 5 s.
FIVE_SECOND_GROUPS = FakeEngineConfig(time_per_token_s=0.05, fixed_length=100)
ACCEPTANCE_MS = 100  # the bound from on_weights to the next dispatch


def _draining_rollouter(pause_mode: str = "keep") -> tuple[FakeEngine, Rollouter]:
    engine = FakeEngine(FIVE_SECOND_GROUPS)
    config = RolloutConfig(
        group_size=2,
        max_concurrency=8,
        groups_per_step=2,
        sync_every=1,
        max_staleness=0,  # budget = (0 + 1 + v) * 2 groups
        pause_mode=pause_mode,  # type: ignore[arg-type]
        sampling=SamplingConfig(max_tokens=200),
    )
    return engine, Rollouter(engine, make_prompts(50), ListSink(), lambda s, t: 0.0, config)


def _new_group_calls(engine: FakeEngine) -> list[float]:
    """Receive times of fresh groups (continuations of aborted requests are n=1)."""
    return [c.received_at for c in engine.calls if c.n == 2]


async def _enter_drain_wait(engine: FakeEngine, rollouter: Rollouter) -> None:
    await wait_until(lambda: rollouter.state == "draining" and len(engine.running_request_ids) == 2)


def _assert_accounted(rollouter: Rollouter) -> None:
    s = rollouter.stats()
    assert s.admitted == s.delivered + s.failed + s.dropped + s.in_flight


async def test_on_weights_dispatches_next_group_within_100ms_while_5s_groups_are_in_flight() -> (
    None
):
    engine, rollouter = _draining_rollouter()
    run = asyncio.create_task(rollouter.run())
    try:
        await _enter_drain_wait(engine, rollouter)
        await asyncio.sleep(0.2)  # well inside the drain wait; the groups need 5 s
        assert rollouter.stats().budget == 0

        # The weights reach the engine another way; then the rollouter is told.
        await engine.pause("keep")
        await engine.load_weights({}, 1)
        await engine.resume()
        pushed_at = time.monotonic()
        rollouter.on_weights(1)
        await wait_until(lambda: len(_new_group_calls(engine)) >= 3, within_s=5)

        latency_ms = (_new_group_calls(engine)[2] - pushed_at) * 1e3
        assert latency_ms < ACCEPTANCE_MS
        assert rollouter.metrics()["rollout/drain_interrupt_ms"] < ACCEPTANCE_MS
        # The slow groups were not waited for: both are still generating beside the two new
        # ones (the second new group's prompt comes from the prompt thread: wait for it).
        await wait_until(lambda: len(_new_group_calls(engine)) >= 4, within_s=2)
        assert rollouter.stats().delivered == 0
        assert len(engine.running_request_ids) == 4
        _assert_accounted(rollouter)
    finally:
        await rollouter.stop()
        await asyncio.wait_for(run, timeout=5)
    _assert_accounted(rollouter)


async def test_stats_answer_and_the_state_lock_is_free_during_the_drain_wait() -> None:
    engine, rollouter = _draining_rollouter()
    run = asyncio.create_task(rollouter.run())
    try:
        await _enter_drain_wait(engine, rollouter)
        for _ in range(5):
            await asyncio.sleep(0.02)
            assert rollouter.state == "draining"
            assert not rollouter._lock.locked()
            started = time.monotonic()
            stats = rollouter.stats()
            assert time.monotonic() - started < 0.05  # generous: it must not wait on anything
            assert (stats.in_flight, stats.admitted, stats.budget) == (2, 2, 0)
        # Another coroutine can take the state lock while the loop waits on the tasks.
        await asyncio.wait_for(rollouter._lock.acquire(), timeout=0.5)
        rollouter._lock.release()
    finally:
        await rollouter.stop()
        await asyncio.wait_for(run, timeout=5)


@pytest.mark.parametrize("pause_mode", ["keep", "abort"])
async def test_update_weights_interrupts_the_drain(pause_mode: str) -> None:
    engine, rollouter = _draining_rollouter(pause_mode)
    run = asyncio.create_task(rollouter.run())
    try:
        await _enter_drain_wait(engine, rollouter)
        await rollouter.update_weights({"w": 1}, 1)
        resumed_at = time.monotonic()
        await wait_until(lambda: len(_new_group_calls(engine)) >= 3, within_s=5)
        assert (_new_group_calls(engine)[2] - resumed_at) * 1e3 < ACCEPTANCE_MS
        assert engine.pause_modes == [pause_mode]
        assert engine.loaded_versions == [1]
        assert rollouter.version == 1
        if pause_mode == "abort":  # the aborted groups continue right away
            await wait_until(lambda: rollouter.stats().resumed == 4, within_s=5)
    finally:
        await rollouter.stop()
        await asyncio.wait_for(run, timeout=5)
    _assert_accounted(rollouter)
