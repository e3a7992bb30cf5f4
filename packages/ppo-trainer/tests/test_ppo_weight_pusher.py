"""`WeightPusher` on its own: order, background overlap and errors. Scheduling logic, so the
sink is an in-memory stand-in with controllable timing (no model, no torch work)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from ppo_trainer import WeightPusher


class SlowSink:
    def __init__(self, fail_version: int | None = None) -> None:
        self.started: list[int] = []
        self.finished: list[int] = []
        self.release = asyncio.Event()
        self.fail_version = fail_version

    async def push_weights(self, weights: dict, version: int) -> None:
        self.started.append(version)
        await self.release.wait()
        if version == self.fail_version:
            raise RuntimeError(f"load {version} failed")
        self.finished.append(version)


async def test_background_pushes_overlap_the_caller_but_not_each_other() -> None:
    sink = SlowSink()
    pusher = WeightPusher(sink, background=True)
    await pusher.push({"w": 1}, 1)  # returns at once: the push runs in the background
    await asyncio.sleep(0.01)
    assert sink.started == [1] and sink.finished == []
    second = asyncio.ensure_future(pusher.push({"w": 2}, 2))
    await asyncio.sleep(0.01)
    assert sink.started == [1]  # version 2 waits for version 1 to land
    sink.release.set()
    await second
    await pusher.finish()
    assert sink.finished == [1, 2]
    assert pusher.last_push_s is not None


async def test_a_foreground_push_waits_and_nothing_is_pushed_without_weights_or_sink() -> None:
    sink = SlowSink()
    sink.release.set()
    pusher = WeightPusher(sink, background=False)
    await pusher.push({"w": 1}, 1)
    assert sink.finished == [1]
    await pusher.push(None, 2)  # a rank without the gathered weights
    await WeightPusher(None, background=True).push({"w": 3}, 3)
    assert sink.started == [1]


async def test_errors_surface_at_finish_and_are_logged_on_abandon(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = SlowSink(fail_version=1)
    sink.release.set()
    pusher = WeightPusher(sink, background=True)
    await pusher.push({"w": 1}, 1)
    with pytest.raises(RuntimeError, match="load 1 failed"):
        await pusher.finish()
    await pusher.push({"w": 1}, 1)
    with caplog.at_level(logging.ERROR):
        await pusher.abandon(1)
    assert "weight push 1 failed" in caplog.text
