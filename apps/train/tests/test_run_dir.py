"""The run directory before anything starts: a name in use is refused (or replaced with
`--overwrite`), a resume checks its task and does not rewrite config.toml before its
checkpoint loads, config.toml keeps a None that is not the default, and one run at a time
holds the lock."""

from __future__ import annotations

from pathlib import Path

import pytest
from train_app import cli
from train_app import driver as driver_module
from train_app.config import TrainConfig, load_toml, to_toml
from train_app.driver import RunFailed
from train_app.driver.startup import prepare_run_dir, run_dir_lock


def test_config_toml_keeps_a_none_that_is_not_the_default(tmp_path: Path) -> None:
    config = TrainConfig(max_grad_norm=None, steps=3)
    path = tmp_path / "config.toml"
    path.write_text(to_toml(config))
    assert load_toml(path)["max_grad_norm"] is None
    assert "name" not in load_toml(path)  # None is name's default: nothing to write
    assert TrainConfig(**load_toml(path)) == config


def test_resume_reads_a_none_back_from_config_toml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "config.toml").write_text(to_toml(TrainConfig(max_grad_norm=None)))
    seen: list[TrainConfig] = []
    monkeypatch.setattr(
        driver_module, "run", lambda c, _: seen.append(c) or driver_module.RunResult(tmp_path, {})
    )
    assert cli.main(["--resume", str(tmp_path)]) == 0
    assert seen[0].max_grad_norm is None  # clipping stays off, as the run started


def test_a_name_in_use_is_refused_without_overwrite(tmp_path: Path) -> None:
    config = TrainConfig(runs_dir=tmp_path, name="taken", steps=5)
    run_dir = prepare_run_dir(config)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunFailed, match="--resume"):
        prepare_run_dir(TrainConfig(runs_dir=tmp_path, name="taken", steps=7))
    assert load_toml(run_dir / "config.toml")["steps"] == 5  # the old run is untouched
    assert (run_dir / "metrics.jsonl").exists()


def test_runs_without_a_name_never_share_a_directory(tmp_path: Path) -> None:
    config = TrainConfig(runs_dir=tmp_path)
    first, second = prepare_run_dir(config), prepare_run_dir(config)
    assert first != second and first.parent == second.parent == tmp_path


def test_overwrite_deletes_the_old_run(tmp_path: Path) -> None:
    run_dir = prepare_run_dir(TrainConfig(runs_dir=tmp_path, name="again", steps=5))
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    config = TrainConfig(runs_dir=tmp_path, name="again", steps=7, overwrite=True)
    assert prepare_run_dir(config) == run_dir
    assert not (run_dir / "metrics.jsonl").exists()
    saved = load_toml(run_dir / "config.toml")
    assert saved["steps"] == 7 and saved["overwrite"] is False  # not carried into a resume


def test_a_resume_does_not_rewrite_config_toml_before_its_checkpoint_loads(
    tmp_path: Path,
) -> None:
    run_dir = prepare_run_dir(TrainConfig(runs_dir=tmp_path, name="r", steps=5))
    before = (run_dir / "config.toml").read_text()
    config = TrainConfig(resume=run_dir, steps=9, model=None, lr=0.5)
    assert prepare_run_dir(config) == run_dir
    assert (run_dir / "config.toml").read_text() == before


def test_a_resume_with_another_task_is_refused(tmp_path: Path) -> None:
    run_dir = prepare_run_dir(TrainConfig(runs_dir=tmp_path, name="r", task="repeat"))
    with pytest.raises(RunFailed, match="--task tool"):
        prepare_run_dir(TrainConfig(resume=run_dir, task="tool"))


def test_one_run_at_a_time_holds_the_run_dir(tmp_path: Path) -> None:
    with run_dir_lock(tmp_path):
        with pytest.raises(RunFailed, match="in use by another run"), run_dir_lock(tmp_path):
            pass
        # --overwrite of a directory in use is refused too.
        (tmp_path / "config.toml").write_text("")
        config = TrainConfig(runs_dir=tmp_path.parent, name=tmp_path.name, overwrite=True)
        with pytest.raises(RunFailed, match="in use"):
            prepare_run_dir(config)
    with run_dir_lock(tmp_path):  # released when the run ends
        pass


def test_the_old_driver_module_still_answers_and_warns_for_moved_private_names() -> None:
    import train_app.driver as driver
    import train_app.run as old

    assert old.run is driver.run and old.RunFailed is driver.RunFailed
    with pytest.warns(DeprecationWarning, match="train_app.driver.resume_point"):
        assert old._resume_point is driver.resume_point
    with pytest.raises(AttributeError):
        old._Session  # noqa: B018


def test_an_unnamed_run_is_named_after_its_task_source(tmp_path: Path) -> None:
    """A `--dataset` run is `dataset-...` and an `--env` run the library's name, not the
    default `--task` (`repeat`) it never uses."""
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    runs = tmp_path / "runs"
    assert prepare_run_dir(TrainConfig(runs_dir=runs)).name.startswith("repeat-async-")
    by_dataset = prepare_run_dir(TrainConfig(runs_dir=runs, dataset=dataset, mode="sync"))
    assert by_dataset.name.startswith("dataset-sync-")
    by_env = prepare_run_dir(TrainConfig(runs_dir=runs, env="reasoning-gym:gcd"))
    assert by_env.name.startswith("reasoning-gym-async-")
