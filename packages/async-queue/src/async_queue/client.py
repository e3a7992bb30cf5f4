"""Clients of the queue actor: `MessageQueueClient` (async) and `SyncMessageQueueClient`.

Both are thin and picklable (they pickle as the actor handle and the by-reference threshold),
so they can be passed to other Ray actors and tasks. Each method is one Ray actor call; a batch
moves in one call as msgpack-encoded items. Exceptions the actor raises arrive wrapped in
`RayTaskError`; the clients re-raise the package's own `QueueClosed`, `ProducerFailed`,
`QueueFull`, `QueueTimeout`.

Payloads of `by_ref_bytes` (default 64 KiB) or more go by reference, those of one call as one
object owned by the queue actor (so they survive the producer); the actor queues only refs,
and the consuming client awaits each distinct ref once (see `_wire`), then tells the actor it
may let go of them (`release`, in the background). A producing client
inside a Ray actor that serves concurrent calls (an async actor, or `max_concurrency` > 1)
keeps the payloads until the queue actor pulls them (`_handover`: one write into the object
store) when a call slot stays free for that; any other client `ray.put`s them (in a worker
thread, off the loop) and the queue actor copies them into an object of its own. A pulled
put whose producer does not hand over in time (`HandOverTimeout`: its slots were busy)
enqueues nothing; the client then turns pulling off in its process and copies the put.

Concurrent single `put`s of one async client coalesce: while one call is in flight, the
items of further `put`s wait in the client and go together in the next call (`put_each`),
where each is enqueued as its own put would be. Each `put` still returns only once its item
is queued, and raises its own item's error (`QueueFull`, `QueueClosed`). A caller cancelled
before its item was sent takes it out (never enqueued); one cancelled while the call is in
flight leaves it to that call (it may or may not be enqueued, as with any cancelled put);
the other callers' items are unaffected. A call whose callers were all cancelled is
`ray.cancel`led.

Timeouts are enforced inside the actor, so a timed-out `get` takes nothing.

A cancelled get never loses items (exactly-once delivery). Cancelling the caller of `get` /
`get_batch` (a stopping trainer, `asyncio.wait_for`) must not leave items taken for nobody.
Ray's own `ray.cancel` cannot promise that: when the actor has already taken the items, the
owner may still turn the reply into `TaskCancelledError` and drop it. So gets are never
`ray.cancel`led. Each get carries a fresh `ticket`; when its caller is cancelled, the client
calls `abandon(ticket)` on the actor, which stops a get that is still waiting (it takes
nothing) or makes one that took items but has not replied put them back at the head of the
queue. Then the client awaits the get's reply: if the get had replied before the abandon
arrived, its items come back in that reply and the client returns them (`requeue`, to the
head, in order). Only then does the cancellation complete. The caller never saw the items, so
each item is delivered once, to a later get. (Cancelled again while handing back, the
hand-back finishes in the background on the same loop.)
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, NamedTuple, NoReturn, Self

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayError, RayTaskError

from async_queue import _handover, _wire
from async_queue.actor import (
    DEFAULT_HAND_OVER_TIMEOUT_S,
    DEFAULT_MAX_CONCURRENCY,
    start_queue_actor,
)
from async_queue.core import stale_threshold
from async_queue.errors import (
    HandOverTimeout,
    ProducerFailed,
    QueueClosed,
    QueueError,
    SyncClientInEventLoopError,
)
from async_queue.types import FullPolicy, QueueItem, QueueStats

__all__ = ["DEFAULT_BY_REF_BYTES", "MessageQueueClient", "SyncMessageQueueClient"]

logger = logging.getLogger(__name__)

# Hand-backs that outlived a second cancellation of their caller, and releases of fetched
# deliveries (strong references).
_BACKGROUND_CALLS: set[asyncio.Task[None]] = set()
DEFAULT_BY_REF_BYTES = _wire.DEFAULT_BY_REF_BYTES
# How long the sync client waits, after Ctrl-C, for the reply of the get it interrupted.
_SYNC_HAND_BACK_S = 10.0


def _ticket() -> str:
    return uuid.uuid4().hex


def _own_error(exc: RayTaskError) -> QueueError | None:
    """The queue's own exception inside a Ray task error, as a fresh local instance."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, QueueError):
        return type(cause)(*cause.args)
    return None


