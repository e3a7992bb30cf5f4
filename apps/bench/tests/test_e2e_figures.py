"""The e2e bench's arithmetic: running means, time to target, the overlap bound and the headline
ratios, on hand-made metric rows (no runs)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from bench_app.cli import main
from bench_app.e2e_bench import (
    bootstrap_interval,
    compare,
    eval_args,
    eval_cost,
    figures_from_records,
    first_reaching,
    overlap_bound,
    per_seed_rows,
    plot,
    policy_rewards,
    ratio_of_means,
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


def test_a_filtering_run_is_judged_on_the_reward_of_what_it_generated() -> None:
    """The trained batch's reward unless groups were filtered; then the rollouters' reward
    of everything generated, carried over rows that have none."""
    plain = [{"reward/mean": 0.2}, {"reward/mean": 0.4, "rollout/generated_reward/mean": 0.9}]
    assert policy_rewards(plain) == [0.2, 0.4]
    filtered = [
        {"reward/mean": 0.5, "rollout/generated_reward/mean": 0.3},
        {"reward/mean": 0.6},
        {"reward/mean": 0.7, "rollout/generated_reward/mean": 0.4, "rollout/filtered_groups": 3},
    ]
    assert policy_rewards(filtered) == [0.3, 0.3, 0.4]
    assert policy_rewards([{"reward/mean": 0.5, "rollout/filtered_groups": 1}]) == [0.5]


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


def test_bootstrap_of_seeds_that_agree_is_a_point() -> None:
    assert bootstrap_interval([3.0, 6.0, 9.0], [4.0, 8.0, 12.0]) == pytest.approx((0.75, 0.75))


def test_bootstrap_of_two_seeds_spans_their_resamples() -> None:
    """Two seeds: a resample is both seed 0 (ratio 0.5), both seed 1 (1.5) or one of each
    (1.0), with chances 1/4, 1/4, 1/2, so the 90 % interval is [0.5, 1.5] and an 40 %
    interval (30th to 70th percentile) is the single value 1.0."""
    assert bootstrap_interval([0.5, 1.5], [1.0, 1.0]) == (0.5, 1.5)
    assert bootstrap_interval([0.5, 1.5], [1.0, 1.0], level=0.4) == (1.0, 1.0)


def test_bootstrap_is_repeatable_and_holds_the_estimate() -> None:
    async_s = [24.0, 21.7, 17.2, 40.0, 30.0]
    sync_s = [40.3, 33.4, 31.5, 35.0, 38.0]
    low, high = bootstrap_interval(async_s, sync_s)
    assert (low, high) == bootstrap_interval(async_s, sync_s)
    assert low < ratio_of_means(async_s, sync_s) < high
    # A wider level gives a wider interval; more agreeing seeds a narrower one.
    wide = bootstrap_interval(async_s, sync_s, level=0.99)
    assert wide[0] <= low and high <= wide[1]
    agreeing = bootstrap_interval([0.7, 0.7, 0.7, 0.7, 1.0], [1.0] * 5)
    assert agreeing[1] - agreeing[0] < high - low
    with pytest.raises(ValueError):
        bootstrap_interval([1.0], [1.0, 2.0])


def _five_seed_runs() -> dict:
    """Sync reaches 0.7 at step 17 (0.5 s a step) on every seed; async at step 17 at 0.3 s a
    step, except seed 3 where it takes 25 steps of 0.4 s (slower: async lost) and seed 4
    where it never gets there."""
    rewards = [0.0] * 10 + [1.0] * 20
    late = [0.0] * 18 + [1.0] * 12
    runs = {}
    for seed in range(5):
        runs["sync", seed] = figures_from_records("sync", seed, _records(rewards, 0.3, 0.2, 0), {})
        if seed == 3:
            async_rows = _records(late, 0.4, 0.0, 1.0)
        elif seed == 4:
            async_rows = _records([0.1] * 30, 0.3, 0.0, 1.0)
        else:
            async_rows = _records(rewards, 0.3, 0.0, 1.0)
        runs["async", seed] = figures_from_records("async", seed, async_rows, {})
    return runs


def test_compare_counts_the_seeds_async_lost_and_gives_the_interval() -> None:
    runs = _five_seed_runs()
    figures = compare(runs, range(5))
    # Seconds to 0.7: sync 8.5 each; async 5.1 x3, 10.0 (step 25 at 0.4 s), 9.0 (censored).
    per_seed = [5.1 / 8.5] * 3 + [10.0 / 8.5, 9.0 / 8.5]
    assert figures["time_to_target_ratio_per_seed"] == pytest.approx(per_seed, abs=1e-3)
    assert figures["time_to_target_ratio"] == pytest.approx((5.1 * 3 + 19.0) / 5 / 8.5, 1e-3)
    assert figures["time_to_target_ratio_seed_mean"] == pytest.approx(sum(per_seed) / 5, 1e-3)
    assert (figures["async_lost_seeds"], figures["async_lost_seed_list"]) == (2, [3, 4])
    low, high = figures["time_to_target_ratio_interval"]
    assert 5.1 / 8.5 - 1e-3 <= low < figures["time_to_target_ratio"] < high <= 10.0 / 8.5
    assert figures["met_by_key"]["async_lost_seeds"] is False
    assert figures["time_to_target_censored"] is True


def test_per_seed_table_has_a_row_per_seed_and_the_means() -> None:
    runs = _five_seed_runs()
    rows = per_seed_rows(runs, range(5))
    assert [r["seed"] for r in rows] == ["0", "1", "2", "3", "4", "mean"]
    assert rows[0]["sync s (steps) to 0.7"] == "8.5 (17)"
    assert rows[0]["async s (steps) to 0.7"] == "5.1 (17)"
    assert [r["async lost"] for r in rows] == ["no", "no", "no", "yes", "yes", "2/5"]
    assert rows[4]["async s (steps) to 0.7"] == "never (>9.0)"
    low, high = compare(runs, range(5))["time_to_target_ratio_interval"]
    assert rows[-1]["ratio"].endswith(f"[{low:.3f}, {high:.3f}]")
    assert rows[-1]["sync s (steps) to 0.7"] == pytest.approx(8.5)


def test_the_plot_has_a_panel_per_seed(tmp_path) -> None:
    from PIL import Image

    path = plot(_five_seed_runs(), tmp_path / "reward_vs_wall.png")
    width, height = Image.open(path).size
    assert width > 3 * height  # five panels side by side


def test_quick_e2e_is_one_seed_of_a_few_steps_and_the_default_five_seeds(
    monkeypatch, tmp_path
) -> None:
    """Which runs the bench asks for (the app runs are replaced by a recorder: this is about
    the bench's choice of runs and its report, not about training)."""
    import bench_app.e2e_bench as e2e

    calls = []

    def fake_run_app(mode, seed, steps, runs_dir, extra):
        calls.append((mode, seed, steps))
        rewards = [0.0] * 10 + [1.0] * max(0, steps - 10)
        wait = 0.2 if mode == "sync" else 0.0
        return figures_from_records(mode, seed, _records(rewards, 0.3, wait, 0.0), {})

    monkeypatch.setattr(e2e, "_run_app", fake_run_app)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    report = e2e.run(quick=True)
    assert calls == [("sync", 0, e2e.QUICK_STEPS), ("async", 0, e2e.QUICK_STEPS)]
    assert [row["seed"] for row in report.rows] == ["0", "mean"]
    # Not where the simulator looks for a calibration (the newest runs/bench-e2e-*).
    assert Path(report.figures["plot"]).parent.name.startswith("bench-quick-e2e-")
    calls.clear()
    report = e2e.run(quick=False, steps=30)
    assert sorted({seed for _, seed, _ in calls}) == [0, 1, 2, 3, 4]
    assert len(report.rows) == 6 and report.figures["async_lost_seeds"] == 0
    assert Path(report.figures["plot"]).exists() and Path(report.figures["per_run"]).exists()
    assert Path(report.figures["plot"]).parent.parent.resolve() == tmp_path / "runs"
    assert Path(report.figures["plot"]).parent.name.startswith("bench-e2e-")


def test_eval_cost_is_the_ratio_of_training_steps_per_second() -> None:
    plain = figures_from_records("async", 0, _records([0.5] * 20, 0.3, 0.2, 1.0), {})
    rows = _records([0.5] * 20, 0.3, 0.25, 1.0)  # 10 % slower steps
    rows.insert(0, {"step": 0, "eval/reward/mean": 0.1, "eval/pass@1": 0.0})  # eval rows
    rows.append({"step": 20, "eval/reward/mean": 0.4, "eval/pass@1": 0.25})  # are not steps
    evaluating = figures_from_records("async", 0, rows, {})
    assert evaluating.steps == 20
    cost = eval_cost({0: plain}, {0: evaluating}, every=20)
    assert cost["eval_steps_per_s_ratio"] == pytest.approx(0.5 / 0.55, abs=1e-4)
    assert cost["eval_cost_met"] and cost["eval_every"] == 20
    assert eval_args(20)[-2:] == ["--eval-every", "20"]
    assert Path(eval_args(20)[1]).is_file()


def test_only_e2e_takes_eval_every(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["queue", "--eval-every", "20"]) == 2
    assert "takes no --eval-every" in capsys.readouterr().err
