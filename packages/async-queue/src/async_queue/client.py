"""Clients of the queue actor: `MessageQueueClient` (async) and `SyncMessageQueueClient`.

Both are thin and picklable (they hold only the actor handle), so they can be passed to other
Ray actors and tasks. Each method is one Ray actor call; a batch moves in one call as
msgpack-encoded items. Exceptions the actor raises arrive wrapped in `RayTaskError`; the
clients re-raise the package's own `QueueClosed`, `ProducerFailed`, `QueueFull`,
`QueueTimeout`.

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
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, NoReturn, Self

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayError, RayTaskError

from async_queue import _wire
from async_queue.actor import DEFAULT_MAX_CONCURRENCY, start_queue_actor
from async_queue.core import stale_threshold
from async_queue.errors import (
    ProducerFailed,
    QueueClosed,
    QueueError,
    SyncClientInEventLoopError,
)
from async_queue.types import FullPolicy, QueueItem, QueueStats

__all__ = ["MessageQueueClient", "SyncMessageQueueClient"]

logger = logging.getLogger(__name__)

# Hand-backs that outlived a second cancellation of their caller (strong references).
_HANDING_BACK: set[asyncio.Task[None]] = set()
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


def _check_batch_args(
    n: int, min_items: int, current_version: int | None, max_staleness: int | None
) -> None:
    # Fail in the caller, not as a Ray task error from the actor.
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 1 <= min_items <= n:
        raise ValueError(f"min_items must be in [1, n={n}], got {min_items}")
    stale_threshold(current_version, max_staleness)


class MessageQueueClient:
    """Async client of a `QueueActor`; every method is `async` and awaits its Ray call.

    Build it with `MessageQueueClient.create(...)` (starts the actor),
    `await MessageQueueClient.connect(name)` (finds a named actor) or
    `MessageQueueClient(handle)`. Pass it to other actors as an argument: it pickles as its
    handle. `async for item in client` yields items until the queue is closed and drained.

    Signals: `QueueClosed` (closed and drained / put after close), `ProducerFailed` (a
    producer called `close(error)`; raised at once, queued items are dropped as
    "producer_failed"), `QueueFull` (policy reject), `QueueTimeout` (a `TimeoutError`).
    No method returns None in place of an item.
    """

    __slots__ = ("_actor",)

    def __init__(self, actor: ActorHandle) -> None:
        self._actor = actor

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
        )
        return cls(handle)

    @classmethod
    async def connect(cls, name: str, namespace: str | None = None) -> Self:
        """Client of the named queue actor. The lookup is a synchronous GCS call, so it runs
        in a worker thread to keep this loop free."""
        handle = await asyncio.to_thread(ray.get_actor, name, namespace)
        return cls(handle)

    @property
    def handle(self) -> ActorHandle:
        """The actor handle (e.g. for `ray.kill`)."""
        return self._actor

    def to_sync(self) -> SyncMessageQueueClient:
        """A synchronous client of the same actor (for threads without a running loop)."""
        return SyncMessageQueueClient(self._actor)

    def __reduce__(self) -> tuple[type[MessageQueueClient], tuple[ActorHandle]]:
        return (type(self), (self._actor,))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._actor!r})"

    # ------------------------------------------------------------------ producers

    async def put(self, item: QueueItem) -> None:
        """Enqueue one item; under policy block, waits for room."""
        _check_items((item,))
        await self._call(self._actor.put_many, _wire.to_wire((item,)))

    async def put_many(self, items: Sequence[QueueItem]) -> None:
        """Enqueue many items in one Ray call (in order). Policy reject refuses all or none."""
        _check_items(items)
        await self._call(self._actor.put_many, _wire.to_wire(items))

    async def close(self, error: BaseException | str | None = None) -> None:
        """End the stream, or (with `error`) fail it: consumers then raise `ProducerFailed`
        whose message contains the error's type name and text; queued items are dropped."""
        await self._call(self._actor.close, *_cause_text(error))

    # ------------------------------------------------------------------ consumers

    async def get(self, timeout: float | None = None) -> QueueItem:  # noqa: ASYNC109
        """Next item; `QueueTimeout` after `timeout` s (nothing taken), `QueueClosed` when
        closed and drained, `ProducerFailed` after a failure."""
        return _wire.from_wire(await self._take(self._actor.get, timeout))[0]

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
        elements = await self._take(
            self._actor.get_batch, n, timeout, min_items, current_version, max_staleness
        )
        return _wire.from_wire(elements)

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

    # ------------------------------------------------------------------ internals

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

    async def _take(self, method: Any, *args: Any) -> list[_wire.WireItem]:
        """A get call whose items are never lost to a cancellation (see the module doc)."""
        ticket = _ticket()
        ref = method.remote(*args, ticket)
        try:
            return await ref
        except RayTaskError as exc:
            _raise_own_error(exc)
        except asyncio.CancelledError:
            hand_back = asyncio.ensure_future(_hand_back(self._actor, ref, ticket))
            _HANDING_BACK.add(hand_back)
            hand_back.add_done_callback(_HANDING_BACK.discard)
            try:
                await asyncio.shield(hand_back)
            except asyncio.CancelledError:
                pass  # cancelled again: the hand-back goes on in the background
            except Exception:
                logger.warning("could not hand items back to the queue", exc_info=True)
            raise


