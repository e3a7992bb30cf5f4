"""No generated token is lost across a checkpoint and a `--resume` (issue 14, item 2), through
the real rollout actors, the real queue actor and the trainer's real read side.

Real: local Ray, `RolloutActor` (its `Rollouter`, `PromptSource`, task and reward, the queue
sink), the `async_queue` actor, `QueueBatchSource` (what hands groups to `PPOTrainer`: a group
it returns is what reaches training), `train_app.inflight` (the checkpoint files, the resume
load, the redistribution) and `plan()` (which deals the groups and makes every replica skip
their prompts). Fakes, and why: the engines are `rollout_engine.testing.FakeEngine` (random
tokens at 10 ms each, no model: what is tested is bookkeeping, not generation, and a vLLM
engine per replica would cost a minute each here), and the trainer is this test's loop
(take a batch, check its staleness, push a new version to every replica: `PPOTrainer` adds
only the torch step; `test_inflight_run.py` runs it for real). The checkpoint is taken the way
the trainer's `on_checkpoint` hook takes it (`snapshot_replicas` into a checkpoint
directory); the "crash" is killing every actor right after it.

The second test does the same for the groups the queue held at the checkpoint
(`snapshot_queue`, then `load_queued` and `put_back` as `run` does): they reach the batch
source first and exactly as queued; a too-stale one is dropped, counted and generated again.

Cost: one local Ray cluster, then three rollout actors (imports of transformers and the
task; no torch step, no vLLM) over two phases: 160 s measured with the 2 cores shared by a
load of 12 (Ray's start alone took 39 s of it). The second test (slow) adds two rollout
actors: 72-118 s alone, the file 168 s at a load of 7-8 (2026-12-04).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import msgspec
import pytest
import ray
from async_queue import MessageQueueClient
from ppo_trainer import Trajectory
from rollout_engine import RolloutSnapshot
from rollout_engine import Trajectory as RolloutTrajectory
from rollout_engine.testing import FakeEngineConfig
from train_app.actors import RolloutActor
from train_app.config import TrainConfig
from train_app.inflight import (
    QueuedSnapshot,
    load_inflight,
    load_queued,
    put_back,
    queued_path,
    read_queued,
    snapshot_queue,
    snapshot_replicas,
    write_queued,
)
from train_app.plan import ResumePoint, RunPlan, plan
from train_app.tiny_model import build_tiny_qwen2
from train_app.wiring import QueueBatchSource

K = 1
BATCH = 4
MAX_TOKENS = 48
STEPS_BEFORE = 3


def _plan(
    run_dir: Path, model_dir: Path, replicas: int, resume: ResumePoint, length: int = 40
) -> RunPlan:
    config = TrainConfig(
        runs_dir=run_dir, rollout_replicas=replicas, batch_size=BATCH, group_size=2,
        max_staleness=K, max_tokens=MAX_TOKENS, pause_mode="abort",
    )  # fmt: skip
    run_plan = plan(config, model_dir=model_dir, run_dir=run_dir, eos_token_id=1, resume=resume)
    fake = tuple(
        dataclasses.replace(
            r,
            engine=FakeEngineConfig(
                seed=r.replica + 10 * replicas,
                vocab_size=20,
                eos_token_id=1,
                fixed_length=length,  # 40: ~0.4 s a response, a checkpoint finds partials
                time_per_token_s=0.01,
                initial_version=r.engine.initial_version,
            ),
            log_dir=None,
            failures_path=None,
        )
        for r in run_plan.replicas
    )
    return dataclasses.replace(run_plan, replicas=fake)


class _Phase:
    """A queue, the replicas of `run_plan` on it, and the trainer's read side."""

    def __init__(self, run_plan: RunPlan, version: int) -> None:
        self.queue = MessageQueueClient.create(
            maxsize=run_plan.queue_maxsize, actor_options={"num_cpus": 0}
        )
        self.actors = [
            RolloutActor.options(num_cpus=0).remote(r, self.queue) for r in run_plan.replicas
        ]
        self.source = QueueBatchSource(self.queue, K)
        self.version = version
        self.trained: list[list[Trajectory]] = []

    async def start(self) -> None:
        """As the driver does: every engine up, then every rollout loop at once."""
        await asyncio.gather(*(_await(a.start.remote(begin=False)) for a in self.actors))
        await asyncio.gather(*(_await(a.begin.remote()) for a in self.actors))

    async def step(self) -> None:
        """One trainer step: a batch at the current version (staleness checked as
        `PPOTrainer` does), then a weight push to every replica."""
        batch = await asyncio.wait_for(self.source.next_batch(BATCH, self.version), 60)
        for group in batch:
            for trajectory in group:
                assert self.version - min(trajectory.token_versions) <= K, trajectory
        self.trained.extend(batch)
        self.version += 1
        await asyncio.gather(
            *(_await(a.update_weights.remote({}, self.version)) for a in self.actors)
        )

    async def metrics(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(_await(a.metrics.remote()) for a in self.actors)))

    async def kill(self) -> None:
        await asyncio.gather(*(_await(a.stop.remote()) for a in self.actors))
        for actor in [*self.actors, self.queue.handle]:
            ray.kill(actor)


