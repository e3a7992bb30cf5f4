"""In-flight partials across a snapshot and a restore (rollout_engine.snapshot).

The engine is `rollout_engine.testing.FakeEngine`, a fake: these test the bookkeeping (no
token lost, versions kept, staleness bound), not generation. A "crash" is simulated by
stopping the first rollouter right after its snapshot and restoring the snapshot (through
msgpack bytes, as through a checkpoint file) into a new rollouter over a new engine.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from rollout_engine import (
    GroupSnapshot,
    PromptSample,
    ResponseSnapshot,
    RolloutConfig,
    Rollouter,
    RolloutSnapshot,
    SamplingConfig,
    Trajectory,
    load_snapshot,
    save_snapshot,
)
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink, make_prompts, wait_until

MAX_TOKENS = 64
K = 1
# Fixed lengths: groups finish in admission order, so no group is legitimately dropped as too
# stale at delivery (a straggler could be) and every drop would be a bug.
ENGINE = FakeEngineConfig(seed=5, time_per_token_s=0.002, fixed_length=30)


def _config(**overrides: object) -> RolloutConfig:
    base: dict[str, object] = {
        "group_size": 2,
        "max_concurrency": 4,
        "groups_per_step": 2,
        "max_staleness": K,
        "pacing": "eager",
        "pause_mode": "keep",
        "sampling": SamplingConfig(max_tokens=MAX_TOKENS, seed=7),
    }
    return RolloutConfig(**{**base, **overrides})  # type: ignore[arg-type]


def _reward(sample: PromptSample, trajectory: Trajectory) -> float:
    return 0.0


class _Consumer:
    """The trainer's side: a new version per `batch_size` delivered groups, and a check of
    the staleness bound at every delivery."""

    def __init__(self, batch_size: int) -> None:
        self.sink = ListSink(on_put=self._check)
        self.rollouter: Rollouter | None = None
        self.batch_size = batch_size
        self.worst = 0

    def _check(self, group: list[Trajectory]) -> None:
        assert self.rollouter is not None
        for trajectory in group:
            staleness = self.rollouter.version - trajectory.min_version
            self.worst = max(self.worst, staleness)
            assert staleness <= K, (trajectory.group_id, trajectory.token_versions)

    async def push_while(self, run: asyncio.Task, base_version: int) -> None:
        assert self.rollouter is not None
        version = base_version
        while not run.done():
            await asyncio.sleep(0.003)
            if len(self.sink.groups) >= (version - base_version + 1) * self.batch_size:
                version += 1
                await self.rollouter.update_weights({"w": version}, version)


async def _wait_for_partials(rollouter: Rollouter, engine: FakeEngine, version: int) -> None:
    """Until the rollouter is at `version` and its running requests have tokens."""
    await wait_until(lambda: rollouter.version >= version)
    tokens = engine.tokens_generated
    await wait_until(
        lambda: engine.tokens_generated >= tokens + 24 and len(engine.running_request_ids) >= 2
    )


def _partial_groups(snapshot: RolloutSnapshot) -> list[GroupSnapshot]:
    return [
        g
        for g in snapshot.groups
        if any(r.token_ids and r.finish_reason == "abort" for r in g.responses)
    ]


def _assert_prefixes_kept(snapshot: RolloutSnapshot, delivered: list[list[Trajectory]]) -> int:
    """Every response of every snapshot group was delivered starting with exactly the
    snapshot's tokens, log-probs and versions; returns the number of tokens checked."""
    by_group = {group[0].group_id: group for group in delivered}
    checked = 0
    for snap in snapshot.groups:
        group = by_group[snap.group_id]  # KeyError: a restored group was lost
        for response, trajectory in zip(snap.responses, group, strict=True):
            n = len(response.token_ids)
            assert trajectory.response_ids[:n] == response.token_ids
            assert trajectory.behaviour_logprobs[:n] == response.logprobs
            assert trajectory.token_versions[:n] == response.versions  # original versions
            if response.finish_reason != "abort":
                assert trajectory.response_ids == response.token_ids
            checked += n
    return checked


