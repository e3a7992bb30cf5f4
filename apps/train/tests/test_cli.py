"""The command line: documented options, TOML config with flag overrides, clear errors.

`run` is replaced by a recorder here: these tests are about parsing, not training.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from train_app import cli
from train_app import driver as run_module
from train_app.config import TrainConfig, to_toml


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[TrainConfig]:
    calls: list[TrainConfig] = []

    def fake_run(config: TrainConfig, console: object) -> run_module.RunResult:
        calls.append(config)
        return run_module.RunResult(Path("runs/x"), {})

    monkeypatch.setattr(run_module, "run", fake_run)
    return calls


def test_help_documents_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    for field in dataclasses.fields(TrainConfig):
        assert f"--{field.name.replace('_', '-')}" in text, field.name
    assert "--no-partial-rollout" in text and "--config" in text


def test_flags_reach_the_run(recorded: list[TrainConfig]) -> None:
    code = cli.main(["--steps", "7", "--mode", "sync", "--no-partial-rollout", "--seed", "3"])
    assert code == 0
    (config,) = recorded
    assert (config.steps, config.mode, config.partial_rollout, config.seed) == (7, "sync", False, 3)
    assert config.effective_staleness == 0 and not config.effective_partial_rollout


def test_advantage_flag(recorded: list[TrainConfig]) -> None:
    assert cli.main([]) == 0
    assert cli.main(["--advantage", "gae", "--group-size", "1"]) == 0  # no group baseline
    assert cli.main(["--advantage", "rloo"]) == 0
    assert [c.advantage for c in recorded] == ["grpo", "gae", "rloo"]


def test_toml_config_with_command_line_overrides(tmp_path: Path, recorded) -> None:
    path = tmp_path / "run.toml"
    path.write_text('steps = 11\nbatch_size = 3\ntask = "repeat"\nmax_staleness = 1\n')
    assert cli.main(["--config", str(path), "--steps", "5"]) == 0
    (config,) = recorded
    assert (config.steps, config.batch_size, config.max_staleness) == (5, 3, 1)


def test_resume_reads_the_runs_config(tmp_path: Path, recorded) -> None:
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(to_toml(TrainConfig(steps=6, batch_size=2, group_size=3)))
    assert cli.main(["--resume", str(run_dir), "--steps", "9"]) == 0
    (config,) = recorded
    assert config.resume == run_dir and config.steps == 9
    assert (config.batch_size, config.group_size) == (2, 3)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--task", "nope"], "--task nope"),
        (["--group-size", "1"], "--group-size"),
        (["--advantage", "rloo", "--group-size", "1"], "--group-size must be at least 2 for rloo"),
        (["--model", "/nonexistent"], "config.json"),
    ],
)
def test_bad_configuration_exits_2_with_a_message(
    argv: list[str], message: str, recorded, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().out
    assert recorded == []
