"""`QueueActor`: the Ray actor around `MessageQueue`, and the function that starts it.

Use it through `MessageQueueClient`; the actor's own methods take and return encoded items
(see `async_queue._wire`) and may change. The actor is async, so one event loop serves every
call, and `max_concurrency` (default 1000) bounds how many calls may wait at once: it must
exceed the number of consumers that can wait together, or a waiting crowd would lock out the
producer.

A get carries a `ticket` (a client-made id) so that its caller can abandon it: see
`QueueActor.abandon` and the client's module doc for how a cancelled get never loses items.

By-reference payloads are owned by this actor before they are queued, so a producer that
exits after its put returned loses nothing it put. (Ray >= 2.56 has no `ray.put(..., _owner=)`;
the owner of a call's return values is its caller, so this actor makes them its own by being
the caller of the call that writes them.) Two ways, one per put call (see `_wire`):

- pulled (`_wire.Pulled` elements plus a `_wire.PullSource`): the producing client runs in a
  Ray actor and still holds the payloads; this actor calls it back
  (`__ray_call__(_handover.hand_over, token)`, two return values) and queues refs to the
  second one, the payloads, written once by the producer into its node's object store.
- copied (`_wire.ByRef` with `adopt`): the producer `ray.put` them; a small helper actor
  (`PayloadAdopter`, started by this actor on first use, on its node) returns each payload
  object as a new object. The producer's own object is freed when its put returns.

Either way the queue holds only refs; the payload bytes never enter this process.

A get that delivers by-ref items keeps their payload refs under its ticket until the client
says it has fetched them (`release`), so the payload objects live at least that long. Holds a
client never releases (it died) are dropped after `DELIVERY_HOLD_S`. Rarely (about once in 30
runs of the by-ref stress), Ray never delivers a small payload object to a consumer that
borrows it although this actor, its owner, holds it and can read it; so a client that has not
learnt of a payload object `_wire.FETCH_STALL_S` after the reply asks for it by value
(`held_payloads`), the one path on which payload bytes pass through this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import pickle
import resource
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Coroutine
from typing import Any

import ray

from async_queue import _handover, _wire
from async_queue.core import MessageQueue
from async_queue.errors import (
    GetAbandoned,
    HandOverTimeout,
    PayloadUnavailable,
    ProducerFailed,
    PutWithdrawn,
    QueueError,
)
from async_queue.types import FullPolicy

__all__ = [
    "DEFAULT_HAND_OVER_TIMEOUT_S",
    "DEFAULT_MAX_CONCURRENCY",
    "DELIVERY_HOLD_S",
    "STALE_IDS_KEPT",
    "PayloadAdopter",
    "QueueActor",
    "start_queue_actor",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONCURRENCY = 1000
# How long a pulled put waits for its producer to hand the payloads over. A hand-over takes
# milliseconds when the producer has a free call slot; one that has none may never serve it,
# so the put fails (nothing queued) and its client sends it again by copying.
DEFAULT_HAND_OVER_TIMEOUT_S = 10.0
# Abandons that found no get of their ticket are remembered (for a get that arrives late);
# the oldest are forgotten beyond this many.
_EARLY_ABANDONS_KEPT = 1024
# The ids of items dropped as too stale that `stale_item_ids` can still report (a producer
# generates those prompts again); the oldest are forgotten beyond this many.
STALE_IDS_KEPT = 4096
# How long a delivery's payload refs are held for a client that never releases them (it
# died between the get's reply and its fetch); a live client releases within milliseconds.
DELIVERY_HOLD_S = 600.0


class PayloadAdopter:
    """Returns by-ref payload objects as new objects, owned by whoever called `adopt` (the
    queue actor). It only passes buffers through: Ray maps each argument (a list of payload
    buffers) from the object store without copying and writes each return value once into
    it."""

    def adopt(self, *objects: list[Any]) -> tuple[Any, ...]:
        # The last return value is a small marker: awaiting it tells the caller that every
        # new object is stored, without fetching any payload into the caller.
        return (*([pickle.PickleBuffer(p) for p in obj] for obj in objects), len(objects))


class QueueActor:
    """Holds one `MessageQueue`. All methods are `async` so they share the actor's loop."""

    def __init__(
        self, maxsize: int, policy: str, hand_over_timeout_s: float = DEFAULT_HAND_OVER_TIMEOUT_S
    ) -> None:
        self._hand_over_timeout_s = hand_over_timeout_s
        # Items stay encoded: the actor reads only their version (see async_queue._wire).
        self._queue: MessageQueue[_wire.RawItem] = MessageQueue(
            maxsize, policy, on_stale=self._record_stale
        )
        # The ids of the last items dropped as too stale, and how many were ever recorded.
        self._stale_ids: deque[str] = deque(maxlen=STALE_IDS_KEPT)
        self._stale_total = 0
        self._gets: dict[str, asyncio.Task[list[_wire.RawItem]]] = {}  # ticket -> its get
        self._abandoned: set[str] = set()  # tickets of running gets their caller abandoned
        self._early_abandons: OrderedDict[str, None] = OrderedDict()
        self._adopter: ray.actor.ActorHandle | None = None
        # ticket -> (when, the payload refs its get or peek delivered); oldest first.
        self._held: OrderedDict[str, tuple[float, list[ray.ObjectRef]]] = OrderedDict()

    async def put_many(
        self, elements: list[_wire.WireItem], source: _wire.PullSource | None = None
    ) -> None:
        """Enqueue `elements` (all or none under policy reject). `source`: where the `Pulled`
        payloads among them are (a pulled put; see `_own`)."""
        await self._queue.put_many(_wire.to_raw_items(await self._own(elements, source)))

    async def put_each(
        self, elements: list[_wire.WireItem], source: _wire.PullSource | None = None
    ) -> list[QueueError | None] | None:
        """Single puts of several callers, coalesced by one client into one call: each item
        is enqueued as its own `put` would be (see `MessageQueue.put_each`). Returns None when
        all were enqueued, else each item's outcome (None or the error for its caller)."""
        owned = await self._own(elements, source)
        outcomes = await self._queue.put_each(_wire.to_raw_items(owned))
        return outcomes if any(o is not None for o in outcomes) else None

    async def memory(self) -> dict[str, int]:
        """This actor's process: `pid`, `rss_bytes` (now) and `peak_rss_bytes` (high-water
        mark), e.g. to check that by-ref payloads stay out of its heap."""
        return _process_memory()

    async def _own(
        self, elements: list[_wire.WireItem], source: _wire.PullSource | None
    ) -> list[_wire.WireItem]:
        """Make this actor the owner of every by-ref payload of a put before it is queued:
        pull those the producer still holds, re-own those it `ray.put`."""
        if self._queue.closed:  # the put fails in the queue; pull or copy nothing
            return elements
        if source is not None:
            elements = await self._pull(elements, source)
        return await self._adopt(elements)

    async def _pull(
        self, elements: list[_wire.WireItem], source: _wire.PullSource
    ) -> list[_wire.WireItem]:
        """Take the `Pulled` payloads of a put from its producer (see `_handover`): one call
        into the producing actor, whose second return value (the payloads, one object) this
        actor owns as that call's caller. Only the first (a count) is awaited, so the payload
        bytes never enter this process. Raises when the producer died, the put already
        ended there (`PutWithdrawn`) or the producer did not serve the call in time
        (`HandOverTimeout`): then nothing of this put is queued."""
        pulled = [e for e in elements if isinstance(e, _wire.Pulled)]
        if not pulled:
            return elements
        call = source.producer.__ray_call__.options(num_returns=2)
        count_ref, payloads = call.remote(_handover.hand_over, source.token)
        # A put that fails or is cancelled here leaves this frame in its error's traceback,
        # and on Python 3.11 asyncio can keep that error in a reference cycle until the next
        # garbage collection (in an idle actor, minutes or never): so each way out lets go
        # of the payloads object first, or the object store would keep it until then.
        try:
            count = await asyncio.wait_for(count_ref, self._hand_over_timeout_s)
        except TimeoutError:
            _cancel_quietly(count_ref)  # still queued in the producer; it finds GONE if run
            del payloads
            raise HandOverTimeout(
                f"the producer did not hand the payloads over within "
                f"{self._hand_over_timeout_s} s (no free call slot?)"
            ) from None
        except ray.exceptions.RayError:
            # The same error is in `payloads` (no bytes to fetch): read it, so that Ray does
            # not log it as an unhandled error when the ref goes.
            try:
                with contextlib.suppress(ray.exceptions.RayError):
                    await payloads
            finally:  # also when cancelled meanwhile (`ray.cancel` cancels the hand-over too)
                del payloads
            raise
        except BaseException:  # cancelled
            del payloads
            raise
        if count == _handover.GONE:
            raise PutWithdrawn(
                "the producer no longer holds this put's payloads (its put call was cancelled "
                "or failed before the queue took them)"
            )
        if max(e.index for e in pulled) >= count:
            raise RuntimeError(f"hand-over returned {count} payloads for {len(pulled)} items")
        return [
            _wire.ByRef(e.version, e.header, payloads, e.index, adopt=False)
            if isinstance(e, _wire.Pulled)
            else e
            for e in elements
        ]

    async def _adopt(self, elements: list[_wire.WireItem]) -> list[_wire.WireItem]:
        """Re-own the by-ref payload objects among `elements` (see the module doc): one
        adopter call, one new object per distinct object (normally one per put call)."""
        to_adopt = [e for e in elements if isinstance(e, _wire.ByRef) and e.adopt]
        if not to_adopt:
            return elements
        if self._adopter is None:
            self._adopter = _start_adopter()
        objects = _wire.distinct_refs(to_adopt)
        method = self._adopter.adopt.options(num_returns=len(objects) + 1)
        refs = method.remote(*objects.values())
        try:
            await refs[-1]  # only the marker is fetched; the payloads stay in the store
        except ray.exceptions.RayActorError:
            self._adopter = None  # start a new one for the next put
            del refs  # as in `_pull`: not kept alive by the error
            raise
        except BaseException:  # cancelled
            del refs
            raise
        adopted = dict(zip(objects, refs, strict=False))
        return [
            # Marked adopted, so that a requeue or a later hop never copies it again.
            e._replace(ref=adopted[e.ref.binary()], adopt=False)
            if isinstance(e, _wire.ByRef) and e.adopt
            else e
            for e in elements
        ]

    async def get(
        self,
        timeout: float | None,  # noqa: ASYNC109
        ticket: str | None = None,
    ) -> list[_wire.WireItem]:
        batch = await self._take(ticket, self._queue.get_batch(1, timeout))
        return self._deliver(ticket, [batch[0].wire])

    async def get_batch(
        self,
        n: int,
        timeout: float | None,  # noqa: ASYNC109 (see MessageQueue.get_batch)
        min_items: int,
        current_version: int | None,
        max_staleness: int | None,
        ticket: str | None = None,
    ) -> list[_wire.WireItem]:
        call = self._queue.get_batch(
            n,
            timeout,
            min_items=min_items,
            current_version=current_version,
            max_staleness=max_staleness,
        )
        return self._deliver(ticket, [item.wire for item in await self._take(ticket, call)])

    async def release(self, ticket: str) -> None:
        """The client of the get (or peek) `ticket` has fetched its by-ref payloads (or
        handed its items back): stop holding them (see the module doc)."""
        self._held.pop(ticket, None)

    async def held_payloads(self, ticket: str, object_ids: list[bytes]) -> list[list[Any]]:
        """By value, the payload objects `object_ids` that the get (or peek) `ticket`
        delivered and this actor still holds: the client's way out when Ray does not deliver
        one to it (see `_wire.resolve`). Raises `PayloadUnavailable` for one not held."""
        held = self._held.get(ticket)
        refs = {ref.binary(): ref for ref in held[1]} if held else {}
        missing = [oid.hex() for oid in object_ids if oid not in refs]
        if missing:
            raise PayloadUnavailable(
                f"the queue no longer holds payload object(s) {missing} of get {ticket} "
                "(released, or held longer than DELIVERY_HOLD_S)"
            )
        values = await asyncio.gather(*(refs[oid] for oid in object_ids))
        # Out of band, as the adopter writes them: one copy into the reply's object.
        return [[pickle.PickleBuffer(p) for p in value] for value in values]

    async def held_deliveries(self) -> int:
        """How many deliveries still hold their payload refs (0 once every client released)."""
        self._forget_old_holds()
        return len(self._held)

    def _deliver(self, ticket: str | None, elements: list[_wire.WireItem]) -> list[_wire.WireItem]:
        """Hold the payload refs of `elements` under `ticket` until `release` (module doc)."""
        self._forget_old_holds()
        refs = list(_wire.distinct_refs(elements).values())
        if refs and ticket is not None:
            self._held[ticket] = (time.monotonic(), refs)
        return elements

    def _forget_old_holds(self) -> None:
        cutoff = time.monotonic() - DELIVERY_HOLD_S
        while self._held and next(iter(self._held.values()))[0] < cutoff:
            ticket, _ = self._held.popitem(last=False)
            logger.warning("dropped the payload hold of get %s: never released", ticket)

    async def abandon(self, ticket: str) -> None:
        """The caller of the get `ticket` was cancelled and no longer wants its items.

        A get still waiting stops and takes nothing; one that took items but has not replied
        yet gives them back (`requeue`) and raises `GetAbandoned`; one that arrives later
        raises `GetAbandoned` at once. A get that already replied is the client's to undo:
        it hands the items of that reply back with `requeue`."""
        task = self._gets.get(ticket)
        if task is None:
            self._early_abandons[ticket] = None
            while len(self._early_abandons) > _EARLY_ABANDONS_KEPT:
                self._early_abandons.popitem(last=False)
            return
        self._abandoned.add(ticket)
        task.cancel()  # no effect if it has taken its items already: _take gives them back

    async def requeue(self, elements: list[_wire.WireItem]) -> None:
        """Take back the items of a get whose caller was cancelled (see `abandon`)."""
        await self._queue.requeue(_wire.to_raw_items(elements))

    async def _take(
        self, ticket: str | None, call: Coroutine[Any, Any, list[_wire.RawItem]]
    ) -> list[_wire.RawItem]:
        """Run a get of the core under its ticket, so that `abandon(ticket)` can stop it."""
        if ticket is None:
            return await call
        if self._early_abandons.pop(ticket, False) is None:
            call.close()
            raise GetAbandoned(ticket)
        task = asyncio.ensure_future(call)
        self._gets[ticket] = task
        try:
            batch = await task
        except asyncio.CancelledError:
            if ticket in self._abandoned and task.cancelled():
                raise GetAbandoned(ticket) from None
            # This call itself was cancelled (ray.cancel): stop the wait; give back what it took.
            if not task.done():
                task.cancel()
            elif not task.cancelled() and task.exception() is None:
                await self._queue.requeue(await task)  # done: returns at once
            raise
        finally:
            del self._gets[ticket]
            abandoned = ticket in self._abandoned
            self._abandoned.discard(ticket)
        if abandoned:  # taken just before the abandon came: back to the head, not returned
            await self._queue.requeue(batch)
            raise GetAbandoned(ticket)
        return batch

    async def close(self, cause_type: str | None, cause_message: str | None) -> None:
        # The cause arrives as text: the actor need not import the producer's exception class.
        if cause_type is None:
            await self._queue.close()
        else:
            await self._queue.close(ProducerFailed(cause_type, cause_message or ""))

    async def stats(self) -> bytes:
        return _wire.encode_stats(self._queue.stats())

    async def size(self) -> int:
        return self._queue.qsize()

    async def item_ids(self) -> list[str]:
        return [_wire.item_id(raw.wire) for raw in self._queue.items()]

    def _record_stale(self, items: list[_wire.RawItem]) -> None:
        for raw in items:
            self._stale_ids.append(_wire.item_id(raw.wire))
        self._stale_total += len(items)

    async def stale_item_ids(self, since: int = 0) -> tuple[int, list[str]]:
        """(how many stale drops were recorded, the ids of those after the first `since`
        that are still kept: the last `STALE_IDS_KEPT`)."""
        missed = self._stale_total - len(self._stale_ids)
        start = max(0, since - missed)
        return self._stale_total, list(self._stale_ids)[start:]

    async def peek_all(self, ticket: str | None = None) -> list[_wire.WireItem]:
        """Every queued item in its wire form, oldest first; nothing is taken or counted (a
        by-ref item's payload stays in the object store: the client fetches it, then
        releases `ticket`: a get may take the items meanwhile)."""
        return self._deliver(ticket, [raw.wire for raw in self._queue.items()])


