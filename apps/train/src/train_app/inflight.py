"""In-flight partial trajectories in checkpoints (issue 14, item 2): save at a checkpoint,
continue at `--resume`.

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
driver's `run._start_together`), so no replica's new group reaches the queue ahead of another's
restored one. Only more restored groups than one batch can lose some: the second batch is a
version later, and a group exactly k old that finished after the first batch was taken is
then dropped at delivery like any straggler (counted in `queue/dropped`).

Not saved: groups the rollouters had already put on the queue that the trainer had not taken.
The queue is not part of a checkpoint; those prompts are not in the consumed set, so a
resumed run generates them again (their tokens are lost, the prompts are not).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from rollout_engine import GroupSnapshot, RolloutSnapshot, load_snapshot, save_snapshot

logger = logging.getLogger(__name__)

__all__ = [
    "INFLIGHT_GLOB",
    "SNAPSHOT_TIMEOUT_S",
    "SavedInflight",
    "inflight_path",
    "load_inflight",
    "redistribute",
    "restored_prompt_ids",
    "snapshot_replicas",
    "without_prompts",
]

INFLIGHT_GLOB = "inflight-replica*.msgpack"
_REPLICA = re.compile(r"inflight-replica(\d+)\.msgpack")
# One replica's snapshot: an abort-mode pause, the engine settling (at most the rollouter's
# own settle timeout, 5 s) and the copy back. Past this the checkpoint goes on without it.
SNAPSHOT_TIMEOUT_S = 30.0


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
        groups += len(answer.groups)
        tokens += answer.generated_tokens
    logger.info(
        "checkpoint %s: %d in-flight groups (%d tokens) from %d replicas",
        checkpoint.name,
        groups,
        tokens,
        len(files),
    )
    return SavedInflight(tuple(files), groups, tokens, tuple(sorted(missing)))


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
    a warning: its prompts are generated afresh. Blocking file I/O."""
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
            continue
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


async def _await(ref: Any) -> Any:
    return await ref
