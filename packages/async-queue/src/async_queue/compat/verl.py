"""verl's fully-async `MessageQueue` and `MessageQueueClient`, on this package's queue.

In a verl (0.9.x) fully-async run, change one import (in `fully_async_main.py`, and where
the rollouter and trainer import the client)::

    # was: from verl.experimental.fully_async_policy.message_queue import (
    #          MessageQueue, MessageQueueClient)
    from async_queue.compat.verl import MessageQueue, MessageQueueClient

`MessageQueue` is a Ray actor class with verl's constructor `(config, max_queue_size)` and
methods (`put_sample`, `get_sample`, `get_queue_size`, `get_statistics`, `clear_queue`,
`shutdown`, `get_memory_usage`, `put_validate`, `get_validate`); `MessageQueueClient(actor)`
has the client's method names, arguments and return shapes, including the `*_sync` helpers.
Kept as verl's callers rely on it:

- `put_sample(None)` is the end-of-stream sentinel; a consumer receives it as `(None, n)`;
- `get_sample()` returns `(sample, remaining)`; `put_sample` returns a bool (False: a sample
  was dropped to make room, under `on_full="drop_oldest"`);
- the optional `param_version` of verl's earlier `put_sample(sample, param_version)`.

Changed, because each is a defect there:

- after `shutdown()`, a waiting or later `get_sample` raises `QueueClosed` once the queue is
  drained, instead of returning a bare `None` that callers unpack into a `TypeError`
  (`legacy_none=True`: it returns the sentinel tuple `(None, 0)` instead);
- a full queue blocks the producer by default instead of silently dropping the oldest
  sample; `on_full="drop_oldest"` keeps verl's behaviour, and every drop is logged and
  counted (`dropped_samples` in `get_statistics()`);
- the `*_sync` helpers raise `SyncClientInEventLoopError` when called on a thread whose event
  loop is running, instead of blocking that loop with `ray.get`;
- nothing is printed: statistics go to `logging` and `get_statistics()`.

Also different, and harmless to verl's callers: a put after `shutdown()` raises
`QueueClosed` (verl queues it behind the end); `get_statistics()` has extra keys
(`cleared_samples`, `on_full`, `closed`); `get_memory_usage()` counts the payload bytes this
actor really holds, plus `actor_rss_bytes`, instead of a per-sample guess. The actor reserves
no CPU (it waits on I/O; verl's asks for 2) and serves up to 1000 concurrent calls (verl's 20).
Samples of `by_ref_bytes` or more (bytes, as verl's rollouter sends: `cloudpickle.dumps` of a
`RolloutSample`) travel through Ray's object store by reference: the actor holds only a ref,
so its memory does not grow with the payloads.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

import ray
from ray import cloudpickle
from ray.actor import ActorHandle
from ray.exceptions import RayError, RayTaskError

from async_queue import _wire
from async_queue.actor import QueueActor, _process_memory
from async_queue.client import (
    _fetch,
    _from_queue_blocking,
    _in_background,
    _raise_own_error,
    _release_now,
    _requeue,
    _ticket,
)
from async_queue.errors import QueueClosed, SyncClientInEventLoopError
from async_queue.types import DROP_REASON_OVERFLOW, FullPolicy, QueueItem

__all__ = [
    "DEFAULT_MAX_QUEUE_SIZE",
    "ON_FULL_CHOICES",
    "MessageQueue",
    "MessageQueueClient",
    "VerlMessageQueue",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE_SIZE = 1000  # verl's default
ON_FULL_CHOICES = ("block", "drop_oldest")
# How a sample was turned into queue bytes (QueueItem.metadata key and values).
_KIND = "verl_sample"
_NONE, _BYTES, _PICKLED = "none", "bytes", "pickled"
# The statistics are logged (debug) every this many puts, as verl prints them.
_LOG_EVERY_PUTS = 100


def _to_item(sample: Any, param_version: int | None) -> QueueItem:
    """A verl sample as a queue item: bytes as they are, None as the sentinel, anything else
    pickled (verl's rollouter already sends `cloudpickle.dumps` bytes)."""
    if sample is None:
        payload, kind = b"", _NONE
    elif isinstance(sample, bytes | bytearray | memoryview):
        payload, kind = bytes(sample), _BYTES
    else:
        payload, kind = cloudpickle.dumps(sample), _PICKLED
    version = 0 if param_version is None else int(param_version)
    return QueueItem(payload=payload, version=version, item_id="", metadata={_KIND: kind})


def _from_item(item: QueueItem) -> Any:
    kind = item.metadata.get(_KIND, _BYTES)
    if kind == _NONE:
        return None
    if kind == _PICKLED:
        return cloudpickle.loads(item.payload)
    return item.payload


def _held_bytes(element: _wire.WireItem) -> int:
    """Payload bytes an element keeps in the actor's heap (by-ref ones keep none)."""
    if isinstance(element, bytes):
        return len(element)
    if isinstance(element, QueueItem):
        return len(element.payload)
    return 0


class VerlMessageQueue(QueueActor):
    """The actor behind `MessageQueue` (module doc). Extends `QueueActor`, so this package's
    own `MessageQueueClient(handle)` works on the same actor too."""

    def __init__(
        self,
        config: Any = None,
        max_queue_size: int | None = DEFAULT_MAX_QUEUE_SIZE,
        *,
        on_full: str = "block",
        legacy_none: bool = False,
    ) -> None:
        if max_queue_size is None:
            raise ValueError(f"max_queue_size cannot be None, got: {max_queue_size}")
        if on_full not in ON_FULL_CHOICES:
            raise ValueError(f"on_full must be one of {ON_FULL_CHOICES}, got {on_full!r}")
        policy = FullPolicy.BLOCK if on_full == "block" else FullPolicy.DROP_OLDEST
        super().__init__(int(max_queue_size), policy.value)
        self.config = config
        self.max_queue_size = int(max_queue_size)
        self._on_full = on_full
        self._legacy_none = legacy_none
        self._validation: deque[Any] = deque()
        self._cleared = 0
        logger.info(
            "verl-compatible MessageQueue: max_queue_size=%d on_full=%s",
            self.max_queue_size,
            on_full,
        )

    # ------------------------------------------------------------------ verl's methods

    async def put_sample(self, sample: Any, param_version: int | None = None) -> bool:
        """Queue one sample (None: the end-of-stream sentinel). False when the oldest sample
        was dropped to make room (`on_full="drop_oldest"`); blocks for room by default."""
        return await self.put_sample_wire(_wire.to_wire([_to_item(sample, param_version)], None))

    async def get_sample(self) -> tuple[Any, int] | None:
        """`(sample, remaining)`; waits for one. Drained after `shutdown()`: `QueueClosed`
        (`legacy_none`: `(None, 0)`)."""
        reply = await self.get_sample_wire()
        if reply is None:
            return None, 0
        elements, remaining = reply
        (item,) = await _wire.resolve(elements)
        return _from_item(item), remaining

    async def get_queue_size(self) -> int:
        return self._queue.qsize()

    async def get_statistics(self) -> dict[str, Any]:
        stats = self._queue.stats()
        return {
            "queue_size": stats.size,
            "total_produced": stats.produced,
            "total_consumed": stats.consumed - self._cleared,
            "dropped_samples": stats.dropped.get(DROP_REASON_OVERFLOW, 0),
            "max_queue_size": self.max_queue_size,
            "cleared_samples": self._cleared,
            "on_full": self._on_full,
            "closed": stats.closed,
        }

    async def clear_queue(self) -> None:
        """Drop every queued sample (counted in `cleared_samples`, not as consumed)."""
        cleared = self._queue.qsize()
        if cleared:
            cleared = len(await self._queue.get_batch(cleared, 0.0))
            self._cleared += cleared
        logger.info("cleared %d samples from the queue", cleared)

    async def shutdown(self) -> None:
        """End the stream: consumers drain what is queued, then get `QueueClosed`."""
        await self._queue.close()
        logger.info("MessageQueue shutdown")

    async def get_memory_usage(self) -> dict[str, Any]:
        held = sum(_held_bytes(raw.wire) for raw in self._queue.items())
        return {
            "queue_samples": self._queue.qsize(),
            "estimated_memory_bytes": held,
            "estimated_memory_mb": held / (1024 * 1024),
            "actor_rss_bytes": _process_memory()["rss_bytes"],
        }

    async def put_validate(self, data: Any) -> None:
        self._validation.append(data)

    async def get_validate(self) -> Any | None:
        """The next validation result, or None when there is none yet (verl's shape: a
        poll, not a stream)."""
        return self._validation.popleft() if self._validation else None

    # ------------------------------------------------------------------ the client's wire

    async def put_sample_wire(
        self, elements: list[_wire.WireItem], source: _wire.PullSource | None = None
    ) -> bool:
        """`put_sample` of one encoded sample (by reference when large); see `put_sample`."""
        dropped_before = self._queue.stats().dropped.get(DROP_REASON_OVERFLOW, 0)
        owned = await self._own(elements, source)
        await self._queue.put_many(_wire.to_raw_items(owned))
        stats = self._queue.stats()
        dropped = stats.dropped.get(DROP_REASON_OVERFLOW, 0) - dropped_before
        if dropped:
            logger.warning(
                "queue full: dropped the oldest sample (%d dropped in all)",
                stats.dropped.get(DROP_REASON_OVERFLOW, 0),
            )
        if stats.produced % _LOG_EVERY_PUTS == 0:
            logger.debug(
                "MessageQueue stats: produced=%d queue_size=%d", stats.produced, stats.size
            )
        return dropped == 0

    async def get_sample_wire(
        self, ticket: str | None = None
    ) -> tuple[list[_wire.WireItem], int] | None:
        """One sample in its wire form and the remaining count; None is the legacy end."""
        try:
            batch = await self._take(ticket, self._queue.get_batch(1, None))
        except QueueClosed:
            if self._legacy_none:
                return None
            raise
        # Held under the ticket until the client has fetched it (see `QueueActor.release`).
        return self._deliver(ticket, [batch[0].wire]), self._queue.qsize()


# verl's actor is `@ray.remote(num_cpus=2, max_concurrency=20)`; this one waits on I/O only.
MessageQueue = ray.remote(num_cpus=0, max_concurrency=1000)(VerlMessageQueue)


class MessageQueueClient:
    """verl's client, with the same methods (module doc). Picklable: pass it to the
    rollouter and trainer actors as verl does.

    `by_ref_bytes`: bytes samples at least this large go through Ray's object store by
    reference (None: never)."""

    def __init__(
        self, queue_actor: ActorHandle, by_ref_bytes: int | None = _wire.DEFAULT_BY_REF_BYTES
    ) -> None:
        self.queue_actor = queue_actor
        self.by_ref_bytes = _wire.check_by_ref_bytes(by_ref_bytes)

    async def put_sample(self, sample: Any, param_version: int | None = None) -> bool:
        if sample is None or isinstance(sample, bytes | bytearray | memoryview):
            item = _to_item(sample, param_version)
        else:  # pickling may be long: off the loop
            item = await asyncio.to_thread(_to_item, sample, param_version)
        if _wire.needs_object_store([item], self.by_ref_bytes):
            # ray.put copies the payload into the object store: not on this loop.
            elements = await asyncio.to_thread(_wire.to_wire, [item], self.by_ref_bytes)
        else:
            elements = _wire.to_wire([item], None)
        return await _call(self.queue_actor.put_sample_wire, elements)

    async def put_validate(self, data: Any) -> None:
        return await _call(self.queue_actor.put_validate, data)

    async def get_sample(self) -> tuple[Any, int]:
        """`(sample, remaining)`; `(None, n)` is the producer's end-of-stream sentinel.
        Raises `QueueClosed` after `shutdown()` once drained (see the module doc). A
        cancelled call loses no sample: it goes back to the head of the queue."""
        ticket = _ticket()
        ref = self.queue_actor.get_sample_wire.remote(ticket)
        try:
            reply = await ref
        except RayTaskError as exc:
            _raise_own_error(exc)
        except asyncio.CancelledError:
            await _in_background(_hand_back(self.queue_actor, ref, ticket))
            raise
        if reply is None:
            return None, 0
        elements, remaining = reply
        (item,) = await _fetch(self.queue_actor, elements, ticket)
        if item.metadata.get(_KIND) == _PICKLED:
            return await asyncio.to_thread(_from_item, item), remaining
        return _from_item(item), remaining

    async def get_queue_size(self) -> int:
        return await _call(self.queue_actor.get_queue_size)

    async def get_statistics(self) -> dict[str, Any]:
        return await _call(self.queue_actor.get_statistics)

    async def clear_queue(self) -> None:
        await _call(self.queue_actor.clear_queue)

    async def shutdown(self) -> None:
        await _call(self.queue_actor.shutdown)

    async def get_memory_usage(self) -> dict[str, Any]:
        return await _call(self.queue_actor.get_memory_usage)

    # ------------------------------------------------------------------ blocking helpers

    def put_sample_sync(self, sample: Any, param_version: int | None = None) -> bool:
        """verl's earlier blocking put (for threads without a running loop)."""
        _forbid_running_loop("put_sample_sync", "put_sample")
        item = _to_item(sample, param_version)
        elements = _wire.to_wire([item], self.by_ref_bytes)
        return _call_sync(self.queue_actor.put_sample_wire, elements)

    def get_sample_sync(self) -> tuple[Any, int]:
        _forbid_running_loop("get_sample_sync", "get_sample")
        ticket = _ticket()
        reply = _call_sync(self.queue_actor.get_sample_wire, ticket)
        if reply is None:
            return None, 0
        elements, remaining = reply
        try:
            (item,) = _wire.from_wire_blocking(
                elements, _from_queue_blocking(self.queue_actor, ticket)
            )
        finally:
            _release_now(self.queue_actor, elements, ticket)
        return _from_item(item), remaining

    def get_statistics_sync(self) -> dict[str, Any]:
        _forbid_running_loop("get_statistics_sync", "get_statistics")
        return _call_sync(self.queue_actor.get_statistics)

    def get_queue_size_sync(self) -> int:
        _forbid_running_loop("get_queue_size_sync", "get_queue_size")
        return _call_sync(self.queue_actor.get_queue_size)

    def get_validate_sync(self) -> Any | None:
        _forbid_running_loop("get_validate_sync", "get_validate")
        return _call_sync(self.queue_actor.get_validate)


async def _call(method: Any, *args: Any) -> Any:
    try:
        return await method.remote(*args)
    except RayTaskError as exc:
        _raise_own_error(exc)


def _call_sync(method: Any, *args: Any) -> Any:
    try:
        return ray.get(method.remote(*args))
    except RayTaskError as exc:
        _raise_own_error(exc)


async def _hand_back(actor: ActorHandle, ref: ray.ObjectRef, ticket: str) -> None:
    """The caller of a get was cancelled: abandon it; put back a sample it already sent."""
    await actor.abandon.remote(ticket)
    try:
        reply = await ref
    except RayError:
        return  # abandoned (nothing taken), closed, or the actor is gone
    if reply is not None:
        await _requeue(actor, reply[0], ticket)


def _forbid_running_loop(method: str, async_method: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return  # no loop running on this thread: blocking is fine
    raise SyncClientInEventLoopError(
        f"MessageQueueClient.{method}() called while an asyncio event loop is running in "
        f"this thread; it would block the loop with ray.get. Use "
        f"`await client.{async_method}()` instead."
    )
