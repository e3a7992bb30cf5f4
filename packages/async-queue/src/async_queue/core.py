"""`MessageQueue`: the bounded asyncio queue that the Ray actor wraps. It imports no Ray.

All methods run on one event loop (the actor's). One `asyncio.Lock` guards the state and two
conditions share it: producers wait on `_room`, consumers on `_items_ready`. Every wait
re-checks its predicate under the lock, so a `close()` wakes everybody and nobody hangs.

Accounting invariant (checked by the tests): `produced == consumed + dropped_total + size`.
`requeue` (items a cancelled get had taken, handed back) undoes a consume, so it holds too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from async_queue.errors import (
    ProducerFailed,
    QueueClosed,
    QueueError,
    QueueFull,
    QueueTimeout,
)
from async_queue.types import (
    DROP_REASON_OVERFLOW,
    DROP_REASON_PRODUCER_FAILED,
    DROP_REASON_STALE,
    FullPolicy,
    QueueStats,
)

__all__ = ["MessageQueue", "Versioned", "stale_threshold"]

logger = logging.getLogger(__name__)


class Versioned(Protocol):
    """What the core needs of an item: the policy version that produced it."""

    @property
    def version(self) -> int: ...


ItemT = TypeVar("ItemT", bound=Versioned)


def stale_threshold(current_version: int | None, max_staleness: int | None) -> int | None:
    """The lowest version still fresh: items with `version < current_version - max_staleness`
    (staleness `current_version - version > max_staleness`) are dropped. None: no check."""
    if current_version is None and max_staleness is None:
        return None
    if current_version is None or max_staleness is None:
        raise ValueError("give both current_version and max_staleness, or neither")
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    return current_version - max_staleness


class MessageQueue(Generic[ItemT]):
    """Bounded FIFO of items (`QueueItem`s, or anything with a `version`) with a full-queue
    policy, close and failure signals. The actor stores undecoded items this way.

    - `put`/`put_many` on a full queue: policy `block` waits for room (a batch larger than
      the free room is enqueued in pieces, in order, as room appears); `drop_oldest` evicts
      the oldest items (dropped reason "overflow"); `reject` raises `QueueFull` and enqueues
      nothing of that call (counted in `rejected`).
    - `close()`: no more puts (`QueueClosed`); consumers drain what is queued, then get
      `QueueClosed`. Idempotent.
    - `close(error)`: the producer failed. Queued items are NOT delivered: they are counted
      as dropped reason "producer_failed", and every waiting or later consumer raises
      `ProducerFailed` at once. A failure may follow a normal close (it wins); a later close
      does not undo it. Puts raise `QueueClosed`.
    - Nothing returns None: a get returns an item/non-empty list or raises.
    """

    def __init__(
        self,
        maxsize: int = 1024,
        policy: FullPolicy | str = FullPolicy.BLOCK,
        on_stale: Callable[[list[ItemT]], None] | None = None,
    ) -> None:
        """`on_stale(items)` (optional) sees the items each read drops as too stale, so a
        producer can generate them again; it must not block."""
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self._maxsize = maxsize
        self._policy = FullPolicy(policy)
        self._on_stale = on_stale
        self._items: deque[ItemT] = deque()
        # Queued items per version: gives oldest/newest version and a cheap "anything stale?".
        self._version_counts: Counter[int] = Counter()
        self._lock = asyncio.Lock()
        self._room = asyncio.Condition(self._lock)
        self._items_ready = asyncio.Condition(self._lock)
        self._closed = False
        self._failure: ProducerFailed | None = None
        self._produced = 0
        self._consumed = 0
        self._rejected = 0
        self._dropped: Counter[str] = Counter()
        self._put_wait_s = 0.0
        self._get_wait_s = 0.0
        self._requeued = 0
        self._waiting_consumers = 0
        self._waiting_producers = 0

    # ------------------------------------------------------------------ properties

    @property
    def maxsize(self) -> int:
        return self._maxsize

    @property
    def policy(self) -> FullPolicy:
        return self._policy

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def qsize(self) -> int:
        return len(self._items)

    # ------------------------------------------------------------------ producers

    async def put(self, item: ItemT) -> None:
        """Enqueue one item (see the class docstring for the full-queue policy)."""
        await self.put_many((item,))

    async def put_many(self, items: Iterable[ItemT]) -> None:
        """Enqueue items in order. Raises `QueueClosed` on a closed queue, `QueueFull` under
        policy `reject` when they do not all fit. Under `block`, a close that arrives while
        waiting raises `QueueClosed` whose `enqueued` counts the leading items already
        enqueued (they stay queued)."""
        batch = list(items)
        async with self._lock:
            self._check_open_for_put()
            if not batch:
                return
            if self._policy is FullPolicy.REJECT:
                free = self._maxsize - len(self._items)
                if len(batch) > free:
                    self._rejected += len(batch)
                    raise QueueFull(
                        f"queue full: {len(batch)} item(s) offered, room for {free} "
                        f"(maxsize {self._maxsize}, policy reject)"
                    )
                self._append(batch)
            elif self._policy is FullPolicy.DROP_OLDEST:
                overflow = len(self._items) + len(batch) - self._maxsize
                if overflow > 0:
                    # Evict the oldest: queued items first, then the head of this batch
                    # (those count as produced, then dropped, like any evicted item).
                    from_queue = min(overflow, len(self._items))
                    from_batch = overflow - from_queue
                    self._pop_front(from_queue)
                    batch = batch[from_batch:]
                    self._produced += from_batch
                    self._dropped[DROP_REASON_OVERFLOW] += overflow
                self._append(batch)
            else:
                await self._put_blocking(batch)
            self._items_ready.notify_all()

    async def put_each(self, items: Iterable[ItemT]) -> list[QueueError | None]:
        """Enqueue items one by one, each exactly as its own `put` would be, in order; return
        each one's outcome (None: enqueued; else the `QueueFull` / `QueueClosed` that its
        `put` would have raised).

        This is how a client delivers single puts of several callers coalesced into one
        call: unlike `put_many`, policy reject refuses only the items that do not fit, and a
        close while blocked fails only the items not yet enqueued."""
        outcomes: list[QueueError | None] = []
        for item in items:
            try:
                await self.put_many((item,))
            except (QueueFull, QueueClosed) as exc:
                outcomes.append(exc)
            else:
                outcomes.append(None)
        return outcomes

    async def _put_blocking(self, batch: list[ItemT]) -> None:
        start = 0
        while start < len(batch):
            await self._wait(
                self._room,
                lambda: self._closed or len(self._items) < self._maxsize,
                limit_s=None,
                waited="put",
            )
            self._check_open_for_put(enqueued=start)
            piece = batch[start : start + self._maxsize - len(self._items)]
            self._append(piece)
            start += len(piece)
            # Wake consumers now: a batch larger than the room only fits piece by piece.
            self._items_ready.notify_all()

    def _check_open_for_put(self, enqueued: int = 0) -> None:
        if self._closed:
            state = "failed" if self._failure is not None else "closed"
            raise QueueClosed(f"queue is {state}; put refused", enqueued=enqueued)

    # ------------------------------------------------------------------ consumers

    async def get(self, timeout: float | None = None) -> ItemT:  # noqa: ASYNC109
        """Next item. Waits up to `timeout` seconds (None: forever) for one.

        Raises `QueueTimeout` (a `TimeoutError`) on timeout, `QueueClosed` once closed and
        drained, `ProducerFailed` after `close(error)`."""
        return (await self.get_batch(1, timeout))[0]

    async def get_batch(
        self,
        n: int,
        timeout: float | None = None,  # noqa: ASYNC109 (see MessageQueue.get_batch)
        *,
        min_items: int = 1,
        current_version: int | None = None,
        max_staleness: int | None = None,
    ) -> list[ItemT]:
        """Wait until `min_items` items are queued, then take up to `n` (FIFO).

        - `min_items=n` waits for a full batch (what a trainer wants).
        - Staleness: with `current_version` and `max_staleness`, queued items with
          `version < current_version - max_staleness` are dropped (reason "stale") before
          counting; the check is repeated whenever the call wakes up.
        - Timeout: raises `QueueTimeout` (a `TimeoutError`); nothing is taken. Never returns
          an empty list. (The timeout is a parameter, not an `asyncio.timeout` around the
          call, because over Ray it must apply inside the actor, where the items are.)
        - Closed: returns what is left (a partial final batch, possibly smaller than
          `min_items`), then raises `QueueClosed` when nothing is left.
        - Failed: raises `ProducerFailed` at once (queued items were dropped by the close).
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if not 1 <= min_items <= n:
            raise ValueError(f"min_items must be in [1, n={n}], got {min_items}")
        if min_items > self._maxsize:
            raise ValueError(f"min_items={min_items} can never be met with maxsize={self._maxsize}")
        threshold = stale_threshold(current_version, max_staleness)

        def ready() -> bool:
            self._raise_if_failed()
            if threshold is not None:
                self._drop_stale(threshold)
            return self._closed or len(self._items) >= min_items

        async with self._lock:
            await self._wait(self._items_ready, ready, limit_s=timeout, waited="get")
            if not self._items:
                raise QueueClosed("queue is closed and drained")
            batch = self._pop_front(min(n, len(self._items)))
            self._consumed += len(batch)
            self._room.notify_all()
            return batch

    async def requeue(self, items: Iterable[ItemT]) -> None:
        """Give back items that a get took but could not deliver (its caller was cancelled).

        They go back to the head of the queue, in their order, ahead of everything queued, as
        if never taken: `consumed` goes down by their number (`requeued` counts them). This is
        not a put: it ignores `maxsize` (they were in the queue a moment ago) and works after
        `close()` (consumers still drain them). After a producer failure they are counted as
        dropped "producer_failed", like the items queued when it came."""
        batch = list(items)
        if not batch:
            return
        async with self._lock:
            self._consumed -= len(batch)
            self._requeued += len(batch)
            if self._failure is not None:
                self._dropped[DROP_REASON_PRODUCER_FAILED] += len(batch)
                return
            self._items.extendleft(reversed(batch))
            for item in batch:
                self._version_counts[item.version] += 1
            self._items_ready.notify_all()

    # ------------------------------------------------------------------ close / stats

    async def close(self, error: BaseException | str | None = None) -> None:
        """End the stream (`error=None`) or report a producer failure (see class docstring)."""
        async with self._lock:
            if error is None:
                if not self._closed:
                    logger.debug("queue closed; %d item(s) left to drain", len(self._items))
                self._closed = True
            elif self._failure is None:
                self._failure = ProducerFailed.from_error(error)
                self._closed = True
                dropped = len(self._items)
                self._dropped[DROP_REASON_PRODUCER_FAILED] += dropped
                self._pop_front(dropped)
                logger.warning(
                    "queue failed (%s); dropped %d queued item(s)", self._failure, dropped
                )
            self._items_ready.notify_all()
            self._room.notify_all()

    def items(self) -> list[ItemT]:
        """The queued items, oldest first (a copy; they stay queued)."""
        return list(self._items)

    def stats(self) -> QueueStats:
        """A consistent snapshot (the loop runs one method at a time between awaits)."""
        versions = self._version_counts
        return QueueStats(
            size=len(self._items),
            maxsize=self._maxsize,
            policy=self._policy.value,
            produced=self._produced,
            consumed=self._consumed,
            dropped=dict(self._dropped),
            dropped_total=sum(self._dropped.values()),
            rejected=self._rejected,
            put_wait_s=self._put_wait_s,
            get_wait_s=self._get_wait_s,
            waiting_consumers=self._waiting_consumers,
            waiting_producers=self._waiting_producers,
            requeued=self._requeued,
            oldest_version=min(versions) if versions else None,
            newest_version=max(versions) if versions else None,
            closed=self._closed,
            failed=self._failure is not None,
            failure=str(self._failure) if self._failure is not None else None,
        )

    # ------------------------------------------------------------------ internals

    async def _wait(
        self,
        condition: asyncio.Condition,
        predicate: Callable[[], bool],
        *,
        limit_s: float | None,
        waited: str,
    ) -> None:
        """Wait (lock held) until `predicate()`; add the time waited to the put/get total and
        count the caller as a waiting producer/consumer meanwhile."""
        if predicate():
            return
        started = time.perf_counter()
        producer = waited == "put"
        if producer:
            self._waiting_producers += 1
        else:
            self._waiting_consumers += 1
        try:
            async with asyncio.timeout(limit_s):
                await condition.wait_for(predicate)
        except TimeoutError:
            raise QueueTimeout(f"not enough items within {limit_s} s") from None
        finally:
            elapsed = time.perf_counter() - started
            if producer:
                self._waiting_producers -= 1
                self._put_wait_s += elapsed
            else:
                self._waiting_consumers -= 1
                self._get_wait_s += elapsed

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            # A fresh instance per raise: one shared instance would pile up tracebacks.
            raise ProducerFailed(self._failure.cause_type, self._failure.cause_message)

    def _append(self, batch: list[ItemT]) -> None:
        self._items.extend(batch)
        for item in batch:
            self._version_counts[item.version] += 1
        self._produced += len(batch)

    def _pop_front(self, count: int) -> list[ItemT]:
        popleft = self._items.popleft
        batch = [popleft() for _ in range(count)]
        counts = self._version_counts
        for item in batch:
            counts[item.version] -= 1
            if not counts[item.version]:
                del counts[item.version]
        return batch

    def _drop_stale(self, threshold: int) -> None:
        if not self._version_counts or min(self._version_counts) >= threshold:
            return  # the common case costs O(distinct versions), not O(size)
        kept = [item for item in self._items if item.version >= threshold]
        stale = len(self._items) - len(kept)
        if self._on_stale is not None:
            self._on_stale([item for item in self._items if item.version < threshold])
        self._items = deque(kept)
        for version in [v for v in self._version_counts if v < threshold]:
            del self._version_counts[version]
        self._dropped[DROP_REASON_STALE] += stale
        self._room.notify_all()
