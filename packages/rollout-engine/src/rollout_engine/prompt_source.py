"""Reads the rollouter's prompts one at a time, without blocking the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Callable, Iterable
from concurrent.futures import Executor

from rollout_engine.types import PromptSample

__all__ = ["PromptSource"]


class PromptSource:
    """Reads an iterable or async iterable of prompts one at a time.

    A list or tuple is read on the loop (indexing costs nothing). Any other sync iterable
    (a generator that tokenizes, a dataset) is advanced with `next()` in `executor` (one
    thread: iterators are not thread-safe, and one fetch runs at a time), so tokenizing
    prompts never blocks the loop. An async iterable is awaited.
    """

    def __init__(
        self,
        prompts: Iterable[PromptSample] | AsyncIterable[PromptSample],
        executor: Callable[[], Executor],
    ) -> None:
        self._async = aiter(prompts) if isinstance(prompts, AsyncIterable) else None
        self._sync = iter(prompts) if not isinstance(prompts, AsyncIterable) else None
        self._in_memory = isinstance(prompts, list | tuple)
        self._executor = executor

    async def next(self) -> PromptSample | None:
        """The next prompt, or None once the prompts are exhausted."""
        if self._sync is not None:
            if self._in_memory:
                return next(self._sync, None)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor(), next, self._sync, None)
        assert self._async is not None
        try:
            return await anext(self._async)
        except StopAsyncIteration:
            return None
