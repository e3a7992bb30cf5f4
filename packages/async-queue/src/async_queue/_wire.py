"""msgpack codecs for what crosses the actor boundary.

The client sends and receives one bytes blob per call (a whole batch at once): one msgspec
encode/decode per batch instead of pickling every item keeps the per-item cost low.
"""

from __future__ import annotations

import msgspec

from async_queue.types import QueueItem, QueueStats

__all__ = [
    "decode_item",
    "decode_items",
    "decode_stats",
    "encode",
]

_encoder = msgspec.msgpack.Encoder()
_item_decoder = msgspec.msgpack.Decoder(QueueItem)
_items_decoder = msgspec.msgpack.Decoder(list[QueueItem])
_stats_decoder = msgspec.msgpack.Decoder(QueueStats)

encode = _encoder.encode


def decode_item(blob: bytes) -> QueueItem:
    return _item_decoder.decode(blob)


def decode_items(blob: bytes) -> list[QueueItem]:
    return _items_decoder.decode(blob)


def decode_stats(blob: bytes) -> QueueStats:
    return _stats_decoder.decode(blob)
