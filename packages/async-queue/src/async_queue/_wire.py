"""What crosses the actor boundary, and its codecs.

A batch travels as one list in one Ray call. Each element is one item, in one of three forms
chosen by payload size (measured on this machine's Ray, CPU per item summed over the caller,
the actor and the raylet):

- payload < `LARGE_PAYLOAD_BYTES`: the item's msgspec msgpack encoding (`bytes`). For small
  items this is cheaper than letting Ray pickle each struct (1 KiB: ~39 vs ~55 us per item
  for a put + get round trip of 64).
- `LARGE_PAYLOAD_BYTES` <= payload < the client's `by_ref_bytes` (default
  `DEFAULT_BY_REF_BYTES`): the `QueueItem` itself, which Ray pickles. This copies the payload
  fewer times than encoding it first (256 KiB: ~1.1 vs ~2.2 ms per item).
- payload >= `by_ref_bytes`: a `ByRef`: the version, the item without its payload (encoded),
  an `ObjectRef` and the payload's `index` in it. The by-ref payloads of one call travel
  together, as ONE object (a list of out-of-band pickle buffers: one copy into the object
  store; readers map it without copying): creating, sealing, re-owning and fetching an
  object costs far more than copying a few MiB into it, so one object per call instead of
  one per item (8 x 4 MiB: ~2-3x less put time here). That object is owned by the queue
  actor, and written in one of two ways:
  - pulled (a producing client inside a Ray actor that serves concurrent calls): the client
    sends a `Pulled` (version, header, index) per by-ref item and a `PullSource` (its actor
    handle, a token); the queue actor calls the producer back (`_handover.hand_over`), which
    returns the payloads as one object owned by the queue actor; the actor then queues a
    `ByRef` to it. One write of the payload bytes.
  - copied (any other client: the driver, a task, a `max_concurrency=1` actor): the client
    `ray.put`s the payloads; the actor re-owns that object through its helper
    (`actor.PayloadAdopter`), a second write.
  The ref is nested in the argument list or return value, so Ray never fetches the payload
  in the actor; the actor hands the same `ByRef` back from `get_batch`; the consuming client
  awaits each distinct ref once. An object is freed once every item of its call is
  delivered or dropped.

The actor never decodes payloads: it reads only each item's `version` (for an encoded item,
msgspec skips the payload bytes without copying them) and hands the same elements back from
`get_batch`; the client turns them into `QueueItem`s.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, NamedTuple

import msgspec
import ray
from ray.actor import ActorHandle

from async_queue.types import QueueItem, QueueStats

logger = logging.getLogger(__name__)

__all__ = [
    "BY_REF_OWNERS",
    "DEFAULT_BY_REF_BYTES",
    "FETCH_STALL_S",
    "LARGE_PAYLOAD_BYTES",
    "ByRef",
    "FromQueue",
    "FromQueueBlocking",
    "PullSource",
    "Pulled",
    "RawItem",
    "WireItem",
    "adopt_for_owner",
    "check_by_ref_bytes",
    "decode_stats",
    "distinct_refs",
    "encode_stats",
    "from_wire",
    "from_wire_blocking",
    "item_id",
    "needs_object_store",
    "resolve",
    "to_raw_items",
    "to_wire",
    "to_wire_pulled",
    "unseen_here",
]

LARGE_PAYLOAD_BYTES = 8 * 1024
# Payloads of at least this many bytes travel through Ray's object store by reference. 64 KiB:
# below it a by-value item is one cheap inline argument; above it every by-value copy
# (caller -> actor heap -> reply -> consumer) costs more than the ref's bookkeeping.
DEFAULT_BY_REF_BYTES = 64 * 1024


class ByRef(NamedTuple):
    """A by-reference item on the wire: what the actor needs plus where its payload is.

    `header` is the msgpack encoding of the item with an empty payload; `ref` holds the
    payloads of one put call as a list of pickle buffers, this item's at `index`. Nested in
    a list, the ref is not resolved by Ray when the list is a call argument or return value.
    """

    version: int
    header: bytes
    ref: ray.ObjectRef
    index: int
    # The queue actor must re-own (copy) the payload: a `ray.put` of a by_ref_owner "queue"
    # client. False when the producer owns it, or when the queue actor already does (pulled).
    adopt: bool = True


class Pulled(NamedTuple):
    """A by-reference item of a pulled put, on its way to the queue actor: its payload is
    still in the producing process, at `index` of the call's hand-over (see `_handover`).
    The actor turns it into a `ByRef` to the object it pulled before queueing it."""

    version: int
    header: bytes
    index: int


class PullSource(NamedTuple):
    """Where the queue actor pulls the `Pulled` payloads of one put call from: the producing
    actor and the token its payloads wait under (see `_handover`)."""

    producer: ActorHandle
    token: str


WireItem = bytes | QueueItem | ByRef | Pulled


class RawItem(NamedTuple):
    """An item as the actor keeps it: its version and its wire form."""

    version: int
    wire: WireItem


class _VersionOnly(msgspec.Struct):
    """Reads `version` and skips every other field (payload bytes are skipped, not copied)."""

    version: int


class _IdOnly(msgspec.Struct):
    """Reads `item_id` (wire name `sample_id`) and skips every other field."""

    item_id: str = msgspec.field(name="sample_id")


_encode = msgspec.msgpack.Encoder().encode
_decode_item = msgspec.msgpack.Decoder(QueueItem).decode
_decode_stats = msgspec.msgpack.Decoder(QueueStats).decode
_decode_version = msgspec.msgpack.Decoder(_VersionOnly).decode
_decode_id = msgspec.msgpack.Decoder(_IdOnly).decode


BY_REF_OWNERS = ("queue", "producer")


def adopt_for_owner(by_ref_owner: str) -> bool:
    """Validate a client's `by_ref_owner`; True when the queue actor must re-own payloads."""
    if by_ref_owner not in BY_REF_OWNERS:
        raise ValueError(f"by_ref_owner must be one of {BY_REF_OWNERS}, got {by_ref_owner!r}")
    return by_ref_owner == "queue"