def _cancel_quietly(ref: ray.ObjectRef) -> None:
    try:
        ray.cancel(ref)
    except Exception:
        logger.debug("could not cancel a hand-over call", exc_info=True)


@functools.cache
def _remote_class() -> Any:
    return ray.remote(QueueActor)


@functools.cache
def _adopter_class() -> Any:
    return ray.remote(PayloadAdopter)


def _start_adopter() -> ray.actor.ActorHandle:
    """The queue actor's helper, on the queue actor's node when it can (the payload copies
    then stay local). Started by the queue actor, it dies with it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return (
        _adopter_class()
        .options(
            num_cpus=0,
            max_concurrency=2,
            max_restarts=-1,
            max_task_retries=3,  # adopt only copies: safe to retry
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True),
        )
        .remote()
    )


def _process_memory() -> dict[str, int]:
    fields: dict[str, int] = {}
    try:
        with open("/proc/self/status") as status:  # Linux: procfs, no disk I/O
            for line in status:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    fields[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    # ru_maxrss: KiB on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024
    return {
        "pid": os.getpid(),
        "rss_bytes": fields.get("VmRSS", peak),
        "peak_rss_bytes": fields.get("VmHWM", peak),
    }


def start_queue_actor(
    maxsize: int,
    policy: FullPolicy | str,
    *,
    name: str | None = None,
    namespace: str | None = None,
    detached: bool = False,
    get_if_exists: bool = False,
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
    actor_options: dict[str, Any] | None = None,
    hand_over_timeout_s: float = DEFAULT_HAND_OVER_TIMEOUT_S,
) -> ray.actor.ActorHandle:
    """Start the actor (non-blocking) and return its handle.

    `name` registers it so other processes can `connect(name)`; `detached=True` (needs a name)
    lets it outlive the driver that created it. It reserves no CPU (`num_cpus=0`): it is
    I/O-bound. `actor_options` are passed to `.options()` last, so they override all this.
    `hand_over_timeout_s`: how long a pulled put waits for its producer (see `_handover`).
    """
    if maxsize < 1:
        raise ValueError(f"maxsize must be >= 1, got {maxsize}")
    policy = FullPolicy(policy)  # fail here, not inside the actor's constructor
    if not hand_over_timeout_s > 0:
        raise ValueError(f"hand_over_timeout_s must be > 0, got {hand_over_timeout_s}")
    if detached and name is None:
        raise ValueError("a detached queue actor needs a name (how else would you find it?)")
    options: dict[str, Any] = {"max_concurrency": max_concurrency, "num_cpus": 0}
    if name is not None:
        options.update(name=name, get_if_exists=get_if_exists)
        if namespace is not None:
            options["namespace"] = namespace
    if detached:
        options["lifetime"] = "detached"
    options.update(actor_options or {})
    logger.debug("starting queue actor maxsize=%d policy=%s options=%s", maxsize, policy, options)
    return _remote_class().options(**options).remote(maxsize, policy.value, hand_over_timeout_s)
