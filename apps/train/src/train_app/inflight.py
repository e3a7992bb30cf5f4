"""In-flight partial trajectories in checkpoints: save at a checkpoint, continue at
`--resume`.

Save: the trainer's `on_checkpoint` hook (`PPOTrainer`, called after each checkpoint
directory is written and before `latest` points at it) runs `snapshot_replicas`. Every rollout
replica takes `Rollouter.snapshot_in_flight()` (admitted groups not yet delivered, with each
response's tokens so far, their versions and behaviour log-probs, and the sampling seed; the
engines are paused in abort mode for a moment, as at a weight push) and the trainer writes it
next to its own files as `inflight-replica{i}.msgpack` (`rollout_engine.save_snapshot`:
temporary file, fsync, rename). The trainer writes them, so the checkpoint directory needs to
be visible to the trainer alone, as before. A replica that does not answer leaves no file: its
prompts are then generated afresh at a resume (nothing is lost but its tokens).

Resume: the driver reads every file of the checkpoint (`load_inflight`), leaves out groups of
prompts the checkpoint already trained on (a group handed to the queue at the very moment of
the snapshot) and repeats, and `redistribute` deals the rest to the resumed run's replicas
(their count may differ from the saved run's) in proportion to their batch shares. Each
replica `Rollouter.restore`s its share
before it generates: a restored group is admitted ahead of new prompts and its unfinished
responses continue from `prompt + tokens so far`, so the tokens generated before the
checkpoint reach training with their original versions and log-probs. Every replica's
`PromptSource` skips the restored prompt ids (`restored_prompt_ids`), as it skips the consumed
ones: no prompt is admitted twice. A group whose oldest token is more than k versions behind
the resumed version could never be trained on: the rollouter drops its tokens, counts it
(`rollout/resume_dropped_stale`, `rollout/resume_dropped_tokens`) and generates its prompt
from scratch. A group whose oldest token is exactly k versions old must be in the resumed
run's first batch: each `Rollouter` admits no new prompt until its restored groups are
delivered, and with several replicas every replica holds its new prompts
(`Rollouter.hold_new_prompts`) until all of them have delivered their restored groups (the
driver's `train_app.driver.startup`), so no replica's new group reaches the queue ahead of another's
restored one. Only more restored groups than one batch can lose some: the second batch is a
version later, and a group exactly k old that finished after the first batch was taken is
then dropped at delivery like any straggler (counted in `queue/dropped`).

Queued groups. Groups the rollouters had already put on the queue and the trainer had not
taken are saved too: after the replicas' snapshots, `snapshot_queue` copies the queue's items
(`MessageQueueClient.peek_all`: nothing is taken, nothing counted) into `queued.msgpack`
(`QueuedSnapshot`, written like the in-flight files). At `--resume` the driver reads it
(`load_queued`), leaves out groups of prompts the checkpoint trained on (and a second group
of a prompt), and puts the rest back on the new queue (`put_back`), oldest version first,
before any rollout loop begins: they are the first the trainer takes, with their original
tokens, versions and log-probs. Every replica's `PromptSource` skips their prompt ids, like
the restored in-flight ones, and each replica counts its share of them as its own deliveries
(`Rollouter.count_requeued`), so admission stays within the staleness budget. A queued group
more than k versions behind the resumed version (k: the resumed run's `max_staleness`) could
never be trained on: it is dropped, counted (`queue/resume_dropped_stale`,
`queue/resume_dropped_tokens`; `queue/resume_requeued` counts those put back) and its prompt
is not skipped, so it is generated again (by the replica whose stream holds it: the same
replica count as the saved run, as for any prompt not trained on). The put-back groups are
trained before the restored in-flight ones, as they were ahead of them in the saved run: a
restored group exactly k versions old behind more than a batch of them is dropped at
delivery (counted in `queue/dropped`), as it would have been without the interruption.

Why the queue is copied after the replicas, and what the copy can miss. The trainer is the
queue's only consumer and it is inside its checkpoint, so nothing leaves the queue while
the snapshots are taken; the rollouters go on delivering. A group delivered between its
replica's snapshot and the queue's copy is in both files: the queued copy (finished) wins and
the in-flight one is left out at the resume. A group admitted after its replica's snapshot
and delivered before the copy is in the queue file only. A group delivered after the copy is
in neither as a finished group: if its replica's snapshot held it, it is continued from the
tokens it had then (those generated after the snapshot are lost, as with any crash after a
checkpoint); otherwise its prompt was admitted after the snapshot and, not trained on, is
generated again. No prompt is lost or trained twice either way. (Copying the queue first
would open a hole: a group delivered between the copy and its replica's snapshot would be in
neither file, its tokens lost.) What the copy still misses: at a stop (Ctrl-C) the trainer
abandons a wait for data and the items that get had taken go back to the queue in the
background; one still on its way back is not copied (its prompt is generated again). A
queue that does not answer within `SNAPSHOT_TIMEOUT_S` leaves no file: a resume then
regenerates every queued prompt, as before this file existed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from async_queue import QueueItem
from rollout_engine import GroupSnapshot, RolloutSnapshot, load_snapshot, save_snapshot
from rollout_engine import Trajectory as RolloutTrajectory

logger = logging.getLogger(__name__)

__all__ = [
    "INFLIGHT_GLOB",
    "QUEUED_FILE",
    "QUEUED_SCHEMA_VERSION",
    "SNAPSHOT_TIMEOUT_S",
    "QueuedGroups",
    "QueuedSnapshot",
    "SavedInflight",
    "SavedQueue",
    "deal_count",
    "inflight_path",
    "load_inflight",
    "load_queued",
    "put_back",
    "queued_path",
    "read_queued",
    "redistribute",
    "restored_prompt_ids",
    "snapshot_queue",
    "snapshot_replicas",
    "without_prompts",
    "write_queued",
]

INFLIGHT_GLOB = "inflight-replica*.msgpack"
_REPLICA = re.compile(r"inflight-replica(\d+)\.msgpack")
# One replica's snapshot: an abort-mode pause, the engine settling (at most the rollouter's
# own settle timeout, 5 s) and the copy back. Past this the checkpoint goes on without it.
SNAPSHOT_TIMEOUT_S = 30.0


QUEUED_FILE = "queued.msgpack"
QUEUED_SCHEMA_VERSION = 1


def inflight_path(checkpoint: str | Path, replica: int) -> Path:
    """Where replica `replica`'s in-flight groups are saved in a checkpoint directory."""
    return Path(checkpoint) / f"inflight-replica{replica}.msgpack"


