"""`train_app.inflight` without Ray: the checkpoint files, what a resume keeps, how the saved
groups are dealt to a different number of replicas, and the plan that carries them.

The snapshots are built by hand (plain msgspec structs, as a rollouter writes them); the
actors that take and restore them are tested in `test_inflight_actors.py`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
from async_queue import QueueItem
from rollout_engine import (
    GroupSnapshot,
    PromptSample,
    ResponseSnapshot,
    RolloutSnapshot,
    Timings,
    load_snapshot,
    save_snapshot,
)
from rollout_engine import Trajectory as RolloutTrajectory
from train_app.config import TrainConfig
from train_app.inflight import (
    QueuedGroups,
    QueuedSnapshot,
    deal_count,
    inflight_path,
    load_inflight,
    load_queued,
    put_back,
    queued_path,
    read_queued,
    redistribute,
    restored_prompt_ids,
    snapshot_queue,
    snapshot_replicas,
    without_prompts,
    write_queued,
)
from train_app.plan import ResumePoint, plan


def _group(prompt_id: str, tokens: int, version: int = 3, size: int = 2) -> GroupSnapshot:
    responses = [
        ResponseSnapshot(
            token_ids=list(range(tokens)), logprobs=[-0.5] * tokens, versions=[version] * tokens
        )
        for _ in range(size if tokens else 0)
    ]
    sample = PromptSample(prompt_id=prompt_id, prompt_ids=[1, 2, 3])
    return GroupSnapshot(
        group_id=f"{prompt_id}:0",
        sample=sample,
        admitted_version=version,
        sampling_seed=7,
        responses=responses,
    )


def _snapshot(*groups: GroupSnapshot, version: int = 4, size: int = 2) -> RolloutSnapshot:
    return RolloutSnapshot(version=version, group_size=size, taken_at=1.0, groups=list(groups))


def _ids(snapshot: RolloutSnapshot | None) -> list[str]:
    return [] if snapshot is None else [g.sample.prompt_id for g in snapshot.groups]


def test_files_round_trip_in_replica_order_and_consumed_prompts_are_left_out(
    tmp_path: Path,
) -> None:
    save_snapshot(_snapshot(_group("b1", 5), _group("b2", 0)), inflight_path(tmp_path, 1))
    save_snapshot(_snapshot(_group("a1", 3), _group("a2", 4)), inflight_path(tmp_path, 0))
    (tmp_path / ".inflight-replica2.msgpack.x.tmp").write_bytes(b"half a write")  # ignored
    loaded = load_inflight(tmp_path, consumed_prompt_ids={"a2"}, group_size=2)
    assert [_ids(s) for s in loaded] == [["a1"], ["b1", "b2"]]
    assert loaded[0].groups[0] == _group("a1", 3)  # tokens, log-probs, versions, seed kept
    assert inflight_path(tmp_path, 0).name == "inflight-replica0.msgpack"


def test_a_prompt_in_two_files_is_continued_once(tmp_path: Path) -> None:
    save_snapshot(_snapshot(_group("p", 5)), inflight_path(tmp_path, 0))
    save_snapshot(_snapshot(_group("p", 2), _group("q", 1)), inflight_path(tmp_path, 1))
    loaded = load_inflight(tmp_path)
    assert [_ids(s) for s in loaded] == [["p"], ["q"]]
    assert loaded[0].groups[0].generated_tokens == 10


def test_snapshots_of_another_group_size_are_skipped(tmp_path: Path) -> None:
    save_snapshot(_snapshot(_group("a", 3, size=4), size=4), inflight_path(tmp_path, 0))
    save_snapshot(_snapshot(_group("b", 3)), inflight_path(tmp_path, 1))
    assert [_ids(s) for s in load_inflight(tmp_path, group_size=2)] == [["b"]]
    assert load_inflight(tmp_path / "missing") == ()


def test_same_replica_count_keeps_each_replicas_groups() -> None:
    saved = (_snapshot(_group("a", 3)), _snapshot(), _snapshot(_group("c", 1)))
    dealt = redistribute(saved, [2, 2, 2])
    assert [_ids(s) for s in dealt] == [["a"], [], ["c"]]
    assert dealt[1] is None


@pytest.mark.parametrize("shares", [[6], [3, 3], [2, 2, 2], [2, 1, 1, 1, 1]])
def test_other_replica_counts_get_every_group_once_in_proportion_to_their_shares(
    shares: list[int],
) -> None:
    saved = (
        _snapshot(_group("a1", 40, 5), _group("a2", 0), _group("a3", 10, 4), version=5),
        _snapshot(_group("b1", 30, 5), _group("b2", 20, 3), _group("b3", 0), version=5),
        _snapshot(_group("c1", 5, 4), version=4),
    )
    if len(shares) == 3:
        saved = (*saved, _snapshot())  # four files into three replicas
    dealt = redistribute(saved, shares)
    assert len(dealt) == len(shares)
    ids = [p for s in dealt for p in _ids(s)]
    assert sorted(ids) == ["a1", "a2", "a3", "b1", "b2", "b3", "c1"]
    assert restored_prompt_ids(dealt) == frozenset(ids)
    live = [s for s in dealt if s is not None]
    assert all(s.version == 5 and s.group_size == 2 for s in live)
    counts = [len(_ids(s)) for s in dealt]
    total = sum(shares)
    for count, share in zip(counts, shares, strict=True):  # within one group of its share
        assert abs(count - 7 * share / total) < 1 + 1e-9, (counts, shares)
    for s in live:  # each replica admits its oldest groups first
        versions = [g.min_version for g in s.groups]
        known = [v for v in versions if v is not None]
        assert known == sorted(known) and versions[: len(known)] == known


def test_a_replica_without_a_share_is_rejected() -> None:
    with pytest.raises(ValueError, match="share"):
        redistribute((_snapshot(_group("a", 1)),), [2, 0])


def test_nothing_saved_restores_nothing() -> None:
    assert redistribute((), [1, 1]) == (None, None)
    assert redistribute((_snapshot(),), [4]) == (None,)


def test_a_restarted_replica_continues_only_what_was_not_delivered() -> None:
    saved = _snapshot(_group("a", 3), _group("b", 2))
    assert _ids(without_prompts(saved, {"a"})) == ["b"]
    assert without_prompts(saved, {"a", "b"}) is None
    assert without_prompts(None, ()) is None


def test_plan_deals_the_saved_groups_and_every_replica_skips_their_prompts() -> None:
    saved = (_snapshot(_group("s1000-3", 5)), _snapshot(_group("s1001-4", 2)))
    resume = ResumePoint("ckpt", 4, 4, frozenset({"s1000-0"}), saved)
    run = plan(TrainConfig(rollout_replicas=3, batch_size=6), resume=resume)
    restored = [r.restore for r in run.replicas]
    assert sorted(p for s in restored for p in _ids(s)) == ["s1000-3", "s1001-4"]
    for replica in run.replicas:  # a prompt moved to another replica is not admitted anew
        assert replica.consumed_prompt_ids == {"s1000-0", "s1000-3", "s1001-4"}
    fresh = plan(TrainConfig(rollout_replicas=2, batch_size=6))
    assert all(r.restore is None and not r.consumed_prompt_ids for r in fresh.replicas)


class _Ref:
    def __init__(self, value: Any) -> None:
        self._value = value

    def __await__(self) -> Any:
        async def get() -> Any:
            if isinstance(self._value, BaseException):
                raise self._value
            return self._value

        return get().__await__()


class _Method:
    def __init__(self, value: Any) -> None:
        self._value = value

    def remote(self) -> _Ref:
        return _Ref(self._value)


class _Actor:
    """A stand-in for a `RolloutActor` handle (`snapshot_in_flight.remote()` -> awaitable);
    the real actors are in `test_inflight_actors.py`."""

    def __init__(self, answer: Any) -> None:
        self.snapshot_in_flight = _Method(answer)


def test_every_answering_replica_writes_its_file_and_the_others_are_listed(
    tmp_path: Path,
) -> None:
    actors = [
        _Actor(_snapshot(_group("a", 3))),
        None,  # a replica that is gone
        _Actor(RuntimeError("engine died")),
        _Actor(None),  # its loop had ended
        _Actor(_snapshot(_group("e", 2), _group("f", 0))),
    ]
    saved = asyncio.run(snapshot_replicas(actors, tmp_path))
    assert [p.name for p in saved.files] == [
        "inflight-replica0.msgpack",
        "inflight-replica4.msgpack",
    ]
    assert saved.missing == (1, 2, 3)
    assert (saved.groups, saved.tokens) == (3, 6 + 4)
    assert _ids(load_snapshot(saved.files[1])) == ["e", "f"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in saved.files]


def test_the_driver_resumes_with_the_latest_checkpoints_partials(tmp_path: Path) -> None:
    """`run`'s resume point (torch-free): the checkpoint `latest` names, its consumed prompts,
    and its in-flight groups less those prompts; `plan` then deals them."""
    from ppo_trainer import TrainerState, write_manifest
    from ppo_trainer.checkpoint_meta import STATE_FILE
    from train_app.driver import resume_point

    checkpoint = tmp_path / "checkpoints" / "step_000004"
    checkpoint.mkdir(parents=True)
    state = TrainerState(
        step=4, version=4, consumed_group_ids=("s1000-0:0",), consumed_prompt_ids=("s1000-0",)
    )
    (checkpoint / STATE_FILE).write_text(state.to_json())
    (tmp_path / "checkpoints" / "latest").symlink_to("step_000004", target_is_directory=True)
    save_snapshot(
        _snapshot(_group("s1000-0", 3), _group("s1000-5", 4)), inflight_path(checkpoint, 0)
    )
    save_snapshot(_snapshot(_group("s1001-2", 1)), inflight_path(checkpoint, 1))
    (tmp_path / "config.toml").write_text("")  # a run directory, as `--resume` checks
    config = TrainConfig(resume=tmp_path, rollout_replicas=1, batch_size=4, group_size=2)

    write_manifest(checkpoint)  # last, as the trainer writes it
    resume = resume_point(config, tmp_path)
    assert (resume.step, resume.version, resume.checkpoint) == (4, 4, str(checkpoint))
    assert [_ids(s) for s in resume.inflight] == [["s1000-5"], ["s1001-2"]]  # s1000-0 trained
    (replica,) = plan(config, resume=resume).replicas
    assert _ids(replica.restore) == ["s1000-5", "s1001-2"]
    assert replica.consumed_prompt_ids == {"s1000-0", "s1000-5", "s1001-2"}


# ---------------------------------------------------------------------- the queue's groups


def _queued(prompt_id: str, version: int, tokens: int = 3, size: int = 2) -> QueueItem:
    """A queue item as `QueueTrajectorySink` makes it: one encoded group, its oldest version."""
    group = [
        RolloutTrajectory(
            response_id=f"{prompt_id}:9:{i}",
            group_id=f"{prompt_id}:9",
            prompt_id=prompt_id,
            prompt_ids=[1, 2],
            response_ids=list(range(tokens)),
            behaviour_logprobs=[-0.25] * tokens,
            token_versions=[version] * tokens,
            finish_reason="stop",
            timings=Timings(admitted_at=1.0),
        )
        for i in range(size)
    ]
    return QueueItem(payload=msgspec.msgpack.encode(group), version=version, item_id=prompt_id)


class _Queue:
    """A stand-in for `MessageQueueClient` (`peek_all`, `put_many`); the real queue actor is
    in `test_inflight_actors.py` and packages/async-queue/tests/test_peek.py."""

    def __init__(self, items: Any = ()) -> None:
        self._items = items
        self.put: list[list[QueueItem]] = []
        self.room = asyncio.Event()

    async def peek_all(self) -> list[QueueItem]:
        if isinstance(self._items, BaseException):
            raise self._items
        return list(self._items)

    async def put_many(self, items: list[QueueItem]) -> None:
        if self.put:  # a second call waits for room, as a full queue's put does
            await self.room.wait()
        self.put.append(items)


def test_the_queue_copy_round_trips_and_a_failing_queue_leaves_no_file(tmp_path: Path) -> None:
    items = [_queued("b", 4), _queued("a", 3)]
    saved = asyncio.run(snapshot_queue(_Queue(items), tmp_path, version=5))
    assert saved is not None and saved.groups == 2 and saved.path == queued_path(tmp_path)
    assert saved.path.name == "queued.msgpack"
    again = read_queued(saved.path)
    assert (again.version, again.items) == (5, items)  # payloads and stamps as they were
    assert [p.name for p in tmp_path.iterdir()] == ["queued.msgpack"]  # no temporary left
    assert asyncio.run(snapshot_queue(_Queue(RuntimeError("gone")), tmp_path / "x", 5)) is None
    assert not (tmp_path / "x").exists()
    future = QueuedSnapshot(version=1, taken_at=0.0, schema_version=99)
    with pytest.raises(ValueError, match="schema 99"):
        QueuedSnapshot.decode(future.encode())


def test_a_resume_keeps_fresh_untrained_queued_groups_oldest_first(tmp_path: Path) -> None:
    """k = 1, resumed at version 5: version 3 is too stale (dropped, counted, its prompt not
    skipped); a trained prompt, a prompt's second group and another group size are left out."""
    write_queued(
        QueuedSnapshot(
            version=5,
            taken_at=1.0,
            items=[
                _queued("p1", 5),
                _queued("trained", 4),
                _queued("p2", 4),
                _queued("stale", 3, tokens=7),
                _queued("p1", 5),  # a second group of p1
                _queued("big", 4, size=3),
                _queued("p3", 4),
            ],
        ),
        queued_path(tmp_path),
    )
    kept = load_queued(
        tmp_path, version=5, max_staleness=1, consumed_prompt_ids={"trained"}, group_size=2
    )
    assert [i.item_id for i in kept.items] == ["p2", "p3", "p1"]  # oldest version first
    assert kept.prompt_ids == {"p1", "p2", "p3"}
    assert (kept.dropped_stale, kept.dropped_tokens, kept.saved) == (1, 2 * 7, True)
    assert kept.tokens == 3 * 2 * 3
    assert load_queued(tmp_path / "none", version=5, max_staleness=1) == QueuedGroups()


