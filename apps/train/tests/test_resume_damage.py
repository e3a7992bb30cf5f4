"""`--resume` on a damaged checkpoint, before Ray starts: each kind of damage is named and
the previous kept checkpoint used; with none usable (or only another model's) the run ends
in one line, exit 1, with Ray never started and the run dir as it was. Real checkpoints of
a real `PPOTrainer` (tiny model) with the app's real side files."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from ppo_trainer import PPOConfig, PPOTrainer, Timings, Trajectory
from rollout_engine import RolloutSnapshot
from tiny_models import build_tiny_qwen2
from train_app import cli
from train_app.config import TrainConfig
from train_app.driver import session
from train_app.driver.errors import RunFailed
from train_app.driver.resume import model_labels
from train_app.driver.startup import record_config, resume_point
from train_app.inflight import QueuedSnapshot, inflight_path, queued_path, write_queued

GROUP_SIZE = 2
TOKEN_LIMIT = 12  # token ids below the tiny model's character vocabulary's size


def _group(index: int) -> list[Trajectory]:
    rng = random.Random(index)
    prompt = [rng.randrange(3, TOKEN_LIMIT) for _ in range(5)]
    return [
        Trajectory(
            response_id=f"g{index}/{i}",
            group_id=f"g{index}",
            prompt_id=f"p{index}",
            prompt_token_ids=prompt,
            response_ids=[rng.randrange(3, TOKEN_LIMIT) for _ in range(4)],
            behaviour_logprobs=[-3.0] * 4,
            token_versions=[0] * 4,
            finish_reason="stop",
            reward=rng.random(),
            timings=Timings(admitted_at=0.0),
        )
        for i in range(GROUP_SIZE)
    ]


async def _groups() -> AsyncIterator[list[Trajectory]]:
    for index in range(4):
        yield _group(index)


async def _side_files(path: Path) -> None:
    """What the app's checkpoint hook writes (an empty queue, one replica's snapshot)."""
    write_queued(QueuedSnapshot(version=0, taken_at=0.0, items=[]), queued_path(path))
    snapshot = RolloutSnapshot(version=0, group_size=GROUP_SIZE)
    inflight_path(path, 0).write_bytes(snapshot.encode())


async def _train(run_dir: Path) -> None:
    """step_000002 (kept) and step_000004 (latest), labelled for the run's model."""
    model_dir = run_dir / "model"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ppo = PPOConfig(
        batch_size=1,
        checkpoint_dir=str(run_dir / "checkpoints"),
        checkpoint_every=2,
        max_staleness=100,
    )
    labels = model_labels(model_dir)
    trainer = PPOTrainer(model, ppo, on_checkpoint=_side_files, checkpoint_labels=labels)
    await trainer.train(_groups())


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    build_tiny_qwen2(run_dir / "model")
    record_config(TrainConfig(group_size=GROUP_SIZE, name="run"), run_dir)
    asyncio.run(_train(run_dir))
    return run_dir


@pytest.fixture
def run_dir(saved_run: Path, tmp_path: Path) -> Path:
    """This test's copy of the saved run (its checkpoints damaged as the test likes)."""
    copy = tmp_path / "run"
    shutil.copytree(saved_run, copy, symlinks=True)
    return copy


def _config(run_dir: Path) -> TrainConfig:
    return TrainConfig(group_size=GROUP_SIZE, resume=run_dir)


def _resume(run_dir: Path, model_dir: Path | None = None) -> Path | None:
    labels = model_labels(model_dir or run_dir / "model")
    checkpoint = resume_point(_config(run_dir), run_dir, labels=labels).checkpoint
    return None if checkpoint is None else Path(checkpoint)


