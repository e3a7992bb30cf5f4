"""Event-loop lag: how late a periodic timer fires on a loop. A blocked loop shows up at once.

A timer is scheduled every `interval_s` with `loop.call_at`; when it runs,

    lag = max(0, loop.time() - due_time)

is recorded and the next timer is due `interval_s` later. A loop that is blocked for B seconds
makes one tick about B late, so max lag >= B. The cost is one timer callback per interval and
an append to a bounded deque (no task, no coroutine).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import asdict, dataclass
from types import TracebackType

__all__ = ["EventLoopLagMonitor", "LagSnapshot"]


@dataclass(frozen=True)
class LagSnapshot:
    """Lag statistics in milliseconds.

    p50 and p99 are over the most recent `window` ticks (linear interpolation between order
    statistics); max and mean are over every tick since start or the last reset.
    """

    p50_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float
    samples: int
    interval_ms: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


class EventLoopLagMonitor:
    """Measures lag on the running event loop; usable as `async with EventLoopLagMonitor():`.

    Args:
        interval_s: tick period. 10 ms resolves lags that matter for an agent loop at a cost
            of 100 tiny callbacks per second.
        window: number of most recent ticks kept for the percentiles.
    """

    def __init__(self, interval_s: float = 0.01, window: int = 4096) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        self.interval_s = interval_s
        self._lags_s: deque[float] = deque(maxlen=window)
        self._count = 0
        self._sum_s = 0.0
        self._max_s = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    @property
    def running(self) -> bool:
        return self._handle is not None

    async def start(self) -> None:
        """Start ticking on the running loop (no-op if already running)."""
        if self._handle is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._due = self._loop.time() + self.interval_s
        self._handle = self._loop.call_at(self._due, self._tick)

    async def stop(self) -> None:
        """Stop ticking; the statistics are kept until `reset()`."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    async def __aenter__(self) -> EventLoopLagMonitor:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def reset(self) -> None:
        """Forget all ticks so far (e.g. between benchmark phases or metric intervals)."""
        self._lags_s.clear()
        self._count = 0
        self._sum_s = 0.0
        self._max_s = 0.0

    def snapshot(self) -> LagSnapshot:
        ordered = sorted(self._lags_s)
        return LagSnapshot(
            p50_ms=_percentile(ordered, 50.0) * 1e3,
            p99_ms=_percentile(ordered, 99.0) * 1e3,
            max_ms=self._max_s * 1e3,
            mean_ms=(self._sum_s / self._count) * 1e3 if self._count else 0.0,
            samples=self._count,
            interval_ms=self.interval_s * 1e3,
        )

    def metrics(self, prefix: str = "event_loop") -> dict[str, float]:
        """`{prefix}/lag_ms_p50`, `{prefix}/lag_ms_p99`, `{prefix}/lag_ms_max`."""
        snap = self.snapshot()
        return {
            f"{prefix}/lag_ms_p50": snap.p50_ms,
            f"{prefix}/lag_ms_p99": snap.p99_ms,
            f"{prefix}/lag_ms_max": snap.max_ms,
        }

    def _tick(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        lag = max(0.0, now - self._due)
        self._lags_s.append(lag)
        self._count += 1
        self._sum_s += lag
        if lag > self._max_s:
            self._max_s = lag
        # Next tick one interval after *now*: a long stall counts once, not as a burst of
        # catch-up ticks that would drag the percentiles down.
        self._due = now + self.interval_s
        self._handle = self._loop.call_at(self._due, self._tick)


def _percentile(ordered: list[float], q: float) -> float:
    """Linear-interpolated percentile of sorted values: x[r] with r = q/100 * (n - 1)."""
    if not ordered:
        return 0.0
    rank = q / 100.0 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
