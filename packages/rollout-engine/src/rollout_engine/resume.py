"""The resume side of a rollouter: what a checkpoint takes from it and gives back to it.

`RolloutResume` owns, for one `Rollouter`:

- the restored and held groups (`restore`, `hold_new_prompts`, `release_new_prompts`,
  `wait_restored_delivered`; the groups themselves wait in a `RestoreQueue`);
- the groups a resumed run put back on the queue for this replica (`count_requeued`);
- where the prompt stream is: the prompt being read, whether the stream is exhausted, and
  the prompts given back as too stale (`RolloutConfig.retry_stale`), admitted again first;
- the snapshot of every admitted, not yet delivered group (`snapshot_in_flight`), with the
  prompt stream's position read at the same moment (`rollout_engine.snapshot`).

The dispatch loop stays in `rollouter`: it asks this object for a returned prompt, tells it
which prompt is being read, and pops restored groups from `queue`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from rollout_engine.admission import StalenessBound
from rollout_engine.episode import EpisodeRunner
from rollout_engine.group import GroupJob, GroupRunner
from rollout_engine.in_flight import InFlightGroups
from rollout_engine.ledger import GroupLedger
from rollout_engine.restore_queue import RestoreQueue
from rollout_engine.runners import settle_engine
from rollout_engine.snapshot import GroupSnapshot, RolloutSnapshot
from rollout_engine.types import PromptSample
from rollout_engine.weight_gate import WeightGate

__all__ = ["RolloutResume"]

logger = logging.getLogger(__name__)

Pending = PromptSample | GroupSnapshot | None


class RolloutResume:
    """Restore, hold, requeued groups, prompt-stream position and snapshots of one rollouter.

    `runner` makes the rollouter's groups (its live responses go into a snapshot),
    `pending()` is the item the dispatch loop holds for admission, `started()` whether
    `run()` has begun, `on_weights` and `refresh_idle` the rollouter's own (a snapshot pauses
    and reopens admission as a weight push does)."""

    def __init__(
        self,
        prompts: object,
        *,
        group_size: int,
        sampling_seed: int | None,
        bound: StalenessBound,
        gate: WeightGate,
        ledger: GroupLedger,
        in_flight: InFlightGroups,
        runner: GroupRunner | EpisodeRunner,
        pending: Callable[[], Pending],
        started: Callable[[], bool],
        on_weights: Callable[[int], None],
        refresh_idle: Callable[[], None],
    ) -> None:
        self.queue = RestoreQueue(group_size)
        self._group_size = group_size
        self._seed = sampling_seed
        self._bound = bound
        self._gate = gate
        self._ledger = ledger
        self._in_flight = in_flight
        self._runner = runner
        self._pending = pending
        self._started = started
        self._on_weights = on_weights
        self._refresh_idle = refresh_idle
        # A stream that can say where it is (`checkpoint_state()`): snapshots record it.
        state = getattr(prompts, "checkpoint_state", None)
        self._prompt_state: Callable[[], dict[str, Any]] | None = state if callable(state) else None
        self._fetch: asyncio.Future[PromptSample | None] | None = None
        self._returned: deque[PromptSample] = deque()  # too stale, admitted again first
        self.exhausted = False  # the stream has no more prompts
        self.stale_retried = 0

    # ------------------------------------------------------------------ restore and hold

    def restore(self, snapshot: RolloutSnapshot) -> None:
        """Queue a snapshot's in-flight groups (`snapshot_in_flight`, possibly of another
        process) ahead of the prompt source; call before `run()`.

        Each group is admitted like a prompt (budget, concurrency) and its unfinished
        responses continue from their tokens so far (`rollout_engine.snapshot`). A group
        whose oldest token is more than `max_staleness` versions behind this rollouter's
        version could never be delivered: its partial responses are dropped (counted in
        `restore_dropped` and `restore_dropped_tokens`) and its prompt restarts from scratch,
        so the prompt itself is not lost."""
        if self._started():
            raise RuntimeError("restore() must be called before run()")
        self.queue.add(snapshot, self._gate.version, self._bound)

    def hold_new_prompts(self) -> None:
        """Admit no new prompt until `release_new_prompts()`; restored groups still go.

        For several rollouters resumed together: each holds its new prompts until every one
        has delivered its restored groups (`wait_restored_delivered`), so no replica's new
        group reaches the queue ahead of another's restored one, whose oldest tokens may be
        exactly `max_staleness` versions old and must be in the first batch."""
        self.queue.hold()

    def release_new_prompts(self) -> None:
        """End `hold_new_prompts()`; the dispatch loop admits new prompts at once."""
        self.queue.release()

    async def wait_restored_delivered(self) -> None:
        """Returns once no restored group (`restore`) is left to deliver: each was delivered,
        dropped or failed, or `run()` ended. At once when nothing was restored."""
        await self.queue.settled.wait()

    def count_requeued(self, count: int) -> None:
        """Count `count` groups as delivered by this rollouter, before `run()`: a resumed run
        put finished groups of its checkpoint back on the queue ahead of this rollouter's
        (the app's share of them for this replica), and they take admission slots like its
        own deliveries. Without this, admission would run that many groups past the
        staleness budget and they would be dropped as too stale downstream. They are not in
        `stats().delivered` (this rollouter did not deliver them) but are in `budget`, and a
        downstream drop of one frees its slot (`on_downstream_drop`)."""
        if self._started():
            raise RuntimeError("count_requeued() must be called before run()")
        self._ledger.count_requeued(count)

    def note_progress(self) -> None:
        """Settle `wait_restored_delivered` once no restored group waits, is pending for
        admission or runs; the dispatch loop calls it after each admission and reaping."""
        self.queue.note_progress(
            restored_pending=isinstance(self._pending(), GroupSnapshot),
            restored_running=self._in_flight.restored_running(),
        )

    # ------------------------------------------------------------------ prompt stream

    def give_back_stale(self, job: GroupJob) -> None:
        """`retry_stale`: a group dropped as too stale at delivery; its prompt comes again."""
        self._returned.append(job.sample)
        self.stale_retried += 1
        self._gate.admitting.set()  # the loop may be waiting with nothing pending

    def take_returned(self) -> PromptSample | None:
        """The oldest prompt given back as too stale, if any."""
        return self._returned.popleft() if self._returned else None

    def reading(self, fetch: asyncio.Future[PromptSample | None]) -> None:
        """The dispatch loop is reading the stream's next prompt with `fetch`."""
        self._fetch = fetch

    def read(self, sample: PromptSample | None, stopping: bool) -> None:
        """The read ended with `sample`, now the loop's pending item (snapshots look there);
        None when not stopping means the stream is exhausted."""
        self._fetch = None
        if sample is None and not stopping:
            self.exhausted = True

    # ------------------------------------------------------------------ snapshot

    async def snapshot_in_flight(self, settle_timeout_s: float = 5.0) -> RolloutSnapshot:
        """Every admitted, not yet delivered group with its responses so far
        (`rollout_engine.snapshot`); the run goes on afterwards.

        Like a weight push (and serialized with them): admission stops, the engine is
        paused with mode "abort" so running requests hand back their tokens so far, and once
        no engine call is outstanding (at most `settle_timeout_s`; a call still outstanding
        then was sent into the paused engine and holds no token) the state is copied, the
        engine resumed and admission reopened at the same version. The aborted responses
        continue as after an abort-mode push (counted in `resumed`)."""
        pause = self._gate.paused_engine("abort", False, self._on_weights, self._refresh_idle)
        async with pause:
            await settle_engine(self._runner, settle_timeout_s)
            await self._settle_fetch(settle_timeout_s)
            snapshot = self._build_snapshot()
        logger.info(
            "snapshot of %d in-flight groups (%d tokens) at version %d",
            len(snapshot.groups),
            snapshot.generated_tokens,
            snapshot.version,
        )
        return snapshot

    async def _settle_fetch(self, timeout_s: float) -> None:
        """Let a prompt being read from the stream arrive, so the stream's state and the
        groups are read with no prompt between the two."""
        fetch = self._fetch
        if self._prompt_state is not None and fetch is not None and not fetch.done():
            await asyncio.wait({fetch}, timeout=timeout_s)
            if not fetch.done():
                logger.warning("snapshot: a prompt still being read after %.1f s", timeout_s)

    def _unadmitted(self, pending: Pending) -> list[GroupSnapshot]:
        """Prompts taken from the stream and not admitted: the one waiting for admission, one
        read but not handed to the loop yet, and those given back as too stale."""
        samples: list[PromptSample] = []
        if isinstance(pending, PromptSample):
            samples.append(pending)
        fetch = self._fetch
        if fetch is not None and fetch.done() and not fetch.cancelled():
            sample = fetch.result() if fetch.exception() is None else None
            if sample is not None and sample is not pending:
                samples.append(sample)
        samples.extend(self._returned)
        version = self._gate.version
        return [
            GroupSnapshot(group_id=f"{s.prompt_id}:unadmitted", sample=s, admitted_version=version)
            for s in samples
        ]

    def _build_snapshot(self) -> RolloutSnapshot:
        """The state now; no await, so it is one consistent moment."""
        pending = self._pending()
        groups = self._in_flight.snapshot(self._runner.responses_of, self._seed)
        # Restored groups not admitted yet are still in flight from the checkpoint's view.
        waiting = [pending] if isinstance(pending, GroupSnapshot) else []
        groups.extend([*waiting, *self.queue.waiting()])
        prompt_state = None
        if self._prompt_state is not None:
            groups.extend(self._unadmitted(pending))
            prompt_state = self._prompt_state()
        return RolloutSnapshot(
            version=self._gate.version,
            group_size=self._group_size,
            taken_at=time.time(),
            groups=groups,
            prompt_state=prompt_state,
        )