@dataclass(frozen=True)
class SavedInflight:
    """What `snapshot_replicas` wrote into one checkpoint."""

    files: tuple[Path, ...]
    groups: int
    tokens: int
    missing: tuple[int, ...]
    """Replicas that gave no snapshot (dead, not started, or too slow): their prompts are
    generated afresh at a resume."""
    positioned: dict[int, RolloutSnapshot] = field(default_factory=dict)
    """Each answering replica's snapshot that records its prompt stream's position
    (`RolloutSnapshot.prompt_state`): where a replacement of that replica starts."""


async def snapshot_replicas(
    actors: Sequence[Any | None],
    checkpoint: Path,
    timeout_s: float = SNAPSHOT_TIMEOUT_S,
) -> SavedInflight:
    """Ask every rollout actor (`RolloutActor.snapshot_in_flight`; None: a replica that is
    gone) for its in-flight groups, at once, and write each answer into `checkpoint`.

    Never raises for a replica's failure (a checkpoint without one replica's partials is
    still a correct checkpoint: those prompts restart); it is logged and listed in
    `missing`."""

    async def one(actor: Any) -> RolloutSnapshot | None:
        return await asyncio.wait_for(_await(actor.snapshot_in_flight.remote()), timeout_s)

    live = [(i, a) for i, a in enumerate(actors) if a is not None]
    answers = await asyncio.gather(*(one(a) for _, a in live), return_exceptions=True)
    files: list[Path] = []
    states: dict[int, RolloutSnapshot] = {}
    missing = [i for i, a in enumerate(actors) if a is None]
    groups = tokens = 0
    for (replica, _), answer in zip(live, answers, strict=True):
        if isinstance(answer, BaseException) or answer is None:
            if isinstance(answer, asyncio.CancelledError):
                raise answer
            logger.warning("replica %d: no in-flight snapshot (%r)", replica, answer)
            missing.append(replica)
            continue
        path = inflight_path(checkpoint, replica)
        files.append(await asyncio.to_thread(save_snapshot, answer, path))
        if answer.prompt_state is not None:
            states[replica] = answer
        groups += len(answer.groups)
        tokens += answer.generated_tokens
    logger.info(
        "checkpoint %s: %d in-flight groups (%d tokens) from %d replicas",
        checkpoint.name,
        groups,
        tokens,
        len(files),
    )
    return SavedInflight(tuple(files), groups, tokens, tuple(sorted(missing)), states)


