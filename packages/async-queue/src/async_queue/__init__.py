"""Ray message-queue actor with an all-async client and explicit end-of-stream and failure
signals.

`MessageQueue` (the asyncio core), the wire types and the exceptions import without Ray; the
Ray pieces (`MessageQueueClient`, `SyncMessageQueueClient`, `QueueActor`) are imported on first
use, so `import async_queue` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from async_queue.core import MessageQueue
from async_queue.errors import (
    PayloadUnavailable,
    ProducerFailed,
    QueueClosed,
    QueueError,
    QueueFull,
    QueueTimeout,
    SyncClientInEventLoopError,
)
from async_queue.types import (
    DROP_REASON_OVERFLOW,
    DROP_REASON_PRODUCER_FAILED,
    DROP_REASON_STALE,
    QUEUE_ITEM_SCHEMA_VERSION,
    QUEUE_STATS_SCHEMA_VERSION,
    FullPolicy,
    QueueItem,
    QueueStats,
)

if TYPE_CHECKING:
    from async_queue.actor import QueueActor, start_queue_actor
    from async_queue.client import (
        DEFAULT_BY_REF_BYTES,
        MessageQueueClient,
        SyncMessageQueueClient,
    )

__all__ = [
    "DEFAULT_BY_REF_BYTES",
    "DROP_REASON_OVERFLOW",
    "DROP_REASON_PRODUCER_FAILED",
    "DROP_REASON_STALE",
    "QUEUE_ITEM_SCHEMA_VERSION",
    "QUEUE_STATS_SCHEMA_VERSION",
    "FullPolicy",
    "MessageQueue",
    "MessageQueueClient",
    "PayloadUnavailable",
    "ProducerFailed",
    "QueueActor",
    "QueueClosed",
    "QueueError",
    "QueueFull",
    "QueueItem",
    "QueueStats",
    "QueueTimeout",
    "SyncClientInEventLoopError",
    "SyncMessageQueueClient",
    "start_queue_actor",
]

# Ray-dependent names -> the module that defines them (imported on first attribute access).
_LAZY = {
    "DEFAULT_BY_REF_BYTES": "async_queue.client",
    "MessageQueueClient": "async_queue.client",
    "SyncMessageQueueClient": "async_queue.client",
    "QueueActor": "async_queue.actor",
    "start_queue_actor": "async_queue.actor",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'async_queue' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
