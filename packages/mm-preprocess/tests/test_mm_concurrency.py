"""The in-flight bound, event-loop responsiveness, cancellation and clean shutdown."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mm_preprocess import EventLoopLagMonitor, PreprocessorClosed, VisionPreprocessor
from mm_preprocess import preprocessor as preprocessor_module

pytestmark = pytest.mark.timeout(180)


class GatedPipeline:
    """Instrumentation around the real pipeline (scheduling checks only, not a fake decoder):
    counts how many jobs run in threads at once and can hold them at a gate."""

    def __init__(self, real: Callable[..., Any]) -> None:
        self._real = real
        self._lock = threading.Lock()
        self.running = 0
        self.max_running = 0
        self.started = 0
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, *args: Any) -> Any:
        with self._lock:
            self.running += 1
            self.started += 1
            self.max_running = max(self.max_running, self.running)
        try:
            if not self.gate.wait(timeout=60):
                raise TimeoutError("gate never opened")
            return self._real(*args)
        finally:
            with self._lock:
                self.running -= 1


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> Iterator[GatedPipeline]:
    pipeline = GatedPipeline(preprocessor_module.run_vision_info)
    monkeypatch.setattr(preprocessor_module, "run_vision_info", pipeline)
    yield pipeline
    pipeline.gate.set()


async def _wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def test_inflight_never_exceeds_bound(
    gated: GatedPipeline, image_factory: Callable[..., Path], image_message
) -> None:
    paths = [str(image_factory(384, 384, seed=s)) for s in range(4)]
    messages = [image_message(paths[i % 4], paths[(i + 1) % 4]) for i in range(24)]
    seen: list[int] = []
    done = asyncio.Event()

    async with VisionPreprocessor(max_workers=2, max_inflight=3) as pre:

        async def sample() -> None:
            while not done.is_set():
                seen.append(pre.stats().inflight)
                await asyncio.sleep(0.001)

        sampler = asyncio.create_task(sample())
        results = await asyncio.gather(*(pre.process_vision_info(m) for m in messages))
        done.set()
        await sampler
        stats = pre.stats()

    assert all(r.images is not None and len(r.images) == 2 for r in results)
    assert max(seen) <= 3
    assert stats.max_inflight_observed == 3  # the burst did fill the bound
    assert gated.max_running <= 2  # and threads never exceeded max_workers
    assert stats.completed == 24
    assert stats.failed == 0
    assert stats.inflight == 0
    assert stats.waiting == 0


def _process_inline(pre: VisionPreprocessor, batch: list) -> None:
    for messages in batch:
        pre.process_vision_info_sync(messages)


async def test_loop_stays_responsive_while_processing(
    image_factory: Callable[..., Path], image_message
) -> None:
    """A ticker coroutine keeps running during offloaded work; inline, it cannot run at all."""
    paths = [str(image_factory(768, 768, seed=s)) for s in range(2)]
    messages = [image_message(*paths) for _ in range(6)]

    async def count_ticks(stop: asyncio.Event, ticks: list[int]) -> None:
        while not stop.is_set():
            ticks[0] += 1
            await asyncio.sleep(0.002)

    async with VisionPreprocessor(max_workers=2) as pre:
        await pre.process_vision_info(messages[0])  # warm-up: imports happen here

        async def measure(work: Callable[[], Any]) -> tuple[int, float]:
            stop, ticks = asyncio.Event(), [0]
            async with EventLoopLagMonitor(interval_s=0.005) as monitor:
                ticker = asyncio.create_task(count_ticks(stop, ticks))
                await asyncio.sleep(0)  # let the ticker start
                ticks[0] = 0
                await work()
                stop.set()
                await ticker
            return ticks[0], monitor.snapshot().max_ms

        async def offloaded() -> None:
            await asyncio.gather(*(pre.process_vision_info(m) for m in messages))

        async def inline() -> None:
            _process_inline(pre, messages)  # blocks the loop: the old behaviour

        offloaded_ticks, offloaded_max_ms = await measure(offloaded)
        inline_ticks, inline_max_ms = await measure(inline)

    assert offloaded_ticks >= 10
    assert inline_ticks <= 1
    # Inline, the loop is blocked for the whole batch; offloaded, never for that long.
    assert offloaded_max_ms < inline_max_ms


async def test_cancelled_caller_keeps_slot_until_thread_finishes(
    gated: GatedPipeline, png_path: Path, image_message
) -> None:
    gated.gate.clear()
    async with VisionPreprocessor(max_workers=1, max_inflight=1) as pre:
        first = asyncio.create_task(pre.process_vision_info(image_message(str(png_path))))
        await _wait_until(lambda: gated.started == 1)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        # The thread still works on the cancelled job, so the slot is still taken.
        second = asyncio.create_task(pre.process_vision_info(image_message(str(png_path))))
        await _wait_until(lambda: pre.stats().waiting == 1)
        assert pre.stats().inflight == 1
        gated.gate.set()
        result = await asyncio.wait_for(second, timeout=60)
        assert result.images is not None
        stats = pre.stats()
    assert stats.cancelled == 1
    assert stats.completed == 1
    assert stats.inflight == 0


async def test_cancelled_waiter_does_not_leak_a_slot(
    gated: GatedPipeline, png_path: Path, image_message
) -> None:
    gated.gate.clear()
    messages = image_message(str(png_path))
    async with VisionPreprocessor(max_workers=1, max_inflight=1) as pre:
        running = asyncio.create_task(pre.process_vision_info(messages))
        waiter = asyncio.create_task(pre.process_vision_info(messages))
        await _wait_until(lambda: pre.stats().waiting == 1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        gated.gate.set()
        await running
        # Both slots' worth of work must still be possible afterwards.
        results = await asyncio.gather(*(pre.process_vision_info(messages) for _ in range(3)))
        assert len(results) == 3
        assert pre.stats().inflight == 0


async def test_close_while_jobs_queued(gated: GatedPipeline, png_path: Path, image_message) -> None:
    """One job running, three queued in the pool, two waiting for a slot; then close()."""
    gated.gate.clear()
    messages = image_message(str(png_path))
    pre = VisionPreprocessor(max_workers=1, max_inflight=4)
    tasks = [asyncio.create_task(pre.process_vision_info(messages)) for _ in range(6)]
    await _wait_until(lambda: gated.started == 1 and pre.stats().waiting == 2)

    pre.close()
    gated.gate.set()
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)

    assert outcomes[0].images is not None  # the running job finished normally
    assert all(isinstance(o, PreprocessorClosed) for o in outcomes[1:]), outcomes
    assert gated.started == 1  # queued jobs never started
    with pytest.raises(PreprocessorClosed, match="closed"):
        await pre.process_vision_info(messages)
    with pytest.raises(PreprocessorClosed):
        await pre.process_many([messages])  # a closed preprocessor refuses the whole batch
    await pre.aclose()  # idempotent
    stats = pre.stats()
    assert stats.closed
    assert stats.inflight == 0


async def test_close_with_real_burst_does_not_hang(
    image_factory: Callable[..., Path], image_message
) -> None:
    path = str(image_factory(512, 512, seed=9))
    pre = VisionPreprocessor(max_workers=2, max_inflight=4)
    tasks = [asyncio.create_task(pre.process_vision_info(image_message(path))) for _ in range(16)]
    await asyncio.sleep(0.05)
    await asyncio.wait_for(pre.aclose(), timeout=60)
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
    for outcome in outcomes:
        assert isinstance(outcome, PreprocessorClosed) or outcome.images is not None
    assert any(isinstance(o, PreprocessorClosed) for o in outcomes)


def test_sync_context_manager_outside_a_loop(png_path: Path, image_message) -> None:
    with VisionPreprocessor(max_workers=1) as pre:
        result = pre.process_vision_info_sync(image_message(str(png_path)))
    assert result.images is not None
    assert pre.closed


def test_invalid_bounds() -> None:
    with pytest.raises(ValueError, match="max_workers"):
        VisionPreprocessor(max_workers=0)
    with pytest.raises(ValueError, match="max_inflight"):
        VisionPreprocessor(max_workers=1, max_inflight=0)
