"""`PromptSource`: the seeded prompt stream of one replica and its resume state (the real
`repeat` task with the app's character tokenizer; no Ray, no engine), and the resume path
from a checkpoint's `trainer_state.json` to every replica's source."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest
from ppo_trainer import TrainerState, write_manifest
from ppo_trainer.checkpoint_meta import STATE_FILE
from train_app.config import TrainConfig
from train_app.driver import RunFailed, resume_point
from train_app.plan import plan
from train_app.prompts import PromptSource
from train_app.tasks import make_task
from train_app.tiny_model import build_char_tokenizer


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory):
    return make_task("repeat", build_char_tokenizer(Path(tmp_path_factory.mktemp("tok"))))


def _ids(source: PromptSource, n: int) -> list[str]:
    return [p.prompt_id for p in islice(source, n)]


def test_the_stream_is_the_tasks_seeded_stream(task) -> None:
    assert _ids(PromptSource(task, seed=3), 5) == [p.prompt_id for p in islice(task.prompts(3), 5)]
    assert _ids(PromptSource(task, seed=3), 5) == _ids(PromptSource(task, seed=3), 5)


def test_resume_skips_exactly_the_consumed_prompts(task) -> None:
    """Consumed: trained on before the checkpoint. The others, including prompts admitted but
    lost with the old queue, come again, in stream order."""
    first = _ids(PromptSource(task, seed=0), 10)
    consumed = {first[0], first[1], first[4], first[7]}
    resumed = _ids(PromptSource(task, seed=0, consumed=consumed), 6)
    assert resumed == [i for i in first if i not in consumed]


def test_state_round_trips_into_a_fresh_source(task) -> None:
    source = PromptSource(task, seed=5, consumed=["s5-1", "s5-0", "s5-9"])
    assert _ids(source, 2) == ["s5-2", "s5-3"]
    state = source.state_dict()
    assert state == {"seed": 5, "position": 4, "epoch": 0, "cursor": 4, "skip": ["s5-9"]}
    fresh = PromptSource(task, seed=0)
    fresh.load_state_dict(state)
    assert _ids(fresh, 6) == ["s5-4", "s5-5", "s5-6", "s5-7", "s5-8", "s5-10"]
    older = PromptSource(task, seed=0)  # the state of checkpoints before positions
    older.load_state_dict({"seed": 5, "consumed_prompt_ids": ["s5-0", "s5-1"]})
    assert _ids(older, 3) == ["s5-2", "s5-3", "s5-4"]
    with pytest.raises(ValueError, match="unknown PromptSource state keys"):
        fresh.load_state_dict({"seed": 1, "offset": 4})


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_replicas_never_share_a_prompt(task, replicas: int) -> None:
    """Each replica has its own seed (plan.py: seed * 1000 + replica); their ids never meet,
    so one consumed set serves every replica."""
    streams = [set(_ids(PromptSource(task, seed=1000 + r), 50)) for r in range(replicas)]
    assert sum(len(s) for s in streams) == len(set().union(*streams)) == 50 * replicas


def test_state_survives_json(task) -> None:
    """The state is plain data: what a checkpoint file can hold."""
    source = PromptSource(task, seed=2, consumed=["s2-0", "s2-2"])
    assert _ids(source, 1) == ["s2-1"]
    fresh = PromptSource(task, seed=9)
    fresh.load_state_dict(json.loads(json.dumps(source.state_dict())))
    assert _ids(fresh, 3) == _ids(source, 3) == ["s2-3", "s2-4", "s2-5"]


def _write_checkpoint(run_dir: Path, state: TrainerState) -> None:
    latest = run_dir / "checkpoints" / "latest"
    latest.mkdir(parents=True)
    (latest / STATE_FILE).write_text(state.to_json())
    write_manifest(latest)  # last, as the trainer writes it


def test_resume_from_a_checkpoint_skips_every_replicas_consumed_prompts(
    task, tmp_path: Path
) -> None:
    """Two replicas ran; the trainer consumed some of each one's prompts and the others were
    admitted but still in the queue at the stop. After the resume each replica's stream
    leaves out exactly its consumed prompts: the lost ones come again, nothing twice."""
    config = TrainConfig(rollout_replicas=2, batch_size=4)
    streams = [_ids(PromptSource(task, r.prompt_seed), 12) for r in plan(config).replicas]
    consumed = [*streams[0][:5], streams[0][7], *streams[1][:3]]
    groups = [f"{prompt}:{i}" for i, prompt in enumerate(consumed)]  # the rollouter's naming
    _write_checkpoint(
        tmp_path,
        TrainerState(
            step=2,
            version=2,
            consumed_response_ids=tuple(f"{g}:{k}" for g in groups for k in range(2)),
            consumed_group_ids=tuple(groups),
            consumed_prompt_ids=tuple(consumed),
        ),
    )
    resume = resume_point(TrainConfig(resume=tmp_path), tmp_path)
    assert (resume.step, resume.version, resume.consumed_prompt_ids) == (2, 2, set(consumed))
    resumed = plan(config, resume=resume).replicas
    for replica, stream in zip(resumed, streams, strict=True):
        source = PromptSource(task, replica.prompt_seed, consumed=replica.consumed_prompt_ids)
        expected = [p for p in stream if p not in consumed]
        assert _ids(source, len(expected)) == expected
    assert _ids(PromptSource(task, resumed[0].prompt_seed, resume.consumed_prompt_ids), 3) == [
        streams[0][5],
        streams[0][6],
        streams[0][8],
    ]


def test_a_checkpoint_without_prompt_ids_is_refused(tmp_path: Path) -> None:
    """Written before trajectories carried `prompt_id`: its prompts are unknown (group ids
    are not parsed), so resuming it could train a prompt twice."""
    _write_checkpoint(
        tmp_path,
        TrainerState(
            step=1, version=1, consumed_response_ids=("s0-0:0:0",), consumed_group_ids=("s0-0:0",)
        ),
    )
    with pytest.raises(RunFailed, match="predates trajectories carrying `prompt_id`"):
        resume_point(TrainConfig(resume=tmp_path), tmp_path)


def test_a_checkpoint_of_no_step_resumes_the_whole_stream(task, tmp_path: Path) -> None:
    _write_checkpoint(tmp_path, TrainerState(step=0, version=0))
    resume = resume_point(TrainConfig(resume=tmp_path), tmp_path)
    assert resume.consumed_prompt_ids == frozenset()
    seed = plan(TrainConfig(), resume=resume).replicas[0].prompt_seed
    assert _ids(PromptSource(task, seed, resume.consumed_prompt_ids), 3) == _ids(
        PromptSource(task, seed), 3
    )