def load_inflight(
    checkpoint: str | Path,
    *,
    consumed_prompt_ids: Iterable[str] = (),
    group_size: int | None = None,
) -> tuple[RolloutSnapshot, ...]:
    """Every replica's snapshot in `checkpoint`, in replica order, with the groups a resumed
    run must not continue left out: prompts already trained on (`consumed_prompt_ids`), and
    a prompt's second group (there is none unless a checkpoint was assembled by hand).

    A file of another `group_size` (the resumed run changed `--group-size`) is skipped with
    a warning: its prompts are generated afresh (with a stream position, the file is kept
    with its groups emptied of responses, so they restart from the prompt). Blocking file
    I/O."""
    root = Path(checkpoint)
    paths = sorted(
        (int(m.group(1)), p)
        for p in root.glob(INFLIGHT_GLOB)
        if (m := _REPLICA.fullmatch(p.name)) is not None
    )
    skip = set(consumed_prompt_ids)
    snapshots: list[RolloutSnapshot] = []
    for replica, path in paths:
        snapshot = load_snapshot(path)
        if group_size is not None and snapshot.group_size != group_size:
            logger.warning(
                "%s: groups of %d responses, this run makes %d: its %d groups restart",
                path,
                snapshot.group_size,
                group_size,
                len(snapshot.groups),
            )
            if snapshot.prompt_state is None:
                continue
            # Its stream continues after these prompts: they restart from the prompt here.
            snapshot = msgspec.structs.replace(
                snapshot,
                group_size=group_size,
                groups=[msgspec.structs.replace(g, responses=[]) for g in snapshot.groups],
            )
        kept: list[GroupSnapshot] = []
        for group in snapshot.groups:
            prompt_id = group.sample.prompt_id
            if prompt_id in skip:
                logger.info("replica %d: group %s already trained on", replica, group.group_id)
                continue
            skip.add(prompt_id)
            kept.append(group)
        snapshots.append(msgspec.structs.replace(snapshot, groups=kept))
    return tuple(snapshots)


def redistribute(
    snapshots: Sequence[RolloutSnapshot], shares: Sequence[int]
) -> tuple[RolloutSnapshot | None, ...]:
    """One snapshot (or None: nothing to restore) per replica of the resumed run, whose
    replica i admits `shares[i]` groups per version (`plan.split_batch`).

    With as many snapshots as replicas, replica i continues what replica i had in flight.
    Otherwise the groups are dealt oldest first (by their oldest token's version; groups
    with no token last) to the replica with the fewest per share, ties to the fewer
    generated tokens, then the lower index. In proportion to the shares, because a replica's
    admission budget is: what the saved run had in flight fits in the resumed run's first
    k + 1 versions, so every restored group is admitted at once and delivered while its
    tokens are fresh enough. Each replica's snapshot carries the newest `version` of those it
    draws from (informational: a restore checks staleness against the resumed version)."""
    replicas = len(shares)
    if replicas < 1 or min(shares) < 1:
        raise ValueError(f"every replica needs a share >= 1, got {list(shares)}")
    if not any(s.groups for s in snapshots):
        return (None,) * replicas
    if len(snapshots) == replicas:
        return tuple(s if s.groups else None for s in snapshots)
    group_size = snapshots[0].group_size
    if any(s.group_size != group_size for s in snapshots):
        raise ValueError("snapshots of different group sizes cannot be merged")
    version = max(s.version for s in snapshots)
    taken_at = max(s.taken_at for s in snapshots)
    groups = [g for s in snapshots for g in s.groups]
    groups.sort(key=lambda g: (g.min_version is None, g.min_version or 0))  # stable
    dealt: list[list[GroupSnapshot]] = [[] for _ in range(replicas)]
    tokens = [0] * replicas
    for group in groups:
        target = min(range(replicas), key=lambda i: (len(dealt[i]) / shares[i], tokens[i], i))
        dealt[target].append(group)
        tokens[target] += group.generated_tokens
    return tuple(
        RolloutSnapshot(version=version, group_size=group_size, taken_at=taken_at, groups=mine)
        if mine
        else None
        for mine in dealt
    )