async def _await(ref: Any) -> Any:
    return await ref


def _prompt_ids(groups: list[list[Trajectory]]) -> list[str]:
    return [group[0].prompt_id for group in groups]


def _assert_continued(snapshot: RolloutSnapshot, trained: dict[str, list[Trajectory]]) -> int:
    """Each response of each saved group reached training starting with exactly its saved
    tokens, log-probs and versions; returns the tokens checked."""
    checked = 0
    for saved in snapshot.groups:
        group = trained.get(saved.sample.prompt_id)
        if group is None:  # dropped at delivery as too stale: counted (see the caller)
            continue
        assert group[0].group_id == saved.group_id
        if not saved.responses:  # nothing generated yet: it started from the prompt
            continue
        for response, trajectory in zip(saved.responses, group, strict=True):
            n = len(response.token_ids)
            assert trajectory.response_ids[:n] == response.token_ids
            assert trajectory.behaviour_logprobs[:n] == response.logprobs
            assert trajectory.token_versions[:n] == response.versions  # original versions
            checked += n
    return checked


# Real actors, model and checkpoint: 110 s measured on 2 shared cores at load ~22 (plus
# ~85 s for the module's Ray start).
@pytest.mark.slow
async def test_tokens_in_flight_at_a_checkpoint_reach_training_after_a_resume(
    ray_cluster: None, tmp_path: Path
) -> None:
    model_dir = await asyncio.to_thread(build_tiny_qwen2, tmp_path / "model", seed=0)
    checkpoint = tmp_path / "checkpoints" / f"step_{STEPS_BEFORE:06d}"

    # The first life: one replica, three trainer steps, a checkpoint, then a crash.
    first = _Phase(_plan(tmp_path, model_dir, 1, ResumePoint()), version=0)
    await first.start()
    for _ in range(STEPS_BEFORE):
        await first.step()
    # The checkpoint comes a moment into generation at the new version (in a real run, the
    # next step's torch work): the groups admitted after the push have tokens by then.
    await asyncio.sleep(0.15)
    saved = await snapshot_replicas(first.actors, checkpoint)
    await first.kill()
    resume_version = first.version
    assert saved.missing == () and saved.tokens > 0, saved
    consumed = frozenset(_prompt_ids(first.trained))

    # The resume: what `run` does (load, leave out what was trained on), into two replicas.
    loaded = await asyncio.to_thread(
        load_inflight, checkpoint, consumed_prompt_ids=consumed, group_size=2
    )
    (snapshot,) = loaded
    partial = [g for g in snapshot.groups if any(r.finish_reason == "abort" for r in g.responses)]
    assert partial, "the checkpoint must hold unfinished responses"
    # One group is made too stale to be continued (as if generated k + 1 versions earlier):
    # its tokens must be dropped and counted, its prompt generated afresh.
    stale = partial[0]
    aged = [
        msgspec.structs.replace(r, versions=[resume_version - K - 1] * len(r.versions))
        for r in stale.responses
    ]
    stale_saved = msgspec.structs.replace(stale, responses=aged)
    others = [g for g in snapshot.groups if g is not stale]
    # Normally none: admission keeps in-flight groups deliverable (a straggler may not be).
    too_old = [g for g in others if (g.min_version or resume_version) < resume_version - K]
    kept = msgspec.structs.replace(snapshot, groups=[g for g in others if g not in too_old])
    resumed_snapshot = msgspec.structs.replace(snapshot, groups=[*others, stale_saved])
    resume = ResumePoint(str(checkpoint), STEPS_BEFORE, resume_version, consumed,
                         (resumed_snapshot,))  # fmt: skip
    second_plan = _plan(tmp_path, model_dir, 2, resume)
    dealt = [r.restore for r in second_plan.replicas]
    assert all(s is not None and s.groups for s in dealt)  # both replicas continue some

    second = _Phase(second_plan, version=resume_version)
    await second.start()
    restored = {g.sample.prompt_id for g in resumed_snapshot.groups}
    while not restored <= set(_prompt_ids(second.trained)) and second.version < resume_version + 4:
        await second.step()
    metrics = await second.metrics()
    stale_drops = (await second.queue.stats()).dropped.get("stale", 0)
    await second.kill()

    trained = {group[0].prompt_id: group for group in second.trained}
    # A group saved with tokens exactly k versions old must be in the first batch after the
    # resume; a new group finishing first can take its place (as for any straggler): it is
    # then dropped at delivery and counted by the queue. Every other one reaches training.
    lost = [g for g in kept.groups if g.sample.prompt_id not in trained]
    assert all(g.min_version == resume_version - K for g in lost), lost
    assert len(lost) <= stale_drops
    continued = [g for g in kept.groups if g not in lost]
    tokens = sum(g.generated_tokens for g in continued)
    assert _assert_continued(kept, trained) == tokens > 0
    # The too-stale group: trained once, on tokens generated after the resume only.
    fresh = trained[stale.sample.prompt_id]
    assert all(min(t.token_versions) >= resume_version for t in fresh)
    assert sum(m["rollout/resume_dropped_stale"] for m in metrics) == 1 + len(too_old)
    dropped_tokens = stale.generated_tokens + sum(g.generated_tokens for g in too_old)
    assert sum(m["rollout/resume_dropped_tokens"] for m in metrics) == dropped_tokens
    assert sum(m["rollout/resume_restored"] for m in metrics) == len(resumed_snapshot.groups)
    # No prompt trained twice over both lives (the staleness bound was checked at each step).
    every = _prompt_ids(first.trained) + _prompt_ids(second.trained)
    assert len(every) == len(set(every))


