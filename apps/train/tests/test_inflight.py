"""`train_app.inflight` without Ray: the checkpoint files, what a resume keeps, how the saved
groups are dealt to a different number of replicas, and the plan that carries them.

The snapshots are built by hand (plain msgspec structs, as a rollouter writes them); the
actors that take and restore them are tested in `test_inflight_actors.py`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from rollout_engine import (
    GroupSnapshot,
    PromptSample,
    ResponseSnapshot,
    RolloutSnapshot,
    load_snapshot,
    save_snapshot,
)
from train_app.config import TrainConfig
from train_app.inflight import (
    inflight_path,
    load_inflight,
    redistribute,
    restored_prompt_ids,
    snapshot_replicas,
    without_prompts,
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
    from ppo_trainer import TrainerState
    from ppo_trainer.checkpoint_meta import STATE_FILE
    from train_app.run import _resume_point

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
    config = TrainConfig(resume=tmp_path, rollout_replicas=1, batch_size=4, group_size=2)

    resume = _resume_point(config, tmp_path)
    assert (resume.step, resume.version, resume.checkpoint) == (4, 4, str(checkpoint))
    assert [_ids(s) for s in resume.inflight] == [["s1000-5"], ["s1001-2"]]  # s1000-0 trained
    (replica,) = plan(config, resume=resume).replicas
    assert _ids(replica.restore) == ["s1000-5", "s1001-2"]
    assert replica.consumed_prompt_ids == {"s1000-0", "s1000-5", "s1001-2"}
