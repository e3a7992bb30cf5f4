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

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "repeat-jsonl"


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


def test_filter_clip_and_determinism_flags(recorded: list[TrainConfig]) -> None:
    assert cli.main([]) == 0
    argv = ["--filter-groups", "zero-variance", "--clip-eps-high", "0.28", "--deterministic"]
    assert cli.main(argv) == 0
    default, chosen = recorded
    assert (default.filter_groups, default.clip_eps_high, default.deterministic) == (
        "none",
        None,
        False,
    )
    assert (chosen.filter_groups, chosen.clip_eps_high, chosen.deterministic) == (
        "zero-variance",
        0.28,
        True,
    )


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


def _bad_paths(tmp_path: Path) -> dict[str, list[str]]:
    """Arguments naming paths that are not what the flag needs (made under `tmp_path`)."""
    not_a_run = tmp_path / "not-a-run"
    not_a_run.mkdir()
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    return {
        "config-missing": ["--config", str(tmp_path / "missing.toml")],
        "config-dir": ["--config", str(tmp_path)],
        "resume-missing": ["--resume", str(tmp_path / "nonexistent")],
        "resume-no-config": ["--resume", str(not_a_run)],
        "resume-no-config-eq": [f"--resume={not_a_run}"],
        "runs-dir-file": ["--runs-dir", str(a_file)],
        **_bad_eval(tmp_path),
    }


def _bad_eval(tmp_path: Path) -> dict[str, list[str]]:
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text('{"prompt": "1*2=", "answer": "11"}\n')
    no_column = tmp_path / "no-column.jsonl"
    no_column.write_text('{"question": "1*2="}\n')
    reward = ["--reward", f"{EXAMPLE / 'reward.py'}:repeat_reward"]
    return {
        "eval-both": ["--eval-dataset", str(held_out), "--eval-env", "reasoning-gym:gcd"],
        "eval-no-reward": ["--eval-dataset", str(held_out)],
        "eval-with-env": ["--env", "reasoning-gym:gcd", "--eval-dataset", str(held_out)],
        "eval-no-column": ["--eval-dataset", str(no_column), *reward],
    }