def test_put_back_puts_what_fits_before_returning_and_the_rest_when_room_comes() -> None:
    async def scenario() -> None:
        items = [_queued(f"p{i}", 4) for i in range(5)]
        queue = _Queue()
        tail = await put_back(queue, items, room=3)
        assert queue.put == [items[:3]] and tail is not None and not tail.done()
        queue.room.set()
        await tail
        assert queue.put == [items[:3], items[3:]]
        assert await put_back(_Queue(), items[:2], room=3) is None

    asyncio.run(scenario())


def test_plan_skips_the_put_back_prompts_and_deals_them_to_the_budgets() -> None:
    queued = QueuedGroups(
        items=tuple(_queued(f"s1000-{i}", 4) for i in range(7)),
        prompt_ids=frozenset(f"s1000-{i}" for i in range(7)),
        saved=True,
    )
    resume = ResumePoint("ckpt", 4, 4, frozenset({"s1001-0"}), (), queued)
    run = plan(TrainConfig(rollout_replicas=3, batch_size=8), resume=resume)
    assert [r.requeued for r in run.replicas] == [3, 2, 2]  # shares 3, 3, 2
    for replica in run.replicas:
        assert replica.consumed_prompt_ids == {"s1001-0"} | queued.prompt_ids
    assert deal_count(4, [1, 3]) == [1, 3] and deal_count(0, [2, 2]) == [0, 0]
    assert all(r.requeued == 0 for r in plan(TrainConfig(rollout_replicas=2)).replicas)


