"""Where every group of a run went (summary.json's `groups`).

`balance_groups` is the pure part: given what the rollouters, the queue and the trainer
counted, it says whether the counts balance. Balanced: every group the rollouters admitted
was delivered, failed, dropped as too stale, filtered out (`--filter-groups`) or is still in
flight; the rollouters delivered what the queue received (plus the groups a resume put
back, `requeued`); the queue's items were consumed, dropped or are still queued; the
trainer trained on or dropped what it consumed. After a rollouter restart the replaced
replicas' deliveries are the queue's excess (`delivered_by_replaced_replicas`): their own
counters died with them.

`account_groups` gathers those counts once the rollouters are quiet: none in flight and
nothing admitted for a poll (admission stops them when the trainer stops consuming)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from train_app.driver.aio import await_ref

logger = logging.getLogger(__name__)

__all__ = ["ADMITTED_OUTCOMES", "ROLLOUT_COUNTS", "SETTLE_S", "account_groups", "balance_groups"]

# After training, how long the accounting waits for the rollouters' in-flight groups to land
# (admission stops them soon after the trainer stops consuming).
SETTLE_S = 15.0
# How often the accounting polls the rollouters' counts while they settle.
SETTLE_POLL_S = 0.5
# Seconds each actor has to answer a count request before the accounting gives up on it.
COUNTS_TIMEOUT_S = 5.0
# The counters every rollouter reports (`RolloutActor.stats`).
ROLLOUT_COUNTS = ("admitted", "delivered", "failed", "dropped", "filtered", "in_flight")
# Where an admitted group can be: their sum is `admitted` (`rollout_engine.RolloutStats`).
ADMITTED_OUTCOMES = ("delivered", "failed", "dropped", "filtered", "in_flight")


def balance_groups(
    rollout: Mapping[str, int],
    queue: Mapping[str, int],
    trainer: Mapping[str, int],
    *,
    restarts: int,
    settled: bool,
) -> dict[str, Any]:
    """summary.json's `groups` from the summed rollouter counts (`ROLLOUT_COUNTS`), the
    queue's (`requeued`, `produced`, `consumed`, `dropped`, `size`) and the trainer's
    (`trained`, `dropped`); `restarts`: rollouters replaced during the run."""
    rollout = dict(rollout)
    if restarts:
        rollout["delivered_by_replaced_replicas"] = (
            queue["produced"] - queue["requeued"] - rollout["delivered"]
        )
        rollout["replaced"] = restarts
    replaced = rollout.get("delivered_by_replaced_replicas", 0)
    balanced = (
        rollout["admitted"] == sum(rollout[k] for k in ADMITTED_OUTCOMES)
        and rollout["delivered"] + replaced + queue["requeued"] == queue["produced"]
        and replaced >= 0
        and queue["produced"] == queue["consumed"] + queue["dropped"] + queue["size"]
        and queue["consumed"] == trainer["trained"] + trainer["dropped"]
    )
    return {
        "settled": settled,
        "balanced": balanced,
        "rollout": rollout,
        "queue": dict(queue),
        "trainer": dict(trainer),
    }


async def account_groups(
    rollouts: list[Any],
    queue: Any,
    trainer_summary: Mapping[str, Any],
    *,
    requeued: Callable[[], int],
    restarts: int,
    settle_s: float = SETTLE_S,
) -> dict[str, Any]:
    """`balance_groups` of the live counts, once the rollouters settled (`settled` is False
    if that took over `settle_s`; a stopped run passes 0: the user asked to stop, not to
    wait). `requeued()`: a resume's groups the driver has put back so far. Bookkeeping
    only: an actor that does not answer gives an `error` entry, never a failed run."""
    settled = await _settled_rollout_counts(rollouts, settle_s)
    if isinstance(settled, str):
        return {"settled": False, "error": settled}
    rollout, is_settled = settled
    try:
        stats = await asyncio.wait_for(queue.stats(), COUNTS_TIMEOUT_S)
    except Exception as exc:
        return {"settled": False, "error": f"the queue did not report its counts: {exc!r}"}
    queue_counts = {
        "requeued": requeued(),
        "produced": stats.produced,
        "consumed": stats.consumed,
        "dropped": stats.dropped_total,
        "size": stats.size,
    }
    trainer = {
        "trained": int(trainer_summary.get("groups", 0)),
        "dropped": int(trainer_summary.get("dropped_groups", 0)),
    }
    groups = balance_groups(rollout, queue_counts, trainer, restarts=restarts, settled=is_settled)
    if is_settled and not groups["balanced"]:
        logger.warning("groups do not balance: %s", groups)
    return groups


async def _settled_rollout_counts(
    rollouts: list[Any], settle_s: float
) -> tuple[dict[str, int], bool] | str:
    """The rollouters' summed counts once two polls agree with none in flight (True), or
    the last ones at the deadline (False); an error text if one did not answer."""
    deadline = time.monotonic() + settle_s
    previous: dict[str, int] | None = None
    while True:
        replies = await asyncio.gather(
            *(asyncio.wait_for(await_ref(r.stats.remote()), COUNTS_TIMEOUT_S) for r in rollouts),
            return_exceptions=True,
        )
        if any(isinstance(r, BaseException) for r in replies):
            return "a rollouter did not report its counts"
        rollout = {k: sum(int(r[k]) for r in replies) for k in ROLLOUT_COUNTS}
        settled = rollout["in_flight"] == 0 and rollout == previous
        if settled or time.monotonic() > deadline:
            return rollout, settled
        previous = rollout
        await asyncio.sleep(SETTLE_POLL_S)