def _truncate(name: str) -> Callable[[Path], None]:
    def damage(checkpoint: Path) -> None:
        data = (checkpoint / name).read_bytes()
        (checkpoint / name).write_bytes(data[: len(data) // 2])

    return damage


def _garble(name: str) -> Callable[[Path], None]:
    def damage(checkpoint: Path) -> None:
        data = bytearray((checkpoint / name).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (checkpoint / name).write_bytes(bytes(data))

    return damage


def _no_step(checkpoint: Path) -> None:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    del state["step"]
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated trainer_state.json": (_truncate("trainer_state.json"), "trainer_state.json"),
    "empty trainer_state.json": (
        lambda c: (c / "trainer_state.json").write_bytes(b""),
        "trainer_state.json",
    ),
    "missing trainer_state.json": (
        lambda c: (c / "trainer_state.json").unlink(),
        "trainer_state.json",
    ),
    "trainer_state.json without step": (_no_step, "trainer_state.json"),
    "truncated queued.msgpack": (_truncate("queued.msgpack"), "queued.msgpack"),
    "garbled inflight-replica0.msgpack": (
        _garble("inflight-replica0.msgpack"),
        "inflight-replica0.msgpack",
    ),
    "corrupt model.pt": (_garble("model.pt"), "model.pt"),
}


def test_an_intact_latest_is_resumed_without_a_warning(
    run_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    point = resume_point(_config(run_dir), run_dir, labels=model_labels(run_dir / "model"))
    assert point.checkpoint == str((run_dir / "checkpoints" / "step_000004").resolve())
    assert point.step == 4 and len(point.consumed_prompt_ids) == 4
    assert point.queued.saved and len(point.inflight) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_latest_falls_back_with_one_warning_naming_it(
    run_dir: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    damage, named = DAMAGE[kind]
    damage(run_dir / "checkpoints" / "step_000004")
    with caplog.at_level(logging.WARNING):
        checkpoint = _resume(run_dir)
    assert checkpoint == (run_dir / "checkpoints" / "step_000002").resolve()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "step_000004" in warnings[0] and named in warnings[0]


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_no_usable_checkpoint_is_one_line(run_dir: Path, kind: str) -> None:
    damage, named = DAMAGE[kind]
    for step in ("step_000002", "step_000004"):
        damage(run_dir / "checkpoints" / step)
    with pytest.raises(RunFailed) as failed:
        _resume(run_dir)
    message = str(failed.value)
    assert "\n" not in message and "no usable checkpoint" in message
    assert message.count(named) == 2, message


def test_another_models_checkpoint_is_refused(run_dir: Path, tmp_path: Path) -> None:
    other = build_tiny_qwen2(tmp_path / "other", hidden_size=32)
    assert model_labels(other) != model_labels(run_dir / "model")
    with pytest.raises(RunFailed, match="written for model=") as failed:
        _resume(run_dir, model_dir=other)
    assert "hidden_size=64" in str(failed.value) and "hidden_size=32" in str(failed.value)


def test_the_cli_exits_1_in_one_line_before_ray_and_leaves_the_run_dir(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the real app (`main`); only Ray's start is replaced, by a tripwire."""

    def no_ray(*_args: object, **_kwargs: object) -> bool:
        raise AssertionError("Ray started")

    monkeypatch.setattr(session, "start_ray", no_ray)
    for step in ("step_000002", "step_000004"):
        (run_dir / "checkpoints" / step / "model.pt").write_bytes(b"")
    config_toml = (run_dir / "config.toml").read_bytes()
    code = cli.main(["--resume", str(run_dir), "--steps", "9", "--no-progress"])
    out = capsys.readouterr()
    assert code == 1
    assert "Traceback" not in out.out + out.err
    text = " ".join(out.out.split())  # (rich wraps the line at the terminal's width)
    assert text.count("run failed") == 1 and "model.pt has 0 bytes" in text, out.out
    assert (run_dir / "config.toml").read_bytes() == config_toml
    assert not (run_dir / "metrics.jsonl").exists()


def test_a_side_file_of_a_checkpoint_without_manifest_fails_in_one_line(run_dir: Path) -> None:
    """A checkpoint from before manifests: its side files are checked only by reading them."""
    latest = run_dir / "checkpoints" / "step_000004"
    (latest / "manifest.json").unlink()
    state = json.loads((latest / "trainer_state.json").read_text())
    state.pop("has_manifest", None)
    (latest / "trainer_state.json").write_text(json.dumps(state))
    (latest / "queued.msgpack").write_bytes(b"\xc1 not msgpack")
    with pytest.raises(RunFailed, match="checkpoint step_000004 is damaged") as failed:
        resume_point(_config(run_dir), run_dir)  # (no labels: an unlabelled old run)
    assert "\n" not in str(failed.value)


def test_the_labels_name_the_architecture_and_every_size(tmp_path: Path) -> None:
    model_dir = build_tiny_qwen2(tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    label = model_labels(model_dir)["model"]
    assert label.startswith("Qwen2ForCausalLM ")
    assert f"vocab_size={config['vocab_size']}" in label
    assert f"num_hidden_layers={config['num_hidden_layers']}" in label