async def test_snapshot_mid_run_loses_nothing_and_the_run_goes_on() -> None:
    engine = FakeEngine(ENGINE)
    consumer = _Consumer(batch_size=2)
    rollouter = consumer.rollouter = Rollouter(
        engine, make_prompts(10), consumer.sink, _reward, _config()
    )
    run = asyncio.create_task(rollouter.run())
    pusher = asyncio.create_task(consumer.push_while(run, 0))
    await _wait_for_partials(rollouter, engine, version=1)
    snapshot = await rollouter.snapshot_in_flight()
    stats = await asyncio.wait_for(run, timeout=30)
    await pusher

    assert "abort" in engine.pause_modes  # tokens still in the engine were handed back
    assert _partial_groups(snapshot), "the snapshot must hold unfinished responses"
    assert snapshot.version >= 1 and snapshot.group_size == 2
    assert _assert_prefixes_kept(snapshot, consumer.sink.groups) > 0
    assert (stats.delivered, stats.failed, stats.dropped) == (10, 0, 0)
    assert stats.admitted == stats.delivered + stats.failed + stats.dropped + stats.in_flight


async def test_restore_after_a_crash_continues_every_partial_with_its_versions(
    tmp_path: Path,
) -> None:
    prompts = make_prompts(12)
    engine = FakeEngine(ENGINE)
    first = _Consumer(batch_size=2)
    rollouter = first.rollouter = Rollouter(engine, prompts, first.sink, _reward, _config())
    run = asyncio.create_task(rollouter.run())
    pusher = asyncio.create_task(first.push_while(run, 0))
    await _wait_for_partials(rollouter, engine, version=2)
    snapshot = await rollouter.snapshot_in_flight()
    in_snapshot = {g.group_id for g in snapshot.groups}
    delivered_before = [g for g in first.sink.groups if g[0].group_id not in in_snapshot]
    await rollouter.stop()  # the crash: whatever happens after the snapshot is lost
    await asyncio.wait_for(run, timeout=10)
    await pusher

    restored = load_snapshot(save_snapshot(snapshot, tmp_path / "rollout-0.msgpack"))
    assert restored == snapshot
    partial_tokens = sum(len(r.token_ids) for g in _partial_groups(restored) for r in g.responses)
    assert partial_tokens > 0

    done_ids = {g[0].prompt_id for g in delivered_before}
    skip = done_ids | restored.prompt_ids()
    fresh = [p for p in prompts if p.prompt_id not in skip]
    engine2 = FakeEngine(FakeEngineConfig(**{**_engine_kwargs(), "seed": 9,
                                              "initial_version": restored.version}))  # fmt: skip
    second = _Consumer(batch_size=2)
    rollouter2 = second.rollouter = Rollouter(engine2, fresh, second.sink, _reward, _config())
    rollouter2.restore(restored)
    run2 = asyncio.create_task(rollouter2.run())
    pusher2 = asyncio.create_task(second.push_while(run2, restored.version))
    stats = await asyncio.wait_for(run2, timeout=30)
    await pusher2

    assert (stats.failed, stats.dropped) == (0, 0), (stats, rollouter2.failures)
    assert _assert_prefixes_kept(restored, second.sink.groups) >= partial_tokens
    assert stats.restored == len(restored.groups) and stats.restore_dropped == 0
    assert (stats.failed, stats.dropped) == (0, 0)
    # Nothing lost, nothing twice: every prompt delivered exactly once over both lives.
    delivered = [g[0].prompt_id for g in [*delivered_before, *second.sink.groups]]
    assert sorted(delivered) == sorted(p.prompt_id for p in prompts)
    assert max(first.worst, second.worst) <= K


def _engine_kwargs() -> dict[str, object]:
    return {
        "seed": ENGINE.seed,
        "time_per_token_s": ENGINE.time_per_token_s,
        "fixed_length": ENGINE.fixed_length,
    }


def _response(tokens: int, version: int) -> ResponseSnapshot:
    return ResponseSnapshot(
        token_ids=[5] * tokens, logprobs=[-1.0] * tokens, versions=[version] * tokens
    )


