"""The weight gate: pause, load, resume, and the version the rollouter serves.

`WeightGate` owns the rollouter's view of the engine's weights:

- `version`: the weight version it last heard of (`open`);
- `paused`: a weight push (or a snapshot) is in progress; the dispatch loop admits nothing;
- `admitting`: an `asyncio.Event` the dispatch loop's drain wait ends on (set by `open`, by
  a dispatch, or whenever the budget may have reopened);
- `live`: clear while the engine's weights are changing; aborted requests wait on it
  before they continue (`wait_live`).

Weight pushes and snapshots are serialized by one lock that the dispatch loop never takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from rollout_engine.types import GenerationEngine, PauseMode

__all__ = ["EnginePause", "WeightGate"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EnginePause:
    """What one `WeightGate.paused_engine()` block resumes with: the version the engine
    serves afterwards (set it once new weights are loaded)."""

    version: int


class WeightGate:
    """Pause, load, resume and versions; see the module docstring.

    `on_open(version)` runs whenever the gate reopens after a push or a snapshot (the
    rollouter's `on_weights`, which also tells pacing and the stall watch).
    """

    def __init__(self, engine: GenerationEngine, version: int) -> None:
        self._engine = engine
        self._version = version
        self._paused = False
        self.admitting = asyncio.Event()  # set: admitting; clear: paused (push or budget)
        self.admitting.set()
        self.live = asyncio.Event()  # clear while a weight push is in progress
        self.live.set()
        self._lock = asyncio.Lock()  # serializes pushes and snapshots

    @property
    def version(self) -> int:
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    async def wait_live(self) -> None:
        await self.live.wait()

    def pause(self) -> None:
        """Stop admitting and hold continuations until `open()`."""
        self._paused = True
        self.admitting.clear()
        self.live.clear()

    def open(self, version: int) -> bool:
        """The engine now serves `version`; wake everything. True when the version advanced."""
        if version < self._version:
            logger.warning("weight version went backwards: %d -> %d", self._version, version)
        advanced = version > self._version
        self._version = version
        self._paused = False
        self.live.set()
        self.admitting.set()
        return advanced

    @contextlib.asynccontextmanager
    async def paused_engine(
        self,
        mode: PauseMode,
        clear_cache: bool,
        on_open: Callable[[int], None],
        on_pause: Callable[[], None] = lambda: None,
    ) -> AsyncIterator[EnginePause]:
        """Serialized with other pushes: pause admission (then `on_pause()`) and the engine
        (`mode`), run the block, then resume the engine and `on_open(version)` whatever
        happened, so the rollouter never stays paused. The version is the block's
        `EnginePause.version` (unchanged unless the block set it)."""
        async with self._lock:
            self.pause()
            on_pause()
            resume = EnginePause(version=self._version)
            try:
                await self._engine.pause(mode=mode, clear_cache=clear_cache)
                yield resume
            finally:
                try:
                    await self._engine.resume()
                finally:
                    on_open(resume.version)
