"""Resume state that does not grow with the run: a prompt stream checkpoints its position, not
the ids it consumed (`train_app.prompts`), and a resume seeks there.

Real tasks (the `repeat` task and a real dataset file through Hugging Face `datasets`, with
the app's character tokenizer), real checkpoint files read by the driver's resume path; no
Ray and no engine (the rollouter side of the invariant is tested in
packages/rollout-engine/tests/test_rollouter_prompt_state.py).
"""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import msgspec
import pytest
from async_queue import QueueItem
from ppo_trainer import TrainerState, write_manifest
from ppo_trainer.checkpoint_meta import STATE_FILE
from rollout_engine import GroupSnapshot, PromptSample, RolloutSnapshot, Timings, save_snapshot
from rollout_engine import Trajectory as RolloutTrajectory
from train_app.config import TrainConfig
from train_app.driver import resume_point
from train_app.inflight import QueuedSnapshot, inflight_path, queued_path, write_queued
from train_app.plan import ReplicaPlan, plan
from train_app.prompts import PromptSource
from train_app.tasks import make_task
from train_app.tasks.dataset import DatasetTask
from train_app.tiny_model import build_char_tokenizer

ROWS = [{"prompt": f"{d}*{k}=", "answer": str(d) * k} for d in range(10) for k in (1, 2)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return build_char_tokenizer(Path(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def task(tokenizer):
    return make_task("repeat", tokenizer)


def _dataset(tmp_path: Path, tokenizer, **options) -> DatasetTask:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    reward = tmp_path / "score.py"
    reward.write_text("def exact(completion, answer):\n    return float(completion == answer)\n")
    return DatasetTask(tokenizer, str(path), [f"{reward}:exact"], seed=3, **options)


def _ids(source, n: int) -> list[str]:
    return [p.prompt_id for p in islice(source, n)]


def test_the_state_is_the_same_size_after_100_or_20000_prompts(task) -> None:
    """Before, a checkpoint held every consumed id; now it holds a position."""
    sizes = []
    for consumed in (100, 20_000):
        source = PromptSource(task, seed=0)
        for _ in islice(source, consumed):
            pass
        state = source.checkpoint_state()
        assert state["position"] == consumed and "skip" not in state
        sizes.append(len(msgspec.msgpack.encode(state)))
    assert sizes[1] - sizes[0] <= 4  # the position's own bytes, nothing per prompt
    assert max(sizes) < 64


def test_a_resume_continues_exactly_at_the_position_without_building_what_it_passes(
    task, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = _ids(PromptSource(task, seed=4), 60)
    first = PromptSource(task, seed=4)
    assert _ids(first, 37) == whole[:37]
    built: list[int] = []
    prompt_at = task.prompt_at
    monkeypatch.setattr(task, "prompt_at", lambda s, i: built.append(i) or prompt_at(s, i))
    resumed = PromptSource(task, seed=0)
    resumed.load_state_dict(first.checkpoint_state())
    assert _ids(resumed, 23) == whole[37:]
    assert min(built) == 37  # nothing before the position was built


def test_a_far_position_is_reached_at_once(task) -> None:
    """A million prompts in: the stream starts there, with no walk over them."""
    source = PromptSource(task, seed=1, position=1_000_000)
    assert _ids(source, 2) == ["s1-1000000", "s1-1000001"]


@pytest.mark.parametrize(("shard", "shards"), [(0, 1), (1, 3)])
@pytest.mark.parametrize("stop", [0, 3, 6, 7, 13, 20])
def test_a_dataset_resume_within_and_across_an_epoch_keeps_each_row_once_per_epoch(
    tmp_path: Path, tokenizer, shard: int, shards: int, stop: int
) -> None:
    """Stopped after `stop` prompts (mid-epoch, on the boundary, a few epochs in), the resumed
    stream is exactly the rest of the uninterrupted one: no prompt twice, none skipped."""
    dataset = _dataset(tmp_path, tokenizer, shard=shard, shards=shards)
    length = dataset.epoch_length()
    whole = _ids(PromptSource(dataset, seed=0), 3 * length)
    for epoch in range(3):  # each epoch visits the shard's rows once, reshuffled
        rows = [i.split("-r")[1] for i in whole[epoch * length : (epoch + 1) * length]]
        assert len(set(rows)) == length
    first = PromptSource(dataset, seed=0)
    assert _ids(first, stop) == whole[:stop]
    state = first.checkpoint_state()
    assert (state["epoch"], state["cursor"]) == divmod(stop, length)
    resumed = PromptSource(dataset, seed=0, position=state["position"])
    assert _ids(resumed, 3 * length - stop) == whole[stop:]


def test_a_given_back_prompt_comes_again_first_and_stays_in_the_state_until_then(task) -> None:
    """A group dropped as too stale after it left the rollouter: its prompt returns to the
    stream (and to a checkpoint taken meanwhile), never lost."""
    source = PromptSource(task, seed=2)
    assert _ids(source, 5) == [f"s2-{i}" for i in range(5)]
    # Another stream's id, and one the stream has not reached, are left out when read.
    source.give_back(["s9-4", "s2-1", "s2-7"])
    state = source.checkpoint_state()
    assert state["redo"] == ["s9-4", "s2-1", "s2-7"]
    again = PromptSource(task, seed=0)
    again.load_state_dict(state)
    assert _ids(source, 3) == _ids(again, 3) == ["s2-1", "s2-5", "s2-6"]
    assert "redo" not in source.checkpoint_state()
    rebuilt = PromptSource(task, seed=2, position=5, redo=["s2-3"])
    sample = next(iter(rebuilt))
    assert sample == next(islice(PromptSource(task, seed=2), 3, None))  # the same prompt


def _group(sample: PromptSample, tokens: int = 0) -> GroupSnapshot:
    return GroupSnapshot(group_id=f"{sample.prompt_id}:0", sample=sample, admitted_version=3)


def _queued(prompt_id: str, version: int) -> QueueItem:
    group = [
        RolloutTrajectory(
            response_id=f"{prompt_id}:9:{i}",
            group_id=f"{prompt_id}:9",
            prompt_id=prompt_id,
            prompt_ids=[1, 2],
            response_ids=[3, 4],
            behaviour_logprobs=[-0.25] * 2,
            token_versions=[version] * 2,
            finish_reason="stop",
            timings=Timings(admitted_at=1.0),
        )
        for i in range(2)
    ]
    return QueueItem(payload=msgspec.msgpack.encode(group), version=version, item_id=prompt_id)


def _source(task, replica: ReplicaPlan) -> PromptSource:
    return PromptSource(
        task,
        replica.prompt_seed,
        consumed=replica.consumed_prompt_ids,
        position=replica.prompt_position,
        redo=replica.redo_prompt_ids,
    )


def test_the_driver_resumes_each_stream_at_its_position_and_no_prompt_is_lost_or_twice(
    task, tmp_path: Path
) -> None:
    """A saved run of two replicas: before each snapshot some prompts were trained on, some
    were in flight (saved), some queued (one fresh, put back; one too stale, generated
    again), and one was admitted after the snapshot and queued. After the resume every prompt
    of each stream up to a point is trained exactly once."""
    config = TrainConfig(rollout_replicas=2, batch_size=4, group_size=2, max_staleness=1)
    replicas = plan(config).replicas
    streams = [list(islice(_source(task, r), 40)) for r in replicas]
    positions = [23, 17]
    inflight = [{3, 20, 22}, {16}]
    queued = [{5: 9, 23: 9}, {2: 5}]  # position -> the group's version (5: too stale at 9)
    checkpoint = tmp_path / "checkpoints" / "step_000009"
    checkpoint.mkdir(parents=True)
    trained: list[str] = []
    for i, replica in enumerate(replicas):
        stream, position = streams[i], positions[i]
        saved = RolloutSnapshot(
            version=9,
            group_size=2,
            groups=[_group(stream[p]) for p in sorted(inflight[i])],
            prompt_state=_source(task, replica).checkpoint_state() | {"position": position},
        )
        save_snapshot(saved, inflight_path(checkpoint, i))
        held = inflight[i] | set(queued[i])
        trained += [stream[p].prompt_id for p in range(position) if p not in held]
    items = [_queued(streams[i][p].prompt_id, v) for i in (0, 1) for p, v in queued[i].items()]
    write_queued(QueuedSnapshot(version=9, taken_at=1.0, items=items), queued_path(checkpoint))
    state = TrainerState(step=9, version=9, consumed_prompt_ids=tuple(trained[-3:]))
    (checkpoint / STATE_FILE).write_text(state.to_json())
    (tmp_path / "checkpoints" / "latest").symlink_to("step_000009", target_is_directory=True)
    (tmp_path / "config.toml").write_text("")
    write_manifest(checkpoint)

    resume = resume_point(TrainConfig(resume=tmp_path, **_fields(config)), tmp_path)
    assert sorted(resume.prompt_states) == [r.prompt_seed for r in replicas]
    assert resume.queued.dropped_prompt_ids == (streams[1][2].prompt_id,)
    resumed = plan(config, resume=resume).replicas
    assert [r.prompt_position for r in resumed] == positions
    put_back = [i.item_id for i in resume.queued.items]
    restored = [g.sample.prompt_id for r in resumed if r.restore for g in r.restore.groups]
    new = [p.prompt_id for r in resumed for p in islice(_source(task, r), 10)]
    everything = trained + put_back + restored + new
    assert len(everything) == len(set(everything))  # nothing twice
    for stream, position in zip(streams, positions, strict=True):
        upto = {p.prompt_id for p in stream[: position + 8]}
        assert upto <= set(everything)  # nothing lost: every prompt up to a point
    assert streams[0][23].prompt_id in put_back  # queued after its replica's snapshot
    assert new[0] == streams[0][24].prompt_id  # ... so the resumed stream skips it


def _fields(config: TrainConfig) -> dict:
    return {
        "rollout_replicas": config.rollout_replicas,
        "batch_size": config.batch_size,
        "group_size": config.group_size,
        "max_staleness": config.max_staleness,
    }


def test_a_changed_group_size_restarts_the_saved_groups_from_their_prompts(
    task, tmp_path: Path
) -> None:
    """The stream goes on after the saved groups, so they are kept (from the prompt) rather
    than dropped as a file without a position is."""
    from rollout_engine import ResponseSnapshot
    from train_app.inflight import load_inflight

    sample = next(iter(PromptSource(task, seed=0)))
    response = ResponseSnapshot(token_ids=[5], logprobs=[-0.5], versions=[3])
    group = GroupSnapshot(
        group_id="g", sample=sample, admitted_version=3, responses=[response, response]
    )
    for replica, state in enumerate(({"seed": 0, "position": 1}, None)):
        saved = RolloutSnapshot(version=3, group_size=2, groups=[group], prompt_state=state)
        save_snapshot(saved, inflight_path(tmp_path, replica))
    (kept,) = load_inflight(tmp_path, group_size=4)
    assert kept.group_size == 4 and kept.prompt_state == {"seed": 0, "position": 1}
    assert [(g.sample.prompt_id, g.responses) for g in kept.groups] == [(sample.prompt_id, [])]
