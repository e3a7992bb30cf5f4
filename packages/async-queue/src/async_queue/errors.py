"""The queue's signals. End of stream and producer failure are different exceptions.

Every exception here survives pickling (Ray ships actor-side exceptions to the caller): the
constructor arguments are exactly `self.args`.
"""

from __future__ import annotations

__all__ = [
    "ProducerFailed",
    "QueueClosed",
    "QueueError",
    "QueueFull",
    "QueueTimeout",
    "SyncClientInEventLoopError",
]


class QueueError(Exception):
    """Base class of the queue's own signals."""


class QueueClosed(QueueError):
    """The queue was closed normally and nothing is left for this call.

    Raised by `get`/`get_batch` once a closed queue is drained, and by `put`/`put_many` on a
    closed queue. `async for` over a client ends on it instead of raising.

    `enqueued`: how many of the refused call's items were queued before the close. Only a
    `put_many` under policy `block` that was waiting for room piece by piece can have queued
    some (they stay queued and count as produced); every other refusal queued none.
    """

    def __init__(self, message: str = "queue is closed", enqueued: int = 0) -> None:
        super().__init__(message, enqueued)
        self.message = message
        self.enqueued = enqueued

    def __str__(self) -> str:
        if self.enqueued:
            return f"{self.message} ({self.enqueued} item(s) of this call were enqueued first)"
        return self.message


class ProducerFailed(QueueError):
    """A producer closed the queue with an error; carries the cause as text.

    The cause travels as its type name and message (not the exception object) so it survives
    any process boundary even when the consumer cannot import the producer's exception class.
    """

    def __init__(self, cause_type: str, cause_message: str) -> None:
        super().__init__(cause_type, cause_message)
        self.cause_type = cause_type
        self.cause_message = cause_message

    @classmethod
    def from_error(cls, error: BaseException | str) -> ProducerFailed:
        """Build from an exception (type name + str) or a plain message (type "str")."""
        if isinstance(error, ProducerFailed):
            return cls(error.cause_type, error.cause_message)
        if isinstance(error, BaseException):
            return cls(type(error).__name__, str(error))
        return cls("str", str(error))

    def __str__(self) -> str:
        return f"producer failed: {self.cause_type}: {self.cause_message}"


class QueueFull(QueueError):
    """The queue (policy `reject`) has no room for the whole put; nothing was enqueued."""


class QueueTimeout(QueueError, TimeoutError):
    """`get`/`get_batch` found too few items before `timeout`; nothing was taken.

    A subclass of `TimeoutError`, which is `asyncio.TimeoutError` on Python >= 3.11.
    """


class GetAbandoned(QueueError):
    """Internal: the caller of this get was cancelled and abandoned it; nothing was taken.

    Raised in the actor to a get whose client sent `abandon(ticket)`. No caller sees it: the
    client only reads it to learn that the abandoned call took nothing.
    """


class PutWithdrawn(QueueError):
    """Internal: the queue actor came to pull a put's payloads from its producer, but that
    put had already ended there (cancelled, or failed in the client); nothing is enqueued.

    Raised in the actor to the put call itself, whose caller no longer waits for it.
    """


class HandOverTimeout(QueueError):
    """Internal: the producer of a pulled put did not hand its payloads over in time (every
    call slot of that actor was busy); nothing of the put is enqueued.

    The client that sent the put reads it, turns pulled puts off in its process and sends
    the same items again by copying; no caller sees it.
    """


class PayloadUnavailable(QueueError):
    """A get's by-ref payload could not be fetched: Ray did not deliver it to this process
    and the queue actor no longer holds it (the get's hold was released or is older than
    `async_queue.actor.DELIVERY_HOLD_S`). The get's items are lost to this caller.
    """


class SyncClientInEventLoopError(RuntimeError):
    """`SyncMessageQueueClient` was called on a thread whose asyncio event loop is running.

    It would block that loop; use the async `MessageQueueClient` there instead.
    """