async def test_partials_too_stale_at_restore_are_dropped_counted_and_their_prompt_restarts() -> (
    None
):
    """Trainer at version 5, k = 1: a partial begun at version 3 can never be delivered (its
    tokens are dropped and counted, the prompt restarts); one begun at 4 is continued."""
    prompts = make_prompts(2)
    snapshot = RolloutSnapshot(
        version=4,
        group_size=2,
        groups=[
            GroupSnapshot(
                group_id="p0:0",
                sample=prompts[0],
                admitted_version=3,
                responses=[_response(6, 3), _response(4, 3)],
            ),
            GroupSnapshot(
                group_id="p1:1",
                sample=prompts[1],
                admitted_version=4,
                responses=[_response(3, 4), _response(2, 4)],
            ),
        ],
    )
    engine = FakeEngine(FakeEngineConfig(seed=1, fixed_length=12, initial_version=5))
    sink = ListSink()
    rollouter = Rollouter(engine, [], sink, _reward, _config(max_staleness=1))
    rollouter.restore(RolloutSnapshot.decode(snapshot.encode()))
    stats = await asyncio.wait_for(rollouter.run(), timeout=10)

    assert (stats.restored, stats.restore_dropped, stats.restore_dropped_tokens) == (2, 1, 10)
    assert (stats.delivered, stats.failed, stats.dropped) == (2, 0, 0)
    by_group = {g[0].group_id: g for g in sink.groups}
    restarted, continued = by_group["p0:0"], by_group["p1:1"]
    assert all(min(t.token_versions) == 5 for t in restarted)  # fresh tokens only
    assert continued[0].token_versions[:3] == [4, 4, 4]
    assert continued[1].token_versions[:2] == [4, 4]
    assert all(5 - t.min_version <= 1 for group in sink.groups for t in group)


async def test_snapshot_includes_restored_groups_not_admitted_yet() -> None:
    """A snapshot taken before every restored group was admitted still holds them all."""
    prompts = make_prompts(3)
    snapshot = RolloutSnapshot(
        version=0,
        group_size=2,
        groups=[
            GroupSnapshot(
                group_id=f"p{i}:{i}",
                sample=prompts[i],
                admitted_version=0,
                responses=[_response(2, 0), _response(2, 0)],
            )
            for i in range(3)
        ],
    )
    rollouter = Rollouter(FakeEngine(ENGINE), [], ListSink(), _reward, _config())
    rollouter.restore(snapshot)
    again = await rollouter.snapshot_in_flight()  # before run(): nothing admitted yet
    assert again.groups == snapshot.groups


async def test_restore_checks_group_size_schema_and_timing() -> None:
    prompts = make_prompts(1)
    wrong = RolloutSnapshot(
        version=0,
        group_size=2,
        groups=[
            GroupSnapshot(
                group_id="p0:0", sample=prompts[0], admitted_version=0, responses=[_response(1, 0)]
            )
        ],
    )
    rollouter = Rollouter(FakeEngine(ENGINE), [], ListSink(), _reward, _config())
    with pytest.raises(ValueError, match="expected 2"):
        rollouter.restore(wrong)
    with pytest.raises(ValueError, match="groups of 3"):
        rollouter.restore(RolloutSnapshot(version=0, group_size=3))
    await rollouter.run()
    with pytest.raises(RuntimeError, match="before run"):
        rollouter.restore(RolloutSnapshot(version=0, group_size=2))
    future = RolloutSnapshot(version=0, group_size=2, schema_version=99)
    with pytest.raises(ValueError, match="schema 99"):
        RolloutSnapshot.decode(future.encode())


async def test_restored_groups_finish_before_any_new_prompt_is_admitted() -> None:
    """A restored group may carry tokens k versions old: were new prompts admitted beside it,
    their groups could fill the trainer's next batch first and the restored one would be
    dropped as too stale with every token it carries. So nothing new is admitted until the
    restored groups are delivered (checked at the moment each restored group is delivered:
    the rollouter has admitted only restored groups so far)."""
    restored_prompts = make_prompts(2, prefix="r")
    snapshot = RolloutSnapshot(
        version=0,
        group_size=2,
        groups=[
            GroupSnapshot(
                group_id=f"r{i}:{i}",
                sample=restored_prompts[i],
                admitted_version=0,
                responses=[_response(2, 0), _response(1, 0)],
            )
            for i in range(2)
        ],
    )
    admitted_at_delivery: dict[str, int] = {}
    rollouter: Rollouter | None = None

    def record(group: list[Trajectory]) -> None:
        assert rollouter is not None
        admitted_at_delivery[group[0].group_id] = rollouter.stats().admitted

    sink = ListSink(on_put=record)
    # Two new prompts: with the two restored groups, all the (k + 1) batches version 0 allows.
    rollouter = Rollouter(FakeEngine(ENGINE), make_prompts(2), sink, _reward, _config())
    rollouter.restore(snapshot)
    stats = await asyncio.wait_for(rollouter.run(), timeout=10)

    assert stats.delivered == 4
    assert admitted_at_delivery["r0:0"] == 2 and admitted_at_delivery["r1:1"] == 2
    assert [g[0].group_id for g in sink.groups][:2] == ["r0:0", "r1:1"]


