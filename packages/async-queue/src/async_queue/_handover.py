"""The producer side of a pulled put: by-ref payloads wait in this process until the queue
actor takes them.

When the producing client runs in a Ray actor that can serve a call while its put awaits
(an async actor, or a threaded one with `max_concurrency` > 1), it does not `ray.put` its
by-ref payloads. It `hold`s them here under a token and sends the queue actor only the items'
headers plus (its own actor handle, the token). The queue actor then calls
`producer.__ray_call__.options(num_returns=2).remote(hand_over, token)`: `hand_over` runs in
this process, pops the payloads and returns (their count, the payloads). The queue actor is
that call's caller, so it owns the returned payload object (Ray: a call's return values are
owned by its caller), which this process writes once into its node's object store, where it
outlives this process. One write instead of the copying path's two (`ray.put` here, then
the re-owning copy of `actor.PayloadAdopter`).

The client removes its token when the put call ends, however it ends (`release`): a put that
failed or was cancelled before the hand-over leaves nothing here, and a hand-over that comes
after that finds no payloads and says so (count `GONE`), so the queue actor fails the put.

The hand-over needs a free call slot in this actor while the put waits. `try_hold` holds the
payloads only when, counting every pulled put already waiting here, one slot stays free (a
threaded actor with `max_concurrency=2` making two puts at once copies the second). Slots
taken by the actor's other methods cannot be seen from here: the queue actor gives up on a
hand-over after a timeout (the put fails with `HandOverTimeout`, nothing queued), and the
client then `disable`s pulling in this process and sends the put again by copying.
"""

from __future__ import annotations

import logging
import pickle
import threading
import uuid
from typing import Any

import ray
from ray.actor import ActorHandle

__all__ = [
    "GONE",
    "disable",
    "hand_over",
    "held_tokens",
    "hold",
    "producer_actor",
    "release",
    "try_hold",
]

logger = logging.getLogger(__name__)

# hand_over's count when the token is not held (the put already ended, or another process).
GONE = -1

# token -> payloads. hand_over runs on a Ray executor thread (an async actor runs
# __ray_call__ outside its event loop), so the table is guarded by a lock.
_held: dict[str, list[bytes]] = {}
_lock = threading.Lock()
# (actor id, handle or None, max_concurrency) of this process, looked up once: a worker
# process hosts one actor.
_this_actor: tuple[Any, ActorHandle | None, int] | None = None
# Why pulling was turned off in this process (None: it is on). Set once, with one warning.
_disabled: str | None = None


def _concurrency(worker: Any) -> tuple[Any, int]:
    """(actor id, max_concurrency) of this worker, read from Ray's private fields."""
    actor_id = worker.actor_id
    if actor_id.is_nil():
        return actor_id, 1
    return actor_id, int(worker.core_worker.current_actor_max_concurrency())


def producer_actor() -> ActorHandle | None:
    """This process's actor handle when it can take a pulled put, else None.

    It can when it is an actor (not the driver, not a task) that serves calls concurrently:
    an async actor or a threaded actor with `max_concurrency` > 1. (The hand-over is a second
    call into the actor made while the put call waits; a `max_concurrency=1` actor would
    never serve it.) None too once pulling was `disable`d here."""
    global _this_actor
    if _disabled is not None or not ray.is_initialized():
        return None
    # No public Ray API says whether this process serves concurrent calls: read the worker's
    # own fields, and take the copying path if they fail in any way (a Ray version without
    # them, or with other types).
    try:
        worker = ray._private.worker.global_worker
        actor_id = worker.actor_id
        if _this_actor is not None and _this_actor[0] == actor_id:
            return _this_actor[1]
        actor_id, max_concurrency = _concurrency(worker)
        handle = ray.get_runtime_context().current_actor if max_concurrency > 1 else None
    except Exception as exc:
        disable(f"Ray's worker fields could not be read ({type(exc).__name__}: {exc})")
        return None
    _this_actor = (actor_id, handle, max_concurrency)
    return handle


def disable(reason: str) -> None:
    """Turn pulled puts off in this process (every later put copies); warns once."""
    global _disabled
    if _disabled is None:
        _disabled = reason
        logger.warning(
            "async_queue: pulled puts are off in this process: %s; by-ref "
            "payloads take the copying path",
            reason,
        )


def try_hold(payloads: list[bytes]) -> str | None:
    """`hold` the payloads if this actor keeps a call slot free for the hand-over, counting
    the pulled puts already waiting here; else None (then the put copies)."""
    slots = 1 if _this_actor is None else _this_actor[2]
    token = uuid.uuid4().hex
    with _lock:
        if len(_held) + 1 >= slots:
            return None
        _held[token] = payloads
    return token


def hold(payloads: list[bytes]) -> str:
    """Keep `payloads` for the queue actor's hand-over; returns their token."""
    token = uuid.uuid4().hex
    with _lock:
        _held[token] = payloads
    return token


def release(token: str) -> None:
    """The put call of `token` ended: forget its payloads if no hand-over took them."""
    with _lock:
        _held.pop(token, None)


def held_tokens() -> int:
    """How many puts' payloads wait here (0 when no put is in flight: nothing leaks)."""
    with _lock:
        return len(_held)


def hand_over(_actor: Any, token: str) -> tuple[int, list[pickle.PickleBuffer]]:
    """Runs in the producer (`__ray_call__`, called by the queue actor): (count, payloads).

    The payloads go out of band, so Ray writes them once into the object store. The count
    is the small first return value the queue actor awaits instead of the payloads."""
    with _lock:
        payloads = _held.pop(token, None)
    if payloads is None:
        return GONE, []
    return len(payloads), [pickle.PickleBuffer(p) for p in payloads]
