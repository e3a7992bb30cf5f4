"""Small asyncio helpers the driver's modules share."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

__all__ = ["await_ref", "failure", "finish_despite_cancel", "quietly", "uncancel"]

T = TypeVar("T")


async def await_ref(ref: Any) -> Any:
    """A Ray object ref as a coroutine (for `asyncio.gather`, `wait_for`, `ensure_future`)."""
    return await ref


def failure(future: asyncio.Future) -> BaseException | None:
    """The error a finished future holds (a cancelled one counts as none)."""
    return None if future.cancelled() else future.exception()


async def quietly(awaitable: Any) -> None:
    """Await, logging (not raising) an error: for shutdown steps that may meet dead actors."""
    try:
        await awaitable
    except Exception as exc:
        logger.debug("ignored during shutdown: %r", exc)


def uncancel() -> None:
    """Clear the current task's pending cancellation (a signal's stop has been handled)."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


async def finish_despite_cancel(work: Awaitable[T]) -> T:
    """Await `work` to its end even if this task is cancelled meanwhile (a second signal
    while the cluster's processes are reaped): what it cleans up must not be left behind.
    Each cancellation that arrives here is cleared; the caller's own outcome stands."""
    future = asyncio.ensure_future(work)
    while True:
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.cancelled():
                raise
            uncancel()
