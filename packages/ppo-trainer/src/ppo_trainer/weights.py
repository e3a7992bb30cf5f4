"""`WeightPusher`: hands each new policy version to the weight sink, one push at a time."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from ppo_trainer.protocols import WeightSink

if TYPE_CHECKING:
    import torch

__all__ = ["WeightPusher"]

logger = logging.getLogger(__name__)


class WeightPusher:
    """Pushes weights to a `WeightSink`, in version order, optionally in the background.

    A background push overlaps the next step; the next push (or `finish`) waits for it
    first, so the sink sees versions in order and never two loads at once.
    """

    def __init__(self, sink: WeightSink | None, *, background: bool) -> None:
        self.sink = sink
        self.background = background
        self._task: asyncio.Task[None] | None = None
        self.last_push_s: float | None = None
        """Seconds the latest finished push took (None before the first)."""

    async def push(self, weights: dict[str, torch.Tensor] | None, version: int) -> None:
        """Wait for the push in flight, then push `weights` as `version` (nothing without a
        sink or weights); in the background if so configured."""
        await self.finish()
        if self.sink is None or weights is None:
            return
        push = self._push(self.sink, weights, version)
        if self.background:
            self._task = asyncio.ensure_future(push)
        else:
            await push

    async def finish(self) -> None:
        """Wait for the background push in flight, if any; its error is raised here."""
        task, self._task = self._task, None
        if task is not None:
            await task

    async def abandon(self, version: int) -> None:
        """On the way out after an error or cancel: let the push in flight end (it is not
        cancelled halfway through a load) and log, not raise, its error."""
        task, self._task = self._task, None
        if task is None:
            return
        await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:
            logger.error("weight push %d failed: %r", version, task.exception())

    async def _push(self, sink: WeightSink, weights: dict[str, torch.Tensor], version: int) -> None:
        started = time.perf_counter()
        await sink.push_weights(weights, version)
        self.last_push_s = time.perf_counter() - started