def restored_prompt_ids(snapshots: Iterable[RolloutSnapshot | None]) -> frozenset[str]:
    """The prompt ids the snapshots continue: no replica's prompt stream admits them."""
    return frozenset(p for s in snapshots if s is not None for p in s.prompt_ids())


def without_prompts(
    snapshot: RolloutSnapshot | None, prompt_ids: Iterable[str]
) -> RolloutSnapshot | None:
    """`snapshot` less the groups of `prompt_ids` (None if nothing is left): what a replica
    started again in the same run (an elastic restart) still has to continue, given the
    prompts its predecessor already delivered."""
    if snapshot is None:
        return None
    done = set(prompt_ids)
    groups = [g for g in snapshot.groups if g.sample.prompt_id not in done]
    return msgspec.structs.replace(snapshot, groups=groups) if groups else None


# ---------------------------------------------------------------------- the queue's groups


class QueuedSnapshot(msgspec.Struct, kw_only=True, frozen=True):
    """The queue's items at a checkpoint (`queued.msgpack`): finished groups the trainer had
    not taken, in queue order, each as it was queued (payload: one msgpack-encoded group)."""

    schema_version: int = QUEUED_SCHEMA_VERSION
    version: int
    """The trainer's policy version at the checkpoint."""
    taken_at: float
    items: list[QueueItem] = []

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> QueuedSnapshot:
        snapshot = msgspec.msgpack.decode(data, type=cls)
        if snapshot.schema_version > QUEUED_SCHEMA_VERSION:
            raise ValueError(
                f"queued groups of schema {snapshot.schema_version}; this code reads up to "
                f"{QUEUED_SCHEMA_VERSION}"
            )
        return snapshot


@dataclass(frozen=True)
class SavedQueue:
    """What `snapshot_queue` wrote into one checkpoint."""

    path: Path
    groups: int


@dataclass(frozen=True)
class QueuedGroups:
    """What a resume puts back on the queue (`load_queued`); the default: nothing (a new run,
    or a checkpoint without `queued.msgpack`)."""

    items: tuple[QueueItem, ...] = ()
    """Oldest version first (queue order among equal versions)."""
    prompt_ids: frozenset[str] = frozenset()
    """The prompts of `items`: no replica admits them."""
    dropped_stale: int = 0
    """Groups more than k versions behind the resumed version: not put back; their prompts
    are generated again."""
    dropped_tokens: int = 0
    """Generated tokens of those groups."""
    dropped_prompt_ids: tuple[str, ...] = ()
    """The prompts of those groups: generated again (`PromptSource(redo=...)`)."""
    saved: bool = False
    """Whether the checkpoint had a queue file at all."""

    @property
    def tokens(self) -> int:
        return sum(_generated_tokens(_decode_group(item)) for item in self.items)


def queued_path(checkpoint: str | Path) -> Path:
    """Where the queue's groups are saved in a checkpoint directory."""
    return Path(checkpoint) / QUEUED_FILE


