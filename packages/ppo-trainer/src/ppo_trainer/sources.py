"""Adapting the sources the trainer accepts to one async iterator of groups."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from ppo_trainer.protocols import BatchSource, GroupSource
from ppo_trainer.types import Trajectory

__all__ = ["iterate_batch_source", "iterate_groups"]


async def iterate_batch_source(
    source: BatchSource,
    n: int,
    current_version: Callable[[], int],
    end_of_stream: tuple[type[BaseException], ...] = (),
) -> AsyncIterator[list[Trajectory]]:
    """Yield the groups of `source.next_batch(n, current_version())` one by one.

    The stream ends when `next_batch` raises one of `end_of_stream` (e.g. the queue's
    `QueueClosed`); any other exception (e.g. `ProducerFailed`) propagates to the consumer.
    """
    while True:
        try:
            batch = await source.next_batch(n, current_version())
        except end_of_stream:
            return
        if not batch:
            await asyncio.sleep(0)  # an empty answer must not turn this into a busy loop
        for group in batch:
            yield group


def iterate_groups(
    source: GroupSource,
    n: int,
    current_version: Callable[[], int],
    end_of_stream: tuple[type[BaseException], ...] = (),
) -> AsyncIterator[list[Trajectory]]:
    """An async iterator over `source`: itself if it is async-iterable, else an adapter."""
    if hasattr(source, "__aiter__"):
        return aiter(source)  # type: ignore[arg-type]
    if isinstance(source, BatchSource):
        return iterate_batch_source(source, n, current_version, end_of_stream)
    raise TypeError(
        f"{type(source).__name__} is neither an async iterable of groups nor has next_batch()"
    )