def check_by_ref_bytes(by_ref_bytes: int | None) -> int | None:
    """Validate a client's threshold (None: never by reference)."""
    if by_ref_bytes is not None and by_ref_bytes < 1:
        raise ValueError(f"by_ref_bytes must be >= 1 or None, got {by_ref_bytes}")
    return by_ref_bytes


def needs_object_store(items: Iterable[QueueItem], by_ref_bytes: int | None) -> bool:
    """Whether `to_wire` would `ray.put` (a synchronous copy: async callers run it off-loop)."""
    return by_ref_bytes is not None and any(len(i.payload) >= by_ref_bytes for i in items)


def _split(
    items: Sequence[QueueItem], by_ref_bytes: int | None
) -> tuple[list[WireItem], list[int]]:
    """The by-value elements of `items` (by-ref ones still as the item) and the positions of
    the by-ref items."""
    by_ref = [
        k
        for k, item in enumerate(items)
        if by_ref_bytes is not None and len(item.payload) >= by_ref_bytes
    ]
    elements: list[WireItem] = [
        item if len(item.payload) >= LARGE_PAYLOAD_BYTES else _encode(item) for item in items
    ]
    return elements, by_ref


def _header(item: QueueItem) -> bytes:
    return _encode(msgspec.structs.replace(item, payload=b""))


def to_wire(
    items: Iterable[QueueItem], by_ref_bytes: int | None, adopt: bool = True
) -> list[WireItem]:
    """Client side, put: each item as bytes, as itself, or by reference (see the module doc).

    Blocking when an item goes by reference (`ray.put`, once for all of them); async callers
    run it in a thread."""
    items = list(items)
    elements, by_ref = _split(items, by_ref_bytes)
    if by_ref:
        # Out of band: written once into the object store, mapped (not copied) by readers.
        ref = ray.put([pickle.PickleBuffer(items[k].payload) for k in by_ref])
        for index, k in enumerate(by_ref):
            item = items[k]
            elements[k] = ByRef(item.version, _header(item), ref, index, adopt)
    return elements


def to_wire_pulled(
    items: Sequence[QueueItem], by_ref_bytes: int | None
) -> tuple[list[WireItem], list[bytes]]:
    """Client side, a pulled put (see `_handover`): the elements, with a `Pulled` for each
    by-ref item, and the by-ref payloads in `Pulled.index` order, for the hand-over.

    Non-blocking: nothing is copied here."""
    elements, by_ref = _split(items, by_ref_bytes)
    for index, k in enumerate(by_ref):
        item = items[k]
        elements[k] = Pulled(item.version, _header(item), index)
    return elements, [items[k].payload for k in by_ref]


def distinct_refs(elements: Sequence[WireItem]) -> dict[bytes, ray.ObjectRef]:
    """The distinct payload objects among `elements` (object id -> ref), in order."""
    refs: dict[bytes, ray.ObjectRef] = {}
    for e in elements:
        if isinstance(e, ByRef):
            refs.setdefault(e.ref.binary(), e.ref)
    return refs


def _build(elements: Sequence[WireItem], objects: dict[bytes, Any]) -> list[QueueItem]:
    items: list[QueueItem] = []
    for e in elements:
        if isinstance(e, QueueItem):
            items.append(e)
        elif isinstance(e, ByRef):
            # bytes(...) is the one copy out of the object store; the mapping is released
            # with the fetched buffers, and the object once every ref to it is gone.
            payload = bytes(objects[e.ref.binary()][e.index])
            items.append(msgspec.structs.replace(_decode_item(e.header), payload=payload))
        else:
            items.append(_decode_item(e))
    return items


