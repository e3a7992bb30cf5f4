"""Wire types: the queued item, the statistics snapshot, the full-queue policy."""

from __future__ import annotations

import enum
import time

import msgspec

__all__ = [
    "DROP_REASON_OVERFLOW",
    "DROP_REASON_PRODUCER_FAILED",
    "DROP_REASON_STALE",
    "QUEUE_ITEM_SCHEMA_VERSION",
    "QUEUE_STATS_SCHEMA_VERSION",
    "FullPolicy",
    "QueueItem",
    "QueueStats",
]

QUEUE_ITEM_SCHEMA_VERSION = 1
QUEUE_STATS_SCHEMA_VERSION = 1

# Keys of QueueStats.dropped.
DROP_REASON_OVERFLOW = "overflow"  # policy drop_oldest evicted it to make room
DROP_REASON_STALE = "stale"  # get_batch found it older than current_version - max_staleness
DROP_REASON_PRODUCER_FAILED = "producer_failed"  # still queued when close(error=...) came


class FullPolicy(enum.StrEnum):
    """What `put` does when the queue holds `maxsize` items."""

    BLOCK = "block"  # the producer waits for room (default)
    DROP_OLDEST = "drop_oldest"  # evict the oldest queued item, counted as dropped "overflow"
    REJECT = "reject"  # raise QueueFull; the whole put is refused, nothing is enqueued


class QueueItem(msgspec.Struct, kw_only=True, frozen=True):
    """One queued message. `payload` is opaque bytes (e.g. one msgpack-encoded GRPO group).

    `version` is the policy version that produced the payload (the oldest one, for a group
    generated across weight pushes); `get_batch` uses it for staleness drops.
    `produced_at` is a `time.time()` stamp, set when the item is built, for put-to-get latency.
    """

    schema_version: int = QUEUE_ITEM_SCHEMA_VERSION
    payload: bytes
    version: int
    # The producer's id for this item (a group id, in the app). Its wire name stays
    # `sample_id`, as in schema 1, so items of older producers still decode.
    item_id: str = msgspec.field(name="sample_id")
    produced_at: float = msgspec.field(default_factory=time.time)
    metadata: dict[str, str] = msgspec.field(default_factory=dict)


class QueueStats(msgspec.Struct, kw_only=True, frozen=True):
    """A snapshot of the queue's counters.

    Invariant at every snapshot: `produced == consumed + dropped_total + size`. Items refused
    by policy `reject` never entered the queue: they are counted in `rejected` only.
    `oldest_version` / `newest_version` are the min / max `version` of the items queued now;
    they are None exactly when `size == 0`.
    `put_wait_s` / `get_wait_s` are the summed seconds producers waited for room and consumers
    waited for items (all callers together, so they can exceed wall time).
    `waiting_consumers` / `waiting_producers`: gets blocked for items and puts blocked for room
    right now. `requeued`: items that cancelled gets had taken and handed back (they count as
    queued again, not as consumed).
    """

    schema_version: int = QUEUE_STATS_SCHEMA_VERSION
    size: int
    maxsize: int
    policy: str
    produced: int
    consumed: int
    dropped: dict[str, int]
    dropped_total: int
    rejected: int
    put_wait_s: float
    get_wait_s: float
    oldest_version: int | None
    newest_version: int | None
    closed: bool
    failed: bool
    failure: str | None = None
    waiting_consumers: int = 0
    waiting_producers: int = 0
    requeued: int = 0

    def as_metrics(self) -> dict[str, float]:
        """The design's metric names: `queue/size|produced|consumed|dropped`,
        `queue/put_wait_s|get_wait_s` (`queue/dropped` is `dropped_total`), and
        `queue/waiting_consumers|waiting_producers`."""
        return {
            "queue/size": float(self.size),
            "queue/produced": float(self.produced),
            "queue/consumed": float(self.consumed),
            "queue/dropped": float(self.dropped_total),
            "queue/put_wait_s": self.put_wait_s,
            "queue/get_wait_s": self.get_wait_s,
            "queue/waiting_consumers": float(self.waiting_consumers),
            "queue/waiting_producers": float(self.waiting_producers),
        }