def _cause_text(error: BaseException | str | None) -> tuple[str | None, str | None]:
    if error is None:
        return None, None
    failure = ProducerFailed.from_error(error)
    return failure.cause_type, failure.cause_message


def _check_items(items: Sequence[QueueItem]) -> None:
    for item in items:
        if not isinstance(item, QueueItem):
            raise TypeError(f"queue items must be QueueItem, got {type(item).__name__}")


class _Outgoing(NamedTuple):
    """The wire elements of one put call, and for a pulled put where its payloads wait."""

    elements: list[_wire.WireItem]
    source: _wire.PullSource | None = None

    def args(self, elements: list[_wire.WireItem] | None = None) -> tuple[Any, ...]:
        """The put call's arguments (`elements` replaces the elements, e.g. filtered)."""
        elements = self.elements if elements is None else elements
        return (elements,) if self.source is None else (elements, self.source)

    def release(self) -> None:
        """The put call ended: payloads the queue actor did not pull are dropped here."""
        if self.source is not None:
            _handover.release(self.source.token)


def _pulled(items: Sequence[QueueItem], by_ref_bytes: int | None) -> _Outgoing | None:
    """A pulled put of `items`, when this process is an actor that can serve the hand-over
    (a call slot stays free for it), else None."""
    producer = _handover.producer_actor()
    if producer is None:
        return None
    elements, payloads = _wire.to_wire_pulled(items, by_ref_bytes)
    token = _handover.try_hold(payloads)
    if token is None:
        return None
    return _Outgoing(elements, _wire.PullSource(producer, token))


def _hand_over_failed(exc: HandOverTimeout) -> None:
    """A pulled put timed out in the queue actor (nothing queued): copy from now on."""
    _handover.disable(f"a hand-over timed out ({exc})")


def _check_batch_args(
    n: int, min_items: int, current_version: int | None, max_staleness: int | None
) -> None:
    # Fail in the caller, not as a Ray task error from the actor.
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 1 <= min_items <= n:
        raise ValueError(f"min_items must be in [1, n={n}], got {min_items}")
    stale_threshold(current_version, max_staleness)