def _aged(item: Any, version: int) -> Any:
    """`item` as if every token of its group had been generated at `version`."""
    group = msgspec.msgpack.decode(item.payload, type=list[RolloutTrajectory])
    group = [
        msgspec.structs.replace(t, token_versions=[version] * len(t.token_versions)) for t in group
    ]
    return msgspec.structs.replace(item, payload=msgspec.msgpack.encode(group), version=version)


@pytest.mark.slow
async def test_groups_queued_at_a_checkpoint_reach_training_after_a_resume_as_they_were(
    ray_cluster: None, tmp_path: Path
) -> None:
    """The groups the trainer had not taken yet are copied at the checkpoint (after the
    replicas' snapshots, as the trainer's hook does) and a resume puts them back first: each
    reaches the trainer's batch source with exactly its saved tokens, log-probs and versions.
    One made too stale is dropped, counted and its prompt generated afresh; the replica counts
    the put-back groups in its admission budget, so nothing new is dropped as too stale.

    Fails without the budget count (`Rollouter.count_requeued`): 7 groups dropped as too
    stale. Cost: see the module doc."""
    model_dir = await asyncio.to_thread(build_tiny_qwen2, tmp_path / "model", seed=0)
    checkpoint = tmp_path / "checkpoints" / f"step_{STEPS_BEFORE:06d}"

    # The first life: short responses (40 ms), so the rollouter fills the queue up to its
    # staleness budget while the trainer is at its checkpoint.
    first = _Phase(_plan(tmp_path, model_dir, 1, ResumePoint(), length=4), version=0)
    await first.start()
    for _ in range(STEPS_BEFORE):
        await first.step()
    # Admission allows (k + 1) batches beyond those consumed: wait until they are all queued.
    async with asyncio.timeout(60):
        while await first.queue.size() < (K + 1) * BATCH:
            await asyncio.sleep(0.05)
    await snapshot_replicas(first.actors, checkpoint)
    saved = await snapshot_queue(first.queue, checkpoint, first.version)
    await first.kill()
    resume_version = first.version
    assert saved is not None and saved.groups == (K + 1) * BATCH, saved
    consumed = frozenset(_prompt_ids(first.trained))

    # One queued group is made too stale to be trained on (as if generated k + 1 versions
    # before the resumed version): it must be dropped, counted and its prompt generated again.
    file = read_queued(queued_path(checkpoint))
    stale = file.items[0]
    aged = _aged(stale, resume_version - K - 1)
    items = [aged, *file.items[1:]]
    write_queued(QueuedSnapshot(version=file.version, taken_at=file.taken_at, items=items),
                 queued_path(checkpoint))  # fmt: skip

    # The resume, as `run` does it: load both files, put the queued groups back, then start.
    queued = load_queued(
        checkpoint, version=resume_version, max_staleness=K, consumed_prompt_ids=consumed,
        group_size=2,
    )  # fmt: skip
    assert (len(queued.items), queued.dropped_stale) == (len(items) - 1, 1)
    assert queued.dropped_tokens == sum(t.num_generated for t in _group_of(aged))
    inflight = load_inflight(checkpoint, consumed_prompt_ids=consumed | queued.prompt_ids,
                             group_size=2)  # fmt: skip
    resume = ResumePoint(str(checkpoint), STEPS_BEFORE, resume_version, consumed, inflight,
                         queued)  # fmt: skip
    second_plan = _plan(tmp_path, model_dir, 1, resume, length=4)
    assert second_plan.replicas[0].requeued == len(queued.items)
    assert stale.item_id not in second_plan.replicas[0].consumed_prompt_ids
    second = _Phase(second_plan, version=resume_version)
    assert await put_back(second.queue, queued.items, second_plan.queue_maxsize) is None
    await second.start()
    # Four steps: the put-back groups fill the first two batches, so a replica that did not
    # count them would have admitted groups that the third and fourth find too stale.
    wanted = set(queued.prompt_ids) | {stale.item_id}
    while second.version < resume_version + 4 or (
        not wanted <= set(_prompt_ids(second.trained)) and second.version < resume_version + 8
    ):
        await second.step()
    stale_drops = (await second.queue.stats()).dropped.get("stale", 0)
    await second.kill()

    # The put-back groups were the first trained, each exactly as it was queued.
    first_trained = second.trained[: len(queued.items)]
    assert _prompt_ids(first_trained) == [i.item_id for i in queued.items]
    for item, group in zip(queued.items, first_trained, strict=True):
        for saved_t, trained_t in zip(_group_of(item), group, strict=True):
            assert trained_t.group_id == saved_t.group_id
            assert trained_t.response_ids == saved_t.response_ids
            assert trained_t.behaviour_logprobs == saved_t.behaviour_logprobs
            assert trained_t.token_versions == saved_t.token_versions  # original versions
    assert any(min(g[0].token_versions) < resume_version for g in first_trained)
    # The too-stale one: generated again after the resume, trained once.
    fresh = {g[0].prompt_id: g for g in second.trained}[stale.item_id]
    assert fresh[0].group_id != _group_of(stale)[0].group_id
    assert all(min(t.token_versions) >= resume_version for t in fresh)
    # The budget counted the put-back groups: no new group went past the staleness bound.
    assert stale_drops == 0
    every = _prompt_ids(first.trained) + _prompt_ids(second.trained)
    assert len(every) == len(set(every))


def _group_of(item: Any) -> list[RolloutTrajectory]:
    return msgspec.msgpack.decode(item.payload, type=list[RolloutTrajectory])