def write_queued(snapshot: QueuedSnapshot, path: str | Path) -> Path:
    """Write atomically (temporary file, fsync, `os.replace`), as `save_snapshot` writes
    the in-flight files; blocking file I/O."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(snapshot.encode())
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_queued(path: str | Path) -> QueuedSnapshot:
    """Read a file written by `write_queued`; blocking file I/O."""
    return QueuedSnapshot.decode(Path(path).read_bytes())


async def snapshot_queue(
    queue: Any, checkpoint: Path, version: int, timeout_s: float = SNAPSHOT_TIMEOUT_S
) -> SavedQueue | None:
    """Copy every item queued now (`peek_all`: they stay queued) into `checkpoint`'s
    `queued.msgpack`. Call it after `snapshot_replicas` and only while the caller is the
    queue's sole consumer and is not reading (the module doc says why).

    Never raises for the queue's failure (the checkpoint is still correct without the file:
    those prompts are generated again at a resume); it is logged and None returned."""
    try:
        items = await asyncio.wait_for(queue.peek_all(), timeout_s)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        logger.warning("checkpoint %s: no copy of the queue (%r)", checkpoint.name, exc)
        return None
    snapshot = QueuedSnapshot(version=version, taken_at=time.time(), items=items)
    path = await asyncio.to_thread(write_queued, snapshot, queued_path(checkpoint))
    logger.info("checkpoint %s: %d queued groups", checkpoint.name, len(items))
    return SavedQueue(path, len(items))


def load_queued(
    checkpoint: str | Path,
    *,
    version: int,
    max_staleness: int,
    consumed_prompt_ids: Iterable[str] = (),
    group_size: int | None = None,
) -> QueuedGroups:
    """The queue's groups saved in `checkpoint` that a run resumed at `version` puts back:
    without groups of prompts already trained on (`consumed_prompt_ids`), a prompt's second
    group, groups of another `group_size` (warned; their prompts are generated again) and
    groups too stale (`version - item.version > max_staleness`: the queue would drop them at
    the first read; counted, their prompts generated again). Oldest version first.
    Blocking file I/O."""
    path = queued_path(checkpoint)
    if not path.exists():
        return QueuedGroups()
    snapshot = read_queued(path)
    skip = set(consumed_prompt_ids)
    kept: list[QueueItem] = []
    kept_prompts: set[str] = set()
    dropped_ids: list[str] = []
    dropped_tokens = 0
    for item in snapshot.items:
        group = _decode_group(item)
        prompt_id = (group[0].prompt_id if group else "") or item.item_id
        if prompt_id in skip:
            logger.info("queued group of prompt %s: already trained on", prompt_id)
            continue
        if group_size is not None and len(group) != group_size:
            logger.warning(
                "%s: a group of %d responses, this run makes %d: prompt %s restarts",
                path,
                len(group),
                group_size,
                prompt_id,
            )
            continue
        if version - item.version > max_staleness:
            logger.info(
                "queued group of prompt %s: staleness %d > max_staleness %d; it restarts",
                prompt_id,
                version - item.version,
                max_staleness,
            )
            dropped_tokens += _generated_tokens(group)
            dropped_ids.append(prompt_id)
            continue
        skip.add(prompt_id)
        kept_prompts.add(prompt_id)
        kept.append(item)
    kept.sort(key=lambda item: item.version)  # stable: queue order among equal versions
    return QueuedGroups(
        items=tuple(kept),
        prompt_ids=frozenset(kept_prompts),
        dropped_stale=len(dropped_ids),
        dropped_tokens=dropped_tokens,
        dropped_prompt_ids=tuple(dropped_ids),
        saved=True,
    )


async def put_back(queue: Any, items: Sequence[QueueItem], room: int) -> asyncio.Task[None] | None:
    """Put a resume's queued groups on the new queue, in order: the first `room` (the queue's
    maxsize) before this returns, so they are ahead of anything a rollouter delivers; the
    rest (a resumed run with a smaller queue) in a task that waits for room as the trainer
    takes items (returned; None when everything fit)."""
    head, tail = list(items[:room]), list(items[room:])
    if head:
        await queue.put_many(head)
    if not tail:
        return None
    logger.warning("%d queued groups wait for room in the resumed run's queue", len(tail))
    task = asyncio.ensure_future(queue.put_many(tail))
    task.add_done_callback(_log_failed_put)
    return task


def _log_failed_put(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("queued groups not put back: %r", task.exception())


def deal_count(count: int, shares: Sequence[int]) -> list[int]:
    """`count` split over replicas in proportion to their `shares` (each next one to the
    replica with the fewest per share, ties to the lower index): how many put-back groups
    each replica counts as its own deliveries."""
    dealt = [0] * len(shares)
    for _ in range(count):
        target = min(range(len(shares)), key=lambda i: (dealt[i] / shares[i], i))
        dealt[target] += 1
    return dealt


_trajectories = msgspec.msgpack.Decoder(list[RolloutTrajectory])


def _decode_group(item: QueueItem) -> list[RolloutTrajectory]:
    return _trajectories.decode(item.payload)


def _generated_tokens(group: Sequence[RolloutTrajectory]) -> int:
    return sum(t.num_generated for t in group)


async def _await(ref: Any) -> Any:
    return await ref