class _PutBatcher:
    """Coalesces the concurrent single puts of one client on one event loop (module doc).

    At most one `put_each` call is in flight; items that arrive meanwhile wait in `_pending`
    and go together in the next call, in arrival order. Each caller awaits its own future.
    Items are turned into wire elements per call (`to_wire`), so the by-ref payloads of one
    call share one object-store object."""

    __slots__ = ("_actor", "_flusher", "_in_flight", "_pending", "_to_wire", "loop")

    def __init__(
        self,
        actor: ActorHandle,
        to_wire: Callable[[Sequence[QueueItem]], Awaitable[_Outgoing]],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._actor = actor
        self._to_wire = to_wire
        self.loop = loop
        self._pending: list[tuple[QueueItem, asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None
        # The call in flight and its callers' futures (to ray.cancel it if all give up).
        self._in_flight: tuple[ray.ObjectRef, list[asyncio.Future[None]]] | None = None

    async def put(self, item: QueueItem) -> None:
        future: asyncio.Future[None] = self.loop.create_future()
        self._pending.append((item, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = self.loop.create_task(self._flush())
        try:
            await future
        except asyncio.CancelledError:
            # The future is cancelled with its caller: a not yet sent item is skipped below.
            in_flight = self._in_flight
            if in_flight is not None and all(f.cancelled() for f in in_flight[1]):
                _cancel(in_flight[0])  # nobody waits for this call any more
            raise

    async def _flush(self) -> None:
        batch: list[tuple[QueueItem, asyncio.Future[None]]] = []
        try:
            while self._pending:
                batch = [(i, f) for i, f in self._pending if not f.done()]
                self._pending.clear()
                if batch:
                    await self._deliver(batch)
                batch = []
        except asyncio.CancelledError:  # the loop is shutting down: nobody gets an answer
            for _, future in [*batch, *self._pending]:
                future.cancel()
            self._pending.clear()
            raise

    async def _deliver(self, batch: list[tuple[QueueItem, asyncio.Future[None]]]) -> None:
        """Send `batch`; a pulled call whose hand-over timed out is sent again, copied."""
        for _attempt in range(2):  # the second attempt copies: it cannot time out so
            try:
                wire = await self._to_wire([i for i, _ in batch])
            except Exception as exc:  # e.g. the object store is full
                _fail_all([f for _, f in batch], exc)
                return
            try:
                await self._send(wire, batch)
                return
            except HandOverTimeout as exc:
                _hand_over_failed(exc)
            finally:
                wire.release()  # a pulled put's payloads: taken by now, or never

    async def _send(
        self, wire: _Outgoing, batch: list[tuple[QueueItem, asyncio.Future[None]]]
    ) -> None:
        """One `put_each` call for the items of `batch` whose callers still wait."""
        # Callers cancelled while their payloads were being stored: still not sent.
        elements = [e for e, (_, f) in zip(wire.elements, batch, strict=True) if not f.done()]
        futures = [f for _, f in batch if not f.done()]
        if not futures:
            return
        ref = self._actor.put_each.remote(*wire.args(elements))
        self._in_flight = (ref, futures)
        try:
            outcomes = await ref
        except RayTaskError as exc:
            own = _own_error(exc)
            if isinstance(own, HandOverTimeout) and wire.source is not None:
                raise own from None  # nothing was queued: `_deliver` copies it
            _fail_all(futures, own or exc)
        except Exception as exc:  # the actor died, the call was ray.cancelled, ...
            _fail_all(futures, exc)
        else:
            for i, future in enumerate(futures):
                outcome = None if outcomes is None else outcomes[i]
                if future.done():
                    continue  # its caller was cancelled meanwhile
                if outcome is None:
                    future.set_result(None)
                else:
                    future.set_exception(outcome)
        finally:
            self._in_flight = None


def _fail_all(futures: list[asyncio.Future[None]], error: BaseException) -> None:
    for future in futures:
        if not future.done():
            # A fresh copy of the queue's own errors per caller (no shared traceback).
            own = type(error)(*error.args) if isinstance(error, QueueError) else error
            future.set_exception(own)


class _QueueClient:
    """What the async and the blocking client share: their settings, how they are built
    (`create`, and `connect` through `_named`), their properties and how they pickle (as the
    actor handle and the by-ref settings)."""

    __slots__ = ("_actor", "_adopt", "_by_ref_bytes", "_pull")

    def __init__(
        self,
        actor: ActorHandle,
        by_ref_bytes: int | None = DEFAULT_BY_REF_BYTES,
        by_ref_owner: str = "queue",
        by_ref_pull: bool = True,
    ) -> None:
        self._actor = actor
        self._by_ref_bytes = _wire.check_by_ref_bytes(by_ref_bytes)
        self._adopt = _wire.adopt_for_owner(by_ref_owner)
        self._pull = bool(by_ref_pull)

    @classmethod
    def create(
        cls,
        maxsize: int = 1024,
        policy: FullPolicy | str = FullPolicy.BLOCK,
        *,
        name: str | None = None,
        namespace: str | None = None,
        detached: bool = False,
        get_if_exists: bool = False,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        actor_options: dict[str, Any] | None = None,
        by_ref_bytes: int | None = DEFAULT_BY_REF_BYTES,
        by_ref_owner: str = "queue",
        by_ref_pull: bool = True,
        hand_over_timeout_s: float = DEFAULT_HAND_OVER_TIMEOUT_S,
    ) -> Self:
        """Start a queue actor (see `start_queue_actor`) and return a client of it.

        Does not wait for the actor: the first call does. `name` makes it findable with
        `connect(name, namespace)`; `detached=True` lets it outlive this driver."""
        handle = start_queue_actor(
            maxsize,
            policy,
            name=name,
            namespace=namespace,
            detached=detached,
            get_if_exists=get_if_exists,
            max_concurrency=max_concurrency,
            actor_options=actor_options,
            hand_over_timeout_s=hand_over_timeout_s,
        )
        return cls(handle, by_ref_bytes, by_ref_owner, by_ref_pull)

    @classmethod
    def _named(
        cls,
        name: str,
        namespace: str | None,
        by_ref_bytes: int | None,
        by_ref_owner: str,
        by_ref_pull: bool,
    ) -> Self:
        """Client of the named actor: a blocking GCS lookup (the async `connect` runs it in
        a worker thread)."""
        return cls(ray.get_actor(name, namespace), by_ref_bytes, by_ref_owner, by_ref_pull)

    @property
    def handle(self) -> ActorHandle:
        """The actor handle (e.g. for `ray.kill`)."""
        return self._actor

    @property
    def by_ref_bytes(self) -> int | None:
        """Payloads of at least this many bytes go by reference (None: never)."""
        return self._by_ref_bytes

    @property
    def by_ref_owner(self) -> str:
        """Who owns by-ref payloads: "queue" (the default; they survive their producer) or
        "producer" (one copy less; lost if the producer exits before they are consumed)."""
        return "queue" if self._adopt else "producer"

    @property
    def by_ref_pull(self) -> bool:
        """Whether the queue actor may pull by-ref payloads from this process (see
        `MessageQueueClient`)."""
        return self._pull

    def _settings(self) -> tuple[ActorHandle, int | None, str, bool]:
        return (self._actor, self._by_ref_bytes, self.by_ref_owner, self._pull)

    def __reduce__(self) -> tuple[type[Self], tuple[ActorHandle, int | None, str, bool]]:
        return (type(self), self._settings())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._actor!r})"


class MessageQueueClient(_QueueClient):
    """Async client of a `QueueActor`; every method is `async` and awaits its Ray call.

    Build it with `MessageQueueClient.create(...)` (starts the actor),
    `await MessageQueueClient.connect(name)` (finds a named actor) or
    `MessageQueueClient(handle)`. Pass it to other actors as an argument: it pickles as its
    handle and `by_ref_bytes`. `async for item in client` yields items until the queue is
    closed and drained.

    `by_ref_bytes` (default `DEFAULT_BY_REF_BYTES`, 64 KiB; None: never): payloads at least
    this large travel through Ray's object store by reference (module doc, README).
    `by_ref_owner`: "queue" (default: the queue actor owns them, they survive a producer
    that exits) or "producer" (lost with the producer). `by_ref_pull` (default True): inside
    a Ray actor that serves concurrent calls, the queue actor pulls the payloads from this
    process (one write) instead of copying what this client `ray.put` (two); it needs one
    free call slot in this actor while a put waits (False: always copy).
    Concurrent `put`s coalesce into one actor call (module doc).

    Signals: `QueueClosed` (closed and drained / put after close), `ProducerFailed` (a
    producer called `close(error)`; raised at once, queued items are dropped as
    "producer_failed"), `QueueFull` (policy reject), `QueueTimeout` (a `TimeoutError`).
    No method returns None in place of an item.
    """

    __slots__ = ("_batcher",)

    def __init__(
        self,
        actor: ActorHandle,
        by_ref_bytes: int | None = DEFAULT_BY_REF_BYTES,
        by_ref_owner: str = "queue",
        by_ref_pull: bool = True,
    ) -> None:
        super().__init__(actor, by_ref_bytes, by_ref_owner, by_ref_pull)
        self._batcher: _PutBatcher | None = None

    @classmethod
    async def connect(
        cls,
        name: str,
        namespace: str | None = None,
        *,
        by_ref_bytes: int | None = DEFAULT_BY_REF_BYTES,
        by_ref_owner: str = "queue",
        by_ref_pull: bool = True,
    ) -> Self:
        """Client of the named queue actor. The lookup is a synchronous GCS call, so it runs
        in a worker thread to keep this loop free."""
        return await asyncio.to_thread(
            cls._named, name, namespace, by_ref_bytes, by_ref_owner, by_ref_pull
        )

    def to_sync(self) -> SyncMessageQueueClient:
        """A synchronous client of the same actor (for threads without a running loop)."""
        return SyncMessageQueueClient(*self._settings())

    # ------------------------------------------------------------------ producers

    async def put(self, item: QueueItem) -> None:
        """Enqueue one item; under policy block, waits for room. Returns once it is queued.

        Concurrent puts of this client coalesce into one actor call (module doc)."""
        _check_items((item,))
        loop = asyncio.get_running_loop()
        batcher = self._batcher
        if batcher is None or batcher.loop is not loop:
            batcher = self._batcher = _PutBatcher(self._actor, self._to_wire, loop)
        await batcher.put(item)

    async def put_many(self, items: Sequence[QueueItem]) -> None:
        """Enqueue many items in one Ray call (in order). Policy reject refuses all or none."""
        _check_items(items)
        for _attempt in range(2):  # the second attempt copies: it cannot time out so
            wire = await self._to_wire(items)
            try:
                await self._call(self._actor.put_many, *wire.args())
                return
            except HandOverTimeout as exc:
                if wire.source is None:
                    raise
                _hand_over_failed(exc)
            finally:
                wire.release()  # a pulled put's payloads: taken by now, or never

    async def close(self, error: BaseException | str | None = None) -> None:
        """End the stream, or (with `error`) fail it: consumers then raise `ProducerFailed`
        whose message contains the error's type name and text; queued items are dropped."""
        await self._call(self._actor.close, *_cause_text(error))

    # ------------------------------------------------------------------ consumers

    async def get(self, timeout: float | None = None) -> QueueItem:  # noqa: ASYNC109
        """Next item; `QueueTimeout` after `timeout` s (nothing taken), `QueueClosed` when
        closed and drained, `ProducerFailed` after a failure."""
        return (await self._take(self._actor.get, timeout))[0]

    async def get_batch(
        self,
        n: int,
        timeout: float | None = None,  # noqa: ASYNC109 (see MessageQueue.get_batch)
        *,
        min_items: int = 1,
        current_version: int | None = None,
        max_staleness: int | None = None,
    ) -> list[QueueItem]:
        """Wait for `min_items` (default 1) items, return up to `n` of them, oldest first.

        `min_items=n` waits for a full batch. Items with
        `version < current_version - max_staleness` are dropped (counted "stale").
        Timeout: `QueueTimeout`, nothing taken; the list is never empty. After `close()`, a
        partial final batch is returned, then `QueueClosed`."""
        _check_batch_args(n, min_items, current_version, max_staleness)
        return await self._take(
            self._actor.get_batch, n, timeout, min_items, current_version, max_staleness
        )

    async def __aiter__(self) -> AsyncIterator[QueueItem]:
        """Items one by one until the queue is closed and drained; `ProducerFailed` raises."""
        while True:
            try:
                item = await self.get()
            except QueueClosed:
                return
            yield item

    # ------------------------------------------------------------------ inspection

    async def stats(self) -> QueueStats:
        return _wire.decode_stats(await self._call(self._actor.stats))

    async def size(self) -> int:
        return int(await self._call(self._actor.size))

    async def item_ids(self) -> list[str]:
        """The `item_id`s of the queued items, oldest first; they stay queued (a producer
        that replaces a dead one uses them to skip what its predecessor already delivered)."""
        return list(await self._call(self._actor.item_ids))

    async def stale_item_ids(self, since: int = 0) -> tuple[int, list[str]]:
        """`(total, ids)`: how many items reads have dropped as too stale so far, and the
        `item_id`s of those after the first `since` (the last `STALE_IDS_KEPT` are kept), so
        a producer can generate them again: call again with `since=total`."""
        total, ids = await self._call(self._actor.stale_item_ids, since)
        return int(total), list(ids)

    async def peek_all(self) -> list[QueueItem]:
        """A copy of every queued item, with its payload, oldest first; they stay queued and
        no counter changes (a checkpoint saves what the consumer has not taken yet). By-ref
        payloads are fetched as a get fetches them. Read-only: another consumer may take the
        items at any time after, so only a caller that is the sole consumer (and is not
        reading) knows the copy is still what is queued."""
        ticket = _ticket()
        elements = await self._call(self._actor.peek_all, ticket)
        try:
            return await _wire.resolve(elements, _from_queue(self._actor, ticket))
        finally:
            _release_soon(self._actor, elements, ticket)

    async def actor_memory(self) -> dict[str, int]:
        """The queue actor's process: `pid`, `rss_bytes`, `peak_rss_bytes`."""
        return dict(await self._call(self._actor.memory))

    # ------------------------------------------------------------------ internals

    async def _to_wire(self, items: Sequence[QueueItem]) -> _Outgoing:
        """Without suspending unless payloads must be `ray.put` (so a pulled put, like a
        by-value one, is sent at once)."""
        if not _wire.needs_object_store(items, self._by_ref_bytes):
            return _Outgoing(_wire.to_wire(items, None))
        if self._adopt and self._pull:
            pulled = _pulled(items, self._by_ref_bytes)
            if pulled is not None:
                return pulled
        # ray.put copies the payloads into the object store: not on this loop.
        return _Outgoing(
            await asyncio.to_thread(_wire.to_wire, items, self._by_ref_bytes, self._adopt)
        )

    @staticmethod
    async def _call(method: Any, *args: Any) -> Any:
        ref = method.remote(*args)
        try:
            return await ref
        except RayTaskError as exc:
            _raise_own_error(exc)
        except asyncio.CancelledError:
            _cancel(ref)  # best effort: stop a put still waiting for room in the actor
            raise

    async def _take(self, method: Any, *args: Any) -> list[QueueItem]:
        """A get call whose items are never lost to a cancellation (see the module doc)."""
        ticket = _ticket()
        ref = method.remote(*args, ticket)
        try:
            elements = await ref
        except RayTaskError as exc:
            _raise_own_error(exc)
        except asyncio.CancelledError:
            await _in_background(_hand_back(self._actor, ref, ticket))
            raise
        return await _fetch(self._actor, elements, ticket)


async def _fetch(
    actor: ActorHandle, elements: list[_wire.WireItem], ticket: str
) -> list[QueueItem]:
    """The items of the get `ticket`'s reply, by-ref payloads fetched; then `release`. A
    fetch cancelled midway hands the items back first (taken but not delivered: the refs
    are still valid)."""
    try:
        items = await _wire.resolve(elements, _from_queue(actor, ticket))
    except asyncio.CancelledError:
        await _in_background(_requeue(actor, elements, ticket))
        raise
    except BaseException:
        _release_soon(actor, elements, ticket)
        raise
    _release_soon(actor, elements, ticket)
    return items


def _from_queue(actor: ActorHandle, ticket: str) -> _wire.FromQueue:
    """The payloads of the get (or peek) `ticket` by value, from the queue actor that holds
    them (see `_wire.resolve`)."""

    async def fetch(object_ids: list[bytes]) -> list[Any]:
        try:
            return await actor.held_payloads.remote(ticket, object_ids)
        except RayTaskError as exc:
            _raise_own_error(exc)

    return fetch


def _from_queue_blocking(actor: ActorHandle, ticket: str) -> _wire.FromQueueBlocking:
    """`_from_queue` for the sync clients."""

    def fetch(object_ids: list[bytes]) -> list[Any]:
        try:
            return ray.get(actor.held_payloads.remote(ticket, object_ids))
        except RayTaskError as exc:
            _raise_own_error(exc)

    return fetch


def _release_soon(actor: ActorHandle, elements: list[_wire.WireItem], ticket: str) -> None:
    """Tell the actor, in the background, that the by-ref payloads the get (or peek)
    `ticket` delivered were fetched or handed back (see `QueueActor.release`). No call when
    the delivery had none (the actor held nothing)."""
    if _wire.distinct_refs(elements):
        task = asyncio.ensure_future(_release(actor, ticket))
        _BACKGROUND_CALLS.add(task)
        task.add_done_callback(_BACKGROUND_CALLS.discard)


async def _release(actor: ActorHandle, ticket: str) -> None:
    try:
        await actor.release.remote(ticket)
    except RayError:  # the queue is gone: nothing is held any more
        logger.debug("could not release delivery %s", ticket, exc_info=True)


async def _in_background(hand_back: Coroutine[Any, Any, None]) -> None:
    """Run a hand-back to its end even if the caller is cancelled again meanwhile."""
    task = asyncio.ensure_future(hand_back)
    _BACKGROUND_CALLS.add(task)
    task.add_done_callback(_BACKGROUND_CALLS.discard)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        pass  # cancelled again: the hand-back goes on in the background
    except Exception:
        logger.warning("could not hand items back to the queue", exc_info=True)


class SyncMessageQueueClient(_QueueClient):
    """Blocking client for plain scripts and threads (uses `ray.get`).

    Same methods, parameters and signals as `MessageQueueClient`, without `await`. Calling it
    on a thread whose event loop is running raises `SyncClientInEventLoopError` (a
    `RuntimeError`) instead of blocking that loop: use `MessageQueueClient` there.
    """

    __slots__ = ()

    @classmethod
    def connect(
        cls,
        name: str,
        namespace: str | None = None,
        *,
        by_ref_bytes: int | None = DEFAULT_BY_REF_BYTES,
        by_ref_owner: str = "queue",
        by_ref_pull: bool = True,
    ) -> Self:
        _forbid_running_loop("connect")
        return cls._named(name, namespace, by_ref_bytes, by_ref_owner, by_ref_pull)

    def to_async(self) -> MessageQueueClient:
        return MessageQueueClient(*self._settings())

    def put(self, item: QueueItem) -> None:
        _check_items((item,))
        self._put("put", (item,))

    def put_many(self, items: Sequence[QueueItem]) -> None:
        _check_items(items)
        self._put("put_many", items)

    def close(self, error: BaseException | str | None = None) -> None:
        self._call("close", self._actor.close, *_cause_text(error))

    def get(self, timeout: float | None = None) -> QueueItem:
        return self._take("get", self._actor.get, timeout)[0]

    def get_batch(
        self,
        n: int,
        timeout: float | None = None,
        *,
        min_items: int = 1,
        current_version: int | None = None,
        max_staleness: int | None = None,
    ) -> list[QueueItem]:
        _check_batch_args(n, min_items, current_version, max_staleness)
        return self._take(
            "get_batch",
            self._actor.get_batch,
            n,
            timeout,
            min_items,
            current_version,
            max_staleness,
        )

    def __iter__(self) -> Iterator[QueueItem]:
        while True:
            try:
                item = self.get()
            except QueueClosed:
                return
            yield item

    def stats(self) -> QueueStats:
        return _wire.decode_stats(self._call("stats", self._actor.stats))

    def size(self) -> int:
        return int(self._call("size", self._actor.size))

    def item_ids(self) -> list[str]:
        """The `item_id`s of the queued items, oldest first; they stay queued."""
        return list(self._call("item_ids", self._actor.item_ids))

    def peek_all(self) -> list[QueueItem]:
        """A copy of every queued item, oldest first; they stay queued (see the async
        client's `peek_all`)."""
        ticket = _ticket()
        elements = self._call("peek_all", self._actor.peek_all, ticket)
        try:
            return _wire.from_wire_blocking(elements, _from_queue_blocking(self._actor, ticket))
        finally:
            _release_now(self._actor, elements, ticket)

    def actor_memory(self) -> dict[str, int]:
        return dict(self._call("actor_memory", self._actor.memory))

    def _put(self, name: str, items: Sequence[QueueItem]) -> None:
        _forbid_running_loop(name)  # before any ray.put or hold
        for _attempt in range(2):  # the second attempt copies: it cannot time out so
            wire = self._to_wire(items)
            try:
                self._call(name, self._actor.put_many, *wire.args())
                return
            except HandOverTimeout as exc:
                if wire.source is None:
                    raise
                _hand_over_failed(exc)
            finally:
                wire.release()  # a pulled put's payloads: taken by now, or never

    def _to_wire(self, items: Sequence[QueueItem]) -> _Outgoing:
        if self._adopt and self._pull and _wire.needs_object_store(items, self._by_ref_bytes):
            # A threaded actor with max_concurrency > 1 serves the hand-over on another thread.
            pulled = _pulled(items, self._by_ref_bytes)
            if pulled is not None:
                return pulled
        return _Outgoing(_wire.to_wire(items, self._by_ref_bytes, self._adopt))

    @staticmethod
    def _call(name: str, method: Any, *args: Any) -> Any:
        _forbid_running_loop(name)
        try:
            return ray.get(method.remote(*args))
        except RayTaskError as exc:
            _raise_own_error(exc)

    def _take(self, name: str, method: Any, *args: Any) -> list[QueueItem]:
        """A get whose items survive Ctrl-C (KeyboardInterrupt) like the async client's."""
        _forbid_running_loop(name)
        ticket = _ticket()
        ref = method.remote(*args, ticket)
        try:
            elements = ray.get(ref)
        except RayTaskError as exc:
            _raise_own_error(exc)
        except KeyboardInterrupt:
            ray.get(self._actor.abandon.remote(ticket), timeout=_SYNC_HAND_BACK_S)
            try:
                elements = ray.get(ref, timeout=_SYNC_HAND_BACK_S)
            except RayError:  # GetTimeoutError too
                elements = None  # nothing was taken (or the queue is gone)
            if elements:
                self._hand_back(elements, ticket)
            raise
        try:
            # Fetches by-ref payloads.
            items = _wire.from_wire_blocking(elements, _from_queue_blocking(self._actor, ticket))
        except KeyboardInterrupt:
            self._hand_back(elements, ticket)  # releases once the queue holds them again
            raise
        except BaseException:
            _release_now(self._actor, elements, ticket)
            raise
        _release_now(self._actor, elements, ticket)
        return items

    def _hand_back(self, elements: list[_wire.WireItem], ticket: str) -> None:
        try:
            ray.get(self._actor.requeue.remote(elements), timeout=_SYNC_HAND_BACK_S)
        finally:
            _release_now(self._actor, elements, ticket)


def _release_now(actor: ActorHandle, elements: list[_wire.WireItem], ticket: str) -> None:
    """The sync client's `_release_soon`: sent, not waited for (it never fails the get)."""
    if _wire.distinct_refs(elements):
        actor.release.remote(ticket)


def _cancel(ref: ray.ObjectRef) -> None:
    """Ask Ray to cancel an actor call (a no-op if it finished)."""
    try:
        ray.cancel(ref)
    except Exception:
        logger.debug("could not cancel queue call", exc_info=True)


async def _requeue(actor: ActorHandle, elements: list[_wire.WireItem], ticket: str) -> None:
    try:
        await actor.requeue.remote(elements)
    finally:
        _release_soon(actor, elements, ticket)  # after the queue holds the refs again
    logger.debug("handed %d item(s) of a cancelled get back to the queue", len(elements))


async def _hand_back(actor: ActorHandle, ref: ray.ObjectRef, ticket: str) -> None:
    """After the caller of a get was cancelled: abandon the get in the actor; if it replied
    with items before the abandon arrived, put them back at the head of the queue."""
    await actor.abandon.remote(ticket)
    try:
        elements = await ref
    except RayError:
        return  # abandoned, timed out, closed, failed, or the actor is gone: nothing taken
    if elements:
        await _requeue(actor, elements, ticket)


def _forbid_running_loop(method_name: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return  # no loop running on this thread: blocking is fine
    raise SyncClientInEventLoopError(
        f"SyncMessageQueueClient.{method_name}() called while an asyncio event loop is running "
        f"in this thread; it would block the loop. Use the async client instead: "
        f"`await MessageQueueClient.{method_name}(...)` (async_queue.MessageQueueClient, "
        f"e.g. `sync_client.to_async()`)."
    )


def _raise_own_error(exc: RayTaskError) -> NoReturn:
    """Re-raise the queue's own error carried by a Ray task error, else the Ray error."""
    own = _own_error(exc)
    try:
        if own is None:
            raise exc
        raise own from None
    finally:
        # The raised error's traceback holds this frame: cleared, its locals make no cycle
        # with it, so the error (and the Ray error and call it came from) is freed as soon
        # as the caller drops it, not at the next garbage collection.
        own = exc = None  # type: ignore[assignment]
