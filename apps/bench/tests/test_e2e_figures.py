"""The e2e bench's arithmetic: running means, time to target, the overlap bound and the headline
ratios, on hand-made metric rows (no runs)."""

from __future__ import annotations

import math

import pytest
from bench_app.cli import main
from bench_app.e2e_bench import (
    compare,
    figures_from_records,
    first_reaching,
    overlap_bound,
    running_mean,
)


def test_running_mean_uses_the_last_window() -> None:
    assert running_mean([1, 2, 3, 4], window=2) == [1.0, 1.5, 2.5, 3.5]
    assert running_mean([], window=3) == []


def test_first_reaching_skips_partial_windows() -> None:
    running = [0.9, 0.2, 0.5, 0.7, 0.8]
    assert first_reaching(running, 0.7, full_windows_from=0) == 0
    assert first_reaching(running, 0.7, full_windows_from=1) == 3
    assert first_reaching(running, 0.95, full_windows_from=0) is None


def _records(rewards: list[float], step_s: float, wait_s: float, staleness: float) -> list[dict]:
    per_step = step_s + wait_s
    return [
        {
            "step": i + 1,
            "reward/mean": r,
            "trainer/wall_s": per_step * (i + 1),
            "trainer/wait_s": wait_s,
            "trainer/step_s": step_s,
            "weights/sync_s": 0.0,
            "trainer/idle_ratio": wait_s / per_step,
            "rollout/idle_ratio": 0.25,
            "staleness/mean": staleness,
        }
        for i, r in enumerate(rewards)
    ]


def test_figures_time_to_target_and_phases() -> None:
    # Reward 0 for 10 steps, then 1: the 10-step running mean reaches 0.7 at step 17.
    rewards = [0.0] * 10 + [1.0] * 20
    figures = figures_from_records(
        "sync", 0, _records(rewards, step_s=0.3, wait_s=0.2, staleness=0.0), {"startup_s": 5}
    )
    assert figures.steps_to_target == 17
    assert figures.s_to_target == pytest.approx(17 * 0.5)
    assert figures.steps_to_second == 16
    assert figures.final_reward == 1.0
    assert figures.first_reward == 0.0
    assert figures.train_wall_s == pytest.approx(30 * 0.5)
    assert (figures.wait_s, figures.busy_s) == pytest.approx((0.2, 0.3))
    # g = 0.2, t = 0.3: overlapping them at best turns 0.5 s into 0.3 s a step.
    assert overlap_bound(figures) == pytest.approx(0.5 / 0.3)


def test_never_reaching_the_target_is_censored_at_the_whole_wall() -> None:
    figures = figures_from_records(
        "async", 0, _records([0.1] * 20, 0.3, 0.0, 1.0), {"startup_s": 5}
    )
    assert figures.s_to_target is None
    assert figures.seconds_to(0.7) == figures.train_wall_s


def test_compare_gives_the_headline_ratios() -> None:
    rewards = [0.0] * 10 + [1.0] * 20
    runs = {}
    for seed in (0, 1):
        runs["sync", seed] = figures_from_records(
            "sync", seed, _records(rewards, 0.3, 0.2, 0.0), {}
        )
        runs["async", seed] = figures_from_records(
            "async", seed, _records([*rewards[:-2], 0.9, 0.9], 0.3, 0.0, 1.0), {}
        )
    figures = compare(runs, [0, 1])
    assert figures["time_to_target_ratio"] == pytest.approx(0.3 / 0.5)
    assert figures["speedup"] == pytest.approx(0.5 / 0.3, rel=1e-3)
    # The async runs reach the whole overlap bound.
    assert figures["overlap_bound_fraction"] == pytest.approx(1.0, rel=1e-3)
    final_async = (1.0 + 0.9 + 0.9) / 3  # the last tenth: 3 steps
    assert figures["final_reward_rel_gap"] == pytest.approx(1.0 - final_async, rel=1e-3)
    assert figures["staleness_mean"] == 1.0
    assert figures["met_by_key"]["time_to_target_ratio"] is True
    assert figures["met_by_key"]["final_reward_rel_gap"] is False
    assert figures["met"] is False
    assert not math.isnan(figures["overlap_bound"])


def test_cli_refuses_options_a_bench_does_not_take(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["queue", "--seeds", "2"]) == 2
    assert "takes no --seeds" in capsys.readouterr().err
