"""What crosses the actor boundary, and its codecs.

A batch travels as a list of per-item msgpack blobs: the client encodes each `QueueItem`
with msgspec, Ray moves the list in one call, and the actor keeps each blob as it came. The
actor never decodes payloads; it reads only each item's `version` (skipping the payload bytes
without copying them) and hands the same blobs back from `get_batch`.

Why a list of blobs and not one blob per batch: measured here, Ray moves a multi-MiB batch as
several medium buffers faster than as one large `bytes`, the actor needs no copy to split or
join batches, and an item never keeps a whole batch's buffer alive.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import msgspec

from async_queue.types import QueueItem, QueueStats

__all__ = [
    "RawItem",
    "decode_items",
    "decode_stats",
    "encode_item",
    "encode_items",
    "encode_stats",
    "to_raw_items",
]


class RawItem(NamedTuple):
    """An item as the actor keeps it: its version and its encoded bytes."""

    version: int
    blob: bytes


class _VersionOnly(msgspec.Struct):
    """Reads `version` and skips every other field (payload bytes are skipped, not copied)."""

    version: int


_encode = msgspec.msgpack.Encoder().encode
_item_decoder = msgspec.msgpack.Decoder(QueueItem)
_stats_decoder = msgspec.msgpack.Decoder(QueueStats)
_version_decoder = msgspec.msgpack.Decoder(_VersionOnly)


def encode_item(item: QueueItem) -> bytes:
    return _encode(item)


def encode_items(items: Iterable[QueueItem]) -> list[bytes]:
    return [_encode(item) for item in items]


def decode_items(blobs: list[bytes]) -> list[QueueItem]:
    decode = _item_decoder.decode
    return [decode(blob) for blob in blobs]


def to_raw_items(blobs: list[bytes]) -> list[RawItem]:
    """Actor side: encoded items -> (version, blob) without decoding the payloads."""
    decode_version = _version_decoder.decode
    return [RawItem(decode_version(blob).version, blob) for blob in blobs]


def encode_stats(stats: QueueStats) -> bytes:
    return _encode(stats)


def decode_stats(blob: bytes) -> QueueStats:
    return _stats_decoder.decode(blob)
