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


def test_quick_grid_is_part_of_the_grid() -> None:
    assert set(QUICK_GRID) <= set(GRID)


def test_unknown_setting_is_refused_before_anything_runs() -> None:
    with pytest.raises(SystemExit, match="k3-fresh"):
        run(quick=False, grid=["k3-fresh"])