class SyncMessageQueueClient:
    """Blocking client for plain scripts and threads (uses `ray.get`).

    Same methods and signals as `MessageQueueClient`, without `await`. Calling it on a thread
    whose event loop is running raises `SyncClientInEventLoopError` (a `RuntimeError`) instead
    of blocking that loop: use `MessageQueueClient` there.
    """

    __slots__ = ("_actor",)

    def __init__(self, actor: ActorHandle) -> None:
        self._actor = actor

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
    ) -> Self:
        """Start a queue actor; same arguments as `MessageQueueClient.create`."""
        handle = start_queue_actor(
            maxsize,
            policy,
            name=name,
            namespace=namespace,
            detached=detached,
            get_if_exists=get_if_exists,
            max_concurrency=max_concurrency,
            actor_options=actor_options,
        )
        return cls(handle)

    @classmethod
    def connect(cls, name: str, namespace: str | None = None) -> Self:
        _forbid_running_loop("connect")
        return cls(ray.get_actor(name, namespace))

    @property
    def handle(self) -> ActorHandle:
        return self._actor

    def to_async(self) -> MessageQueueClient:
        return MessageQueueClient(self._actor)

    def __reduce__(self) -> tuple[type[SyncMessageQueueClient], tuple[ActorHandle]]:
        return (type(self), (self._actor,))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._actor!r})"

    def put(self, item: QueueItem) -> None:
        _check_items((item,))
        self._call("put", self._actor.put_many, _wire.to_wire((item,)))

    def put_many(self, items: Sequence[QueueItem]) -> None:
        _check_items(items)
        self._call("put_many", self._actor.put_many, _wire.to_wire(items))

    def close(self, error: BaseException | str | None = None) -> None:
        self._call("close", self._actor.close, *_cause_text(error))

    def get(self, timeout: float | None = None) -> QueueItem:
        return _wire.from_wire(self._take("get", self._actor.get, timeout))[0]

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
        elements = self._take(
            "get_batch",
            self._actor.get_batch,
            n,
            timeout,
            min_items,
            current_version,
            max_staleness,
        )
        return _wire.from_wire(elements)

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

    @staticmethod
    def _call(name: str, method: Any, *args: Any) -> Any:
        _forbid_running_loop(name)
        try:
            return ray.get(method.remote(*args))
        except RayTaskError as exc:
            _raise_own_error(exc)

    def _take(self, name: str, method: Any, *args: Any) -> list[_wire.WireItem]:
        """A get whose items survive Ctrl-C (KeyboardInterrupt) like the async client's."""
        _forbid_running_loop(name)
        ticket = _ticket()
        ref = method.remote(*args, ticket)
        try:
            return ray.get(ref)
        except RayTaskError as exc:
            _raise_own_error(exc)
        except KeyboardInterrupt:
            ray.get(self._actor.abandon.remote(ticket), timeout=_SYNC_HAND_BACK_S)
            try:
                elements = ray.get(ref, timeout=_SYNC_HAND_BACK_S)
            except RayError:  # GetTimeoutError too
                elements = None  # nothing was taken (or the queue is gone)
            if elements:
                ray.get(self._actor.requeue.remote(elements), timeout=_SYNC_HAND_BACK_S)
            raise


def _cancel(ref: ray.ObjectRef) -> None:
    """Ask Ray to cancel an actor call (a no-op if it finished)."""
    try:
        ray.cancel(ref)
    except Exception:
        logger.debug("could not cancel queue call", exc_info=True)


async def _hand_back(actor: ActorHandle, ref: ray.ObjectRef, ticket: str) -> None:
    """After the caller of a get was cancelled: abandon the get in the actor; if it replied
    with items before the abandon arrived, put them back at the head of the queue."""
    await actor.abandon.remote(ticket)
    try:
        elements = await ref
    except RayError:
        return  # abandoned, timed out, closed, failed, or the actor is gone: nothing taken
    if elements:
        await actor.requeue.remote(elements)
        logger.debug("handed %d item(s) of a cancelled get back to the queue", len(elements))


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
    if own is None:
        raise exc
    raise own from None
