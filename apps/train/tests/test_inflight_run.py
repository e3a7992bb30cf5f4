"""A real `run()` checkpoints its in-flight partials and `--resume` continues them, into a
different replica count (issue 14, item 2).

Real: local Ray, every actor (rollout replicas, queue, trainer with `PPOTrainer` on the tiny
Qwen2), the trainer's checkpoint hook, the driver's resume path. Fake, and why: the engines are
`rollout_engine.testing.FakeEngine` (random tokens, 20 ms each; a vLLM engine per replica
would cost a minute each here, and the bookkeeping does not depend on the tokens). The
per-token check (saved tokens reach training with their versions and log-probs) is in
`test_inflight_actors.py`, where the trainer's read side is visible; here the trainer only
reports what it trained on through its checkpoint (prompt ids) and metrics.

Cost: one local Ray cluster, then two runs (2 replicas, 4 steps; resumed with 3 replicas to
step 8), each starting its actors (torch, transformers; no vLLM): 243-373 s measured with
the 2 cores shared by a load of 12-18. Slow. Before the replicas held their new prompts
across replicas, 2 of 5 continued groups (saved with tokens exactly k versions old) were
overtaken by another replica's new groups and dropped at delivery; the test now requires
every continued group to be trained on (see `train_app.inflight`).

The second test does the same for the groups the queue held at the checkpoint
(`queued.msgpack`): after `--resume` the very groups of the first life (their group ids) are
trained, and one made too stale is dropped, counted and its prompt trained anew. Two more
runs (1 replica, 3 steps, resumed to 6): 87 s alone, 226 s for the file, at a load of 3-7
(2026-12-04).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
from pathlib import Path

import msgspec
import pytest
from ppo_trainer import read_checkpoint_meta, write_manifest
from rich.console import Console
from rollout_engine import Trajectory as RolloutTrajectory
from rollout_engine import load_snapshot, save_snapshot
from rollout_engine.testing import FakeEngineConfig
from train_app.config import TrainConfig
from train_app.driver import run
from train_app.inflight import (
    load_inflight,
    load_queued,
    queued_path,
    read_queued,
    write_queued,
)
from train_app.plan import RunPlan
from train_app.testing import fake_engines

pytestmark = pytest.mark.slow

K = 1
BATCH = 6


def _fake_engines(run_plan: RunPlan) -> RunPlan:
    """Every replica on a FakeEngine: 30-token responses at 20 ms a token, so a checkpoint
    (after a trainer step) usually finds responses half done. (Not always: on a loaded
    machine every group in flight at the checkpoint may have finished and reached the queue
    before its copy; the test then checks the put-back path for them.)"""
    eos = run_plan.replicas[0].rollout.sampling.stop_token_ids[0]
    replicas = tuple(
        dataclasses.replace(
            r,
            engine=FakeEngineConfig(
                seed=r.replica + 10 * r.replicas,
                vocab_size=20,
                eos_token_id=eos,
                fixed_length=30,
                time_per_token_s=0.02,
                initial_version=r.engine.initial_version,
            ),
        )
        for r in run_plan.replicas
    )
    return dataclasses.replace(run_plan, replicas=replicas)


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_resume_continues_the_checkpoints_partials_in_another_replica_count(
    ray_cluster: None, tmp_path: Path
) -> None:
    config = TrainConfig(
        runs_dir=tmp_path, name="partials", steps=4, batch_size=BATCH, group_size=2,
        max_staleness=K, rollout_replicas=2, max_tokens=40, checkpoint_every=2,
        progress=False, lr_schedule="constant",
    )  # fmt: skip
    first = run(config, Console(file=io.StringIO()), adjust_plan=_fake_engines)
    run_dir = first.run_dir
    latest = run_dir / "checkpoints" / "latest"
    for step in (2, 4):  # every checkpoint holds every replica's partials
        names = {p.name for p in (run_dir / "checkpoints" / f"step_{step:06d}").iterdir()}
        assert {"inflight-replica0.msgpack", "inflight-replica1.msgpack"} <= names
    meta = read_checkpoint_meta(latest)
    # What the resume continues: the in-flight groups less those also queued (put back).
    queued = load_queued(latest, version=meta.version, max_staleness=K,
                         consumed_prompt_ids=meta.consumed_prompt_ids, group_size=2)  # fmt: skip
    skip = set(meta.consumed_prompt_ids) | queued.prompt_ids
    saved = load_inflight(latest, consumed_prompt_ids=skip, group_size=2)
    groups = [g for s in saved for g in s.groups]
    # The checkpoint holds generated tokens not yet trained on: continued partials, or (when
    # every group in flight finished and reached the queue before its copy) queued groups.
    tokens = sum(g.generated_tokens for g in groups) + len(queued.items)
    assert tokens > 0, (saved, queued)
    partial_ids = {g.sample.prompt_id for g in groups} | queued.prompt_ids

    resumed = dataclasses.replace(config, resume=run_dir, steps=8, rollout_replicas=3)
    run(resumed, Console(file=io.StringIO()), adjust_plan=_fake_engines)
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert all(r["staleness/max"] <= K for r in records)
    after = records[4:]
    # A replica with nothing to continue reports no resume figures: all may have none, when
    # every group in flight had reached the queue before its copy.
    assert after[-1].get("rollout/resume_restored", 0.0) == len(groups)
    assert after[-1].get("rollout/resume_dropped_stale", 0.0) == 0  # saved at the resumed version
    final = read_checkpoint_meta(latest)
    # No prompt trained twice across the resume, and the continued prompts were trained on.
    assert len(final.consumed_group_ids) == len(set(final.consumed_prompt_ids)) == 8 * BATCH
    # Every continued prompt was trained on: the replicas held their new prompts until every
    # restored group was delivered, so a group saved with tokens exactly k versions old is in
    # the resumed run's first batch. (More restored groups than a batch: the second batch is
    # a version later, and one that finished late may be dropped as too stale, counted.)
    missing = partial_ids - set(final.consumed_prompt_ids)
    if len(groups) + len(queued.items) <= BATCH:
        assert not missing, (missing, after[-1]["queue/dropped"])
    assert len(missing) <= after[-1]["queue/dropped"], (missing, after[-1]["queue/dropped"])
    assert len(list(latest.glob("inflight-replica*.msgpack"))) == 3  # the resumed run's


# 4-token responses at 10 ms a token: generation outruns the trainer, so at a checkpoint the
# queue holds every group admission allows.
_short_responses = functools.partial(fake_engines, time_per_token_s=0.01, fixed_length=4)


def test_resume_trains_the_groups_the_queue_held_at_the_checkpoint(
    ray_cluster: None, tmp_path: Path
) -> None:
    """A whole run: its checkpoint holds `queued.msgpack` (the trainer's hook); `--resume`
    puts those groups back and trains them (the very groups: their first-life group ids,
    not regenerated ones), drops and counts one made too stale and trains its prompt anew,
    and trains no prompt twice.

    Cost: two runs (1 replica, 3 steps; resumed to 6) on the shared cluster: ~2-5 min on a
    loaded machine. Fails without the queue's copy (no `queued.msgpack`)."""
    config = TrainConfig(
        runs_dir=tmp_path, name="queued", steps=3, batch_size=4, group_size=2,
        max_staleness=K, rollout_replicas=1, max_tokens=8, checkpoint_every=3,
        progress=False, lr_schedule="constant",
    )  # fmt: skip
    run_dir = run(config, Console(file=io.StringIO()), adjust_plan=_short_responses).run_dir
    latest = run_dir / "checkpoints" / "latest"
    meta = read_checkpoint_meta(latest)
    file = read_queued(queued_path(latest))
    assert file.version == meta.version == 3
    assert file.items, "the queue held no group at the checkpoint"
    # The oldest queued group, made k + 1 versions old: it must be dropped, its prompt
    # regenerated. A replica's snapshot may hold it too (delivered between the two copies);
    # that copy would be as old in a real run and dropped alike: leave it out here.
    index = 0
    stale = file.items[index]
    for path in latest.glob("inflight-replica*.msgpack"):
        snapshot = load_snapshot(path)
        kept = [g for g in snapshot.groups if g.sample.prompt_id != stale.item_id]
        save_snapshot(msgspec.structs.replace(snapshot, groups=kept), path)
    group = msgspec.msgpack.decode(stale.payload, type=list[RolloutTrajectory])
    aged_group = [
        msgspec.structs.replace(t, token_versions=[meta.version - K - 1] * len(t.token_versions))
        for t in group
    ]
    aged = msgspec.structs.replace(
        stale, payload=msgspec.msgpack.encode(aged_group), version=meta.version - K - 1
    )
    items = [*file.items[:index], aged, *file.items[index + 1 :]]
    write_queued(msgspec.structs.replace(file, items=items), queued_path(latest))
    # The edits as the trainer would have written them: a new manifest, with the run's labels.
    labels = json.loads((latest / "manifest.json").read_text())["labels"]
    write_manifest(latest, labels)
    put_back = load_queued(latest, version=meta.version, max_staleness=K,
                           consumed_prompt_ids=meta.consumed_prompt_ids, group_size=2)  # fmt: skip
    assert put_back.dropped_stale == 1 and len(put_back.items) == len(file.items) - 1
    saved_group_ids = {
        msgspec.msgpack.decode(i.payload, type=list[RolloutTrajectory])[0].group_id
        for i in put_back.items
    }

    resumed = dataclasses.replace(config, resume=run_dir, steps=6)
    run(resumed, Console(file=io.StringIO()), adjust_plan=_short_responses)
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, 7))
    assert all(r["staleness/max"] <= K for r in records)
    final = read_checkpoint_meta(latest)
    trained_groups = set(final.consumed_group_ids)
    assert saved_group_ids <= trained_groups  # trained as they were queued, not regenerated
    assert stale.item_id in final.consumed_prompt_ids  # generated again and trained
    assert group[0].group_id not in trained_groups
    assert len(final.consumed_group_ids) == len(set(final.consumed_prompt_ids)) == 6 * 4
    last = records[-1]
    assert last["queue/resume_requeued"] == len(put_back.items)
    assert last["queue/resume_dropped_stale"] == 1
    assert last["queue/resume_dropped_tokens"] == sum(t.num_generated for t in group)
    summary = json.loads((run_dir / "summary.json").read_text())["groups"]
    assert summary["queue"]["requeued"] == len(put_back.items)
    assert summary["balanced"] or not summary["settled"], summary