# Every value a run cannot use, with the words of its one-line message. Each was accepted, or
# failed later with a traceback (after the run dir was written, or inside vLLM), before.
BAD_FLAGS = [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--batch-size", "-3"], "--batch-size must be at least 1"),
    (["--group-size", "0", "--advantage", "gae"], "--group-size must be at least 1"),
    (["--sync-every", "0"], "--sync-every must be at least 1"),
    (["--max-concurrency", "0"], "--max-concurrency must be at least 1"),
    (["--ppo-epochs", "0"], "--ppo-epochs must be at least 1"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--trainer-workers", "0"], "--trainer-workers must be at least 1"),
    (["--rollout-replicas", "0"], "--rollout-replicas must be at least 1"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0"),
    (["--max-staleness", "-1"], "--max-staleness must be >= 0"),
    (["--max-rollout-restarts", "-2"], "--max-rollout-restarts must be >= 0"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--lr", "nan"], "--lr must be > 0"),
    (["--is-cap", "0"], "--is-cap must be > 0"),
    (["--clip-eps", "-1"], "--clip-eps must be in [0, 1)"),
    (["--clip-eps", "1.5"], "--clip-eps must be in [0, 1)"),
    (["--clip-eps-high", "0"], "--clip-eps-high must be > 0"),
    (["--clip-staleness-scale", "-1"], "--clip-staleness-scale must be >= 0"),
    (["--min-lr-ratio", "2"], "--min-lr-ratio must be in [0, 1]"),
    (["--max-grad-norm", "0"], "--max-grad-norm must be > 0"),
    (["--corrupt-images", "1"], "--corrupt-images must be in [0, 1)"),
    (["--rollout-replicas", "5", "--batch-size", "4"], "more than --batch-size"),
    (["--task", "nope"], "--task nope"),
    (["--group-size", "1"], "--group-size"),
    (["--advantage", "rloo", "--group-size", "1"], "--group-size must be at least 2 for rloo"),
    (["--model", "/nonexistent"], "config.json"),
    (["--rollout-resources", "GPU=0"], "--rollout-resources"),
    (["--trainer-resources", "node2=1"], "need --ray-address"),
    (["--name", "a/b"], "--name 'a/b'"),
    (["--name", ".."], "--name '..'"),
    ("config-missing", "missing.toml: no such file"),
    ("config-dir", "is a directory"),
    ("resume-missing", "no such run directory"),
    ("resume-no-config", "no config.toml there"),
    ("resume-no-config-eq", "no config.toml there"),
    ("runs-dir-file", "is not a directory"),
    (["--eval-every", "-1"], "--eval-every must be >= 0"),
    (["--eval-samples", "0"], "--eval-samples must be at least 1"),
    (["--eval-n", "0"], "--eval-n must be at least 1"),
    (["--eval-temperature", "-0.5"], "--eval-temperature must be >= 0"),
    (["--eval-temperature", "nan"], "--eval-temperature must be >= 0"),
    (["--eval-temperature", "inf"], "--eval-temperature must be >= 0"),
    (["--eval-every", "5"], "--eval-every needs a held-out set"),
    (["--eval-dataset", "/nonexistent.jsonl"], "--eval-dataset /nonexistent.jsonl: no such file"),
    (["--eval-env", "nope:x"], "--eval-env nope:x: unknown library 'nope'"),
    (["--eval-env", "reasoning-gym:"], "--eval-env reasoning-gym:: name at least one dataset"),
    (["--eval-env", "verifiers:env.py"], "--eval-env verifiers:env.py: held-out evaluation takes"),
    (["--eval-env", "reasoning-gym:no_such_set"], "--eval-env reasoning-gym: unknown dataset"),
    (["--eval-env", "reasoning-gym:leg_counting", "--eval-n", "4"], "identical responses"),
    ("eval-both", "--eval-dataset and --eval-env are two evaluation sets"),
    ("eval-no-reward", "--eval-dataset needs --reward"),
    ("eval-with-env", "--eval-dataset with --env"),
    ("eval-no-column", "--eval-dataset"),
]


@pytest.mark.parametrize(
    ("argv", "message"), BAD_FLAGS, ids=lambda v: " ".join(v) if isinstance(v, list) else v
)
def test_bad_configuration_exits_2_with_one_line(
    argv: list[str] | str,
    message: str,
    tmp_path: Path,
    recorded: list[TrainConfig],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Through `cli.main`, as a user types it: exit 2, one line on stderr naming the flag, no
    traceback, and the run (which writes the run dir and starts Ray) is never reached."""
    if isinstance(argv, str):
        argv = _bad_paths(tmp_path)[argv]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("bad configuration:") and message in lines[0], lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert recorded == []


def test_eval_flags_reach_the_run(tmp_path: Path, recorded: list[TrainConfig]) -> None:
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text('{"prompt": "1*2=", "answer": "11"}\n')
    argv = ["--eval-dataset", str(held_out), "--reward", f"{EXAMPLE / 'reward.py'}:repeat_reward",
            "--eval-every", "20", "--eval-samples", "8", "--eval-n", "4",
            "--eval-temperature", "1.0"]  # fmt: skip
    assert cli.main(argv) == 0
    (config,) = recorded
    assert (config.eval_dataset, config.eval_every, config.eval_samples) == (held_out, 20, 8)
    assert (config.eval_n, config.eval_temperature, config.evaluates) == (4, 1.0, True)
    assert "eval_dataset" in to_toml(config)
    assert not TrainConfig().evaluates and TrainConfig().eval_temperature == 0.0


def test_an_eval_set_that_overlaps_training_warns_with_the_count(
    tmp_path: Path, recorded: list[TrainConfig], caplog: pytest.LogCaptureFixture
) -> None:
    training = tmp_path / "train.jsonl"
    training.write_text("".join(f'{{"prompt": "{d}*2=", "answer": "{d}{d}"}}\n' for d in range(5)))
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text('{"prompt": "3*2="}\n{"prompt": "4*2="}\n{"prompt": "9*9="}\n')
    reward = f"{EXAMPLE / 'reward.py'}:repeat_reward"
    argv = ["--dataset", str(training), "--reward", reward, "--eval-dataset", str(held_out)]
    with caplog.at_level("WARNING"):
        assert cli.main([*argv, "--steps", "1", "--batch-size", "2"]) == 0
    (warning,) = [r.getMessage() for r in caplog.records if "held-out" in r.getMessage()]
    assert "2 of its 3 held-out prompts are also training prompts" in warning
    caplog.clear()
    apart = tmp_path / "apart.jsonl"
    apart.write_text('{"prompt": "9*9="}\n')
    with caplog.at_level("WARNING"):
        assert cli.main([*argv[:4], "--eval-dataset", str(apart), "--steps", "1"]) == 0
    assert not [r for r in caplog.records if "held-out" in r.getMessage()]


def test_zero_checkpoint_interval_is_accepted(recorded: list[TrainConfig]) -> None:
    """`--checkpoint-every 0` is documented as "only the checkpoints at the end and at an
    interrupt", not rejected."""
    assert cli.main(["--checkpoint-every", "0"]) == 0
    assert recorded[0].checkpoint_every == 0


def test_bad_configuration_in_a_subprocess_leaves_no_run_dir(tmp_path: Path) -> None:
    """The installed entry point, end to end: a bad flag exits 2 before anything is written."""
    import subprocess
    import sys

    runs = tmp_path / "runs"
    proc = subprocess.run(
        [sys.executable, "-c", "from train_app.cli import main; raise SystemExit(main())",
         "--runs-dir", str(runs), "--max-concurrency", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "bad configuration: --max-concurrency must be at least 1, got 0"
    assert not runs.exists()
