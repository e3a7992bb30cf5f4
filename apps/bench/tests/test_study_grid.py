"""The study grid names real app options: every setting parses with the app's own CLI.

A grid entry with an option the app does not have would fail only after the settings before
it have run for an hour; this catches it in a second.
"""

from __future__ import annotations

import pytest
from bench_app.study_bench import GRID, QUICK_GRID, run
from train_app.cli import app


@pytest.mark.parametrize("setting", sorted(GRID))
def test_every_setting_parses_as_app_options(setting: str) -> None:
    mode, options = GRID[setting]
    _, bound, _ = app.parse_args(["--mode", mode, *options])
    config = bound.arguments["config"]
    config.validate()
    assert config.mode == mode
    expected_k = 0 if mode == "sync" else int(setting[1])
    assert config.effective_staleness == expected_k
    if mode == "async":
        assert config.pacing == setting.split("-")[1]
    assert (config.is_level == "sequence") == ("seq-is" in setting)
    assert (config.is_mode == "mask") == ("mask-is" in setting)
    assert config.partial_rollout == setting.endswith("-partial")
    assert (config.clip_eps_high == 0.28) == ("clip-higher" in setting)
    assert (config.filter_groups == "zero-variance") == setting.endswith("-filter")
    # the settings measured before the clip scaling was the default turn it off
    assert (config.clip_staleness_scale == 0.0) == ("--clip-staleness-scale" in options)


def test_quick_grid_is_part_of_the_grid() -> None:
    assert set(QUICK_GRID) <= set(GRID)


def test_unknown_setting_is_refused_before_anything_runs() -> None:
    with pytest.raises(SystemExit, match="k3-fresh"):
        run(quick=False, grid=["k3-fresh"])


def test_quick_study_is_one_seed_of_a_few_steps_per_setting(monkeypatch, tmp_path) -> None:
    """Which runs `--quick` asks for (the app runs are replaced by a recorder: this is about
    the bench's choice of runs, not about training)."""
    import bench_app.study_bench as study
    from bench_app.e2e_bench import QUICK_STEPS, figures_from_records

    calls = []

    def fake_run_app(mode, seed, steps, run_dir, extra):
        calls.append((mode, seed, steps))
        rows = [
            {"step": i + 1, "reward/mean": 0.5, "trainer/wall_s": i + 1.0} for i in range(steps)
        ]
        return figures_from_records(mode, seed, rows, {})

    monkeypatch.setattr(study, "_run_app", fake_run_app)
    monkeypatch.chdir(tmp_path)
    report = study.run(quick=True)
    assert calls == [("sync", 0, QUICK_STEPS), ("async", 0, QUICK_STEPS)]
    assert [row["setting"] for row in report.rows] == list(QUICK_GRID)
    calls.clear()
    study.run(quick=True, seeds=2, steps=3, grid=["k1-fresh"])
    assert calls == [("async", 0, 3), ("async", 1, 3)]