def test_the_driver_puts_back_the_queued_groups_and_continues_only_the_others(
    tmp_path: Path,
) -> None:
    """`run`'s resume point: a group in both files (delivered between its replica's snapshot
    and the queue's copy) is put back finished, not continued; a too-stale queued group is
    neither put back nor skipped."""
    from ppo_trainer import TrainerState, write_manifest
    from ppo_trainer.checkpoint_meta import STATE_FILE
    from train_app.driver import resume_point

    checkpoint = tmp_path / "checkpoints" / "step_000004"
    checkpoint.mkdir(parents=True)
    state = TrainerState(step=4, version=4, consumed_group_ids=("s1000-0:0",),
                         consumed_prompt_ids=("s1000-0",))  # fmt: skip
    (checkpoint / STATE_FILE).write_text(state.to_json())
    (tmp_path / "checkpoints" / "latest").symlink_to("step_000004", target_is_directory=True)
    save_snapshot(
        _snapshot(_group("s1000-5", 4), _group("s1000-6", 2)), inflight_path(checkpoint, 0)
    )
    items = [_queued("s1000-0", 4), _queued("s1000-5", 3), _queued("s1000-1", 1)]
    write_queued(QueuedSnapshot(version=4, taken_at=1.0, items=items), queued_path(checkpoint))
    (tmp_path / "config.toml").write_text("")  # a run directory, as `--resume` checks
    config = TrainConfig(resume=tmp_path, rollout_replicas=1, batch_size=4, group_size=2,
                         max_staleness=1)  # fmt: skip

    write_manifest(checkpoint)  # last, as the trainer writes it
    resume = resume_point(config, tmp_path)
    assert [i.item_id for i in resume.queued.items] == ["s1000-5"]
    assert resume.queued.dropped_stale == 1  # s1000-1: version 1 at version 4, k = 1
    assert [_ids(s) for s in resume.inflight] == [["s1000-6"]]
    (replica,) = plan(config, resume=resume).replicas
    assert replica.consumed_prompt_ids == {"s1000-0", "s1000-5", "s1000-6"}  # not s1000-1
    assert replica.requeued == 1