async def test_held_rollouters_admit_nothing_new_until_every_restored_group_is_delivered() -> None:
    """Across rollouters (the app's replicas after a resume): B has no restored group and a
    fast engine, A has restored groups that take a while to finish. Both hold their new
    prompts until both have delivered their restored groups, so the first groups on the
    shared sink are A's restored ones; without the hold B's new groups would arrive first and
    could fill the first batch."""
    restored_prompts = make_prompts(2, prefix="r")
    snapshot = RolloutSnapshot(
        version=0,
        group_size=2,
        groups=[
            GroupSnapshot(
                group_id=f"r{i}:{i}",
                sample=restored_prompts[i],
                admitted_version=0,
                responses=[_response(2, 0), _response(1, 0)],
            )
            for i in range(2)
        ],
    )
    sink = ListSink()
    slow = FakeEngineConfig(seed=5, time_per_token_s=0.01, fixed_length=30)
    fast = FakeEngineConfig(seed=6, time_per_token_s=0.0005, fixed_length=3)
    with_restored = Rollouter(FakeEngine(slow), make_prompts(0), sink, _reward, _config())
    without = Rollouter(FakeEngine(fast), make_prompts(2, prefix="n"), sink, _reward, _config())
    with_restored.restore(snapshot)
    for rollouter in (with_restored, without):
        rollouter.hold_new_prompts()

    async def release_when_restored_are_delivered() -> None:
        await asyncio.gather(
            with_restored.wait_restored_delivered(), without.wait_restored_delivered()
        )
        for rollouter in (with_restored, without):
            rollouter.release_new_prompts()

    release = asyncio.create_task(release_when_restored_are_delivered())
    runs = asyncio.gather(with_restored.run(), without.run())
    stats_a, stats_b = await asyncio.wait_for(runs, timeout=20)
    await release

    assert stats_a.delivered == 2 and stats_b.delivered == 2
    assert sorted(g[0].group_id for g in sink.groups[:2]) == ["r0:0", "r1:1"]
    assert all(g[0].prompt_id.startswith("n") for g in sink.groups[2:])


async def test_wait_restored_delivered_returns_when_the_run_stops() -> None:
    """A waiter on restored groups is never left hanging: `stop()` ends the wait."""
    snapshot = RolloutSnapshot(
        version=0,
        group_size=2,
        groups=[
            GroupSnapshot(
                group_id="r0:0",
                sample=make_prompts(1, prefix="r")[0],
                admitted_version=0,
                responses=[_response(2, 0), _response(1, 0)],
            )
        ],
    )
    slow = FakeEngineConfig(seed=5, time_per_token_s=0.05, fixed_length=60)
    rollouter = Rollouter(FakeEngine(slow), make_prompts(0), ListSink(), _reward, _config())
    rollouter.restore(snapshot)
    waiter = asyncio.create_task(rollouter.wait_restored_delivered())
    run = asyncio.create_task(rollouter.run())
    await asyncio.sleep(0.2)
    assert not waiter.done()
    await rollouter.stop()
    await asyncio.wait_for(waiter, timeout=5)
    await asyncio.wait_for(run, timeout=5)


async def test_requeued_groups_take_admission_slots_like_own_deliveries() -> None:
    """A resumed run puts its checkpoint's queued groups back on the queue ahead of the
    rollouter's: they count as its deliveries. With k = 1 and 2 groups a version, version 0
    admits 4 groups; 3 are already queued, so one new group goes until the next version,
    then two more; a downstream drop of a requeued group frees its slot."""
    sink = ListSink()
    rollouter = Rollouter(FakeEngine(ENGINE), make_prompts(6), sink, _reward, _config())
    with pytest.raises(ValueError, match=">= 0"):
        rollouter.count_requeued(-1)
    rollouter.count_requeued(3)
    run = asyncio.create_task(rollouter.run())
    await wait_until(lambda: len(sink.groups) == 1 and rollouter.state == "draining")
    assert (rollouter.stats().admitted, rollouter.stats().budget) == (1, 0)
    await rollouter.update_weights({"w": 1}, 1)
    await wait_until(lambda: len(sink.groups) == 3 and rollouter.state == "draining")
    assert rollouter.stats().admitted == 3
    rollouter.on_downstream_drop(1)  # a requeued group was dropped as too stale downstream
    await wait_until(lambda: len(sink.groups) == 4 and rollouter.state == "draining")
    assert (rollouter.stats().admitted, rollouter.stats().delivered) == (4, 4)
    with pytest.raises(RuntimeError, match="before run"):
        rollouter.count_requeued(1)
    await rollouter.stop()
    await run
