"""EventLoopLagMonitor: sees a blocked loop, reports the design's metric names, resets, stops."""

from __future__ import annotations

import asyncio
import time

import pytest
from mm_preprocess import EventLoopLagMonitor, LagSnapshot
from mm_preprocess.lag_monitor import _percentile


def _block_loop_for(seconds: float) -> None:
    """Busy-wait in the calling thread: stands in for CPU work done on the loop."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def test_blocked_loop_shows_as_lag() -> None:
    async with EventLoopLagMonitor(interval_s=0.01) as monitor:
        await asyncio.sleep(0.05)
        _block_loop_for(0.2)
        await asyncio.sleep(0.05)
    snap = monitor.snapshot()
    assert isinstance(snap, LagSnapshot)
    assert snap.max_ms >= 150  # the tick due during the block fired at least ~200 ms late
    assert snap.samples >= 3
    assert snap.p50_ms <= snap.p99_ms <= snap.max_ms
    assert snap.as_dict()["samples"] == snap.samples


async def test_metrics_names_reset_and_stop() -> None:
    monitor = EventLoopLagMonitor(interval_s=0.005)
    assert monitor.metrics() == {
        "event_loop/lag_ms_p50": 0.0,
        "event_loop/lag_ms_p99": 0.0,
        "event_loop/lag_ms_max": 0.0,
    }
    await monitor.start()
    await monitor.start()  # idempotent
    assert monitor.running
    await asyncio.sleep(0.05)
    _block_loop_for(0.03)
    await asyncio.sleep(0.02)
    assert set(monitor.metrics(prefix="rollout_loop")) == {
        "rollout_loop/lag_ms_p50",
        "rollout_loop/lag_ms_p99",
        "rollout_loop/lag_ms_max",
    }
    assert monitor.snapshot().max_ms >= 20

    monitor.reset()
    assert monitor.snapshot().samples == 0
    assert monitor.snapshot().max_ms == 0.0

    await asyncio.sleep(0.03)
    await monitor.stop()
    assert not monitor.running
    samples = monitor.snapshot().samples
    assert samples >= 1
    await asyncio.sleep(0.03)
    assert monitor.snapshot().samples == samples  # stopped: no more ticks


async def test_is_cheap_no_task_and_bounded_memory() -> None:
    tasks_before = len(asyncio.all_tasks())
    async with EventLoopLagMonitor(interval_s=0.001, window=16) as monitor:
        assert len(asyncio.all_tasks()) == tasks_before  # a timer callback, not a task
        await asyncio.sleep(0.1)
    assert monitor.snapshot().samples > 16
    assert len(monitor._lags_s) == 16


def test_percentile_interpolates() -> None:
    values = [float(v) for v in range(101)]  # 0..100
    assert _percentile(values, 50) == 50.0
    assert _percentile(values, 99) == 99.0
    assert _percentile([1.0, 3.0], 50) == 2.0
    assert _percentile([], 99) == 0.0


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        EventLoopLagMonitor(interval_s=0)
    with pytest.raises(ValueError, match="window"):
        EventLoopLagMonitor(window=0)