def from_wire(elements: list[WireItem]) -> list[QueueItem]:
    """Client side, get, for elements without refs: back to `QueueItem`s."""
    return _build(elements, {})


# How long a get waits for a by-ref payload object that this process has not even learnt
# exists before it asks the queue actor for the value instead (see `resolve`).
FETCH_STALL_S = 5.0

# The queue actor's `held_payloads` for one delivery: object ids -> their values, in order.
FromQueue = Callable[[list[bytes]], Awaitable[list[Any]]]
FromQueueBlocking = Callable[[list[bytes]], list[Any]]


async def resolve(elements: list[WireItem], from_queue: FromQueue | None = None) -> list[QueueItem]:
    """Client side, get (async): back to `QueueItem`s, awaiting each distinct payload object
    once (all together).

    With `from_queue`, a payload object that this process has not learnt exists after
    `FETCH_STALL_S` is fetched through the queue actor instead: Ray's borrowing rarely
    leaves a consumer waiting forever for an object its owner (the queue actor) holds and
    can read (seen about once in 30 runs of the by-ref stress). An object this process knows
    about but is still transferring is left to finish.

    Without refs it returns without suspending (so a caller has no extra cancel point)."""
    refs = distinct_refs(elements)
    if not refs:
        return _build(elements, {})
    if from_queue is None:
        return _build(elements, dict(zip(refs, await asyncio.gather(*refs.values()), strict=True)))
    fetches = {oid: asyncio.wrap_future(ref.future()) for oid, ref in refs.items()}
    try:
        _, stalled = await asyncio.wait(fetches.values(), timeout=FETCH_STALL_S)
        objects: dict[bytes, Any] = {}
        if stalled:
            unseen = await asyncio.to_thread(
                unseen_here, [refs[oid] for oid, f in fetches.items() if not f.done()]
            )
            if unseen:
                _log_fallback(unseen)
                objects = dict(zip(unseen, await from_queue(unseen), strict=True))
        for oid, fetch in fetches.items():
            if oid not in objects:
                objects[oid] = await fetch
        return _build(elements, objects)
    finally:
        for fetch in fetches.values():
            fetch.cancel()  # no-op when done; else stop waiting for an object we got otherwise


def from_wire_blocking(
    elements: list[WireItem], from_queue: FromQueueBlocking | None = None
) -> list[QueueItem]:
    """Client side, get (sync client only): fetches by-ref payloads with one `ray.get`; with
    `from_queue`, as `resolve` does when an object stalls."""
    refs = distinct_refs(elements)
    if not refs:
        return _build(elements, {})
    if from_queue is None:
        return _build(elements, dict(zip(refs, ray.get(list(refs.values())), strict=True)))
    try:
        values = ray.get(list(refs.values()), timeout=FETCH_STALL_S)
        return _build(elements, dict(zip(refs, values, strict=True)))
    except ray.exceptions.GetTimeoutError:
        pass
    objects: dict[bytes, Any] = {}
    unseen = unseen_here(list(refs.values()))
    if unseen:
        _log_fallback(unseen)
        objects = dict(zip(unseen, from_queue(unseen), strict=True))
    rest = [oid for oid in refs if oid not in objects]
    objects.update(zip(rest, ray.get([refs[oid] for oid in rest]), strict=True))
    return _build(elements, objects)


def _log_fallback(unseen: list[bytes]) -> None:
    logger.info(
        "%d payload object(s) not seen here after %.0f s: fetched through the queue",
        len(unseen),
        FETCH_STALL_S,
    )


def unseen_here(refs: list[ray.ObjectRef]) -> list[bytes]:
    """The ids of `refs` whose object this process does not know to exist yet (blocking,
    but only asks: `fetch_local=False`, no wait)."""
    if not refs:
        return []
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
    seen = {ref.binary() for ref in ready}
    return [ref.binary() for ref in refs if ref.binary() not in seen]


def to_raw_items(elements: list[WireItem]) -> list[RawItem]:
    """Actor side: (version, wire form) per item, without decoding payloads."""
    return [
        RawItem(
            e.version if isinstance(e, QueueItem | ByRef | Pulled) else _decode_version(e).version,
            e,
        )
        for e in elements
    ]


def item_id(element: WireItem) -> str:
    """Actor side: an item's `item_id`, read from its header (the payload is not decoded)."""
    if isinstance(element, QueueItem):
        return element.item_id
    header = element.header if isinstance(element, ByRef | Pulled) else element
    return _decode_id(header).item_id


def encode_stats(stats: QueueStats) -> bytes:
    return _encode(stats)


def decode_stats(blob: bytes) -> QueueStats:
    return _decode_stats(blob)
