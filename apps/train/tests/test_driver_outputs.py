"""The driver's outputs without Ray: metrics rows live only in metrics.jsonl (the reporter
keeps none), the summary is read back from the file, and no log grows without end."""

from __future__ import annotations

import asyncio
import functools
import io
import json
import logging
from pathlib import Path

import pytest
from rich.console import Console
from train_app.config import TrainConfig
from train_app.driver import logs as driver_logs
from train_app.driver import reporting
from train_app.driver.logs import cap_actor_logs, capture_driver_logs
from train_app.driver.reporting import Reporter
from train_app.driver.signals import Stopper
from train_app.driver.startup import Actors
from train_app.driver.supervisor import Supervisor
from train_app.failure_log import FailureJournal
from train_app.outputs import MetricsWriter
from train_app.plan import ResumePoint, RunPlan, plan


@pytest.fixture(autouse=True)
def _no_tensorboard(monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorBoard's mirror is not under test here, and importing torch for it costs ~20 s
    on a loaded machine."""
    monkeypatch.setattr(
        reporting, "MetricsWriter", functools.partial(MetricsWriter, tensorboard=False)
    )


def _plan(run_dir: Path, resume: ResumePoint | None = None, replicas: int = 1) -> RunPlan:
    config = TrainConfig(steps=20, rollout_replicas=replicas)
    return plan(config, run_dir=run_dir, resume=resume)


def _reporter(run_dir: Path, resume: ResumePoint | None = None, replicas: int = 1) -> Reporter:
    return Reporter(_plan(run_dir, resume, replicas), Console(file=io.StringIO()))


def test_rows_are_counted_not_kept_and_the_summary_is_read_back(tmp_path: Path) -> None:
    reporter = _reporter(tmp_path)
    reporter.open()
    assert not hasattr(reporter, "records")
    assert reporter.progress_info() == "waiting for the first batch"
    rewards = [0.1 * step for step in range(1, 21)]
    for step, reward in enumerate(rewards, start=1):
        row = {"reward/mean": reward, "staleness/max": step % 3, "trainer/version": step}
        reporter._write_row(step, {**row, "weights/sync_s": 0.5 if step == 1 else 9.0}, 0)
    assert (reporter.rows, reporter.kept_rows) == (20, 0)
    assert reporter.first_row is not None and reporter.first_row["weights/sync_s"] == 0.5
    assert reporter.last_row is not None and reporter.last_row["step"] == 20
    assert reporter.progress_info().startswith("reward 2.000")
    journal = FailureJournal(tmp_path / "failures.jsonl")
    for error in ("Timeout", "Timeout", "ValueError"):
        journal.append({"error_type": error})
    journal.close()
    result = reporter.finish({"rank_steps": [20]}, train_s=1.0, groups={}, signum=None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == json.loads(json.dumps(result.summary))
    assert summary["steps"] == 20 and summary["weight_version"] == 20
    assert summary["reward_first_tenth"] == pytest.approx((0.1 + 0.2) / 2)
    assert summary["reward_last_tenth"] == pytest.approx((1.9 + 2.0) / 2)
    assert summary["staleness_max"] == 2
    assert summary["rollout_failed"].startswith("3 (Timeout 2, ValueError 1)")
    assert (tmp_path / "reward.png").stat().st_size > 0


def test_each_row_has_the_reward_of_what_was_generated_since_the_last(tmp_path: Path) -> None:
    """`rollout/generated_reward/mean` is the interval's mean from the rollouter's cumulative
    sum and count: absent when nothing new was generated; after a replaced replica started
    its count again, the replacement's own count."""
    reporter = _reporter(tmp_path)
    reporter.open()
    cumulative = [(2.0, 4), (5.0, 8), (5.0, 8), (1.0, 4), (4.0, 8)]
    for step, (total, count) in enumerate(cumulative, start=1):
        row = {"reward/mean": 0.5, "rollout/generated_reward_sum": total}
        reporter._write_row(step, {**row, "rollout/generated_responses": float(count)}, 0)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    means = [row.get("rollout/generated_reward/mean") for row in rows]
    assert means == [0.5, 0.75, None, 0.25, 0.75]


def test_generated_reward_is_counted_per_replica_across_a_restart(tmp_path: Path) -> None:
    """Two replicas; replica 0 is replaced between rows 2 and 3 while replica 1's new
    responses keep the summed count rising: the row counts replica 0's replacement from zero
    and replica 1 from its last row (the summed counters alone would give 0.0)."""
    reporter = _reporter(tmp_path, replicas=2)
    reporter.open()
    replica0 = [(2.0, 4), (4.0, 8), (1.0, 2)]
    replica1 = [(1.0, 4), (3.0, 8), (6.0, 16)]
    for step, ((t0, c0), (t1, c1)) in enumerate(zip(replica0, replica1, strict=True), start=1):
        row = {
            "reward/mean": 0.5,
            "rollout/generated_reward_sum": t0 + t1,
            "rollout/generated_responses": float(c0 + c1),
            "rollout/replica0/generated_reward_sum": t0,
            "rollout/replica0/generated_responses": float(c0),
            "rollout/replica1/generated_reward_sum": t1,
            "rollout/replica1/generated_responses": float(c1),
        }
        reporter._write_row(step, row, 0)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    means = [row["rollout/generated_reward/mean"] for row in rows]
    assert means == pytest.approx([3.0 / 8, 4.0 / 8, (1.0 + 3.0) / (2 + 8)])


def test_a_resumed_run_counts_its_kept_rows_apart_from_its_own(tmp_path: Path) -> None:
    with (tmp_path / "metrics.jsonl").open("w") as file:
        for step in range(1, 6):
            file.write(json.dumps({"step": step, "reward/mean": 1.0}) + "\n")
    reporter = _reporter(tmp_path, ResumePoint(step=3))
    reporter.open()
    assert (reporter.rows, reporter.kept_rows, reporter.first_row) == (3, 3, None)
    assert reporter.last_row is not None and reporter.last_row["step"] == 3
    reporter._write_row(4, {"reward/mean": 2.0}, 0)
    assert reporter.first_row is not None and reporter.first_row["step"] == 4
    assert reporter.rows == 4
    reporter.close()


def test_driver_log_rotates_past_its_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(driver_logs, "MAX_LOG_BYTES", 2000)
    with capture_driver_logs(tmp_path, verbose=True):
        for i in range(200):
            logging.getLogger("train_app.test").info("line %d of the driver's log", i)
    log = tmp_path / "logs" / "driver.log"
    assert log.stat().st_size <= 2000
    assert (tmp_path / "logs" / "driver.log.1").stat().st_size <= 2000
    assert "line 199 " in log.read_text()
    assert not (tmp_path / "logs" / "driver.log.2").exists()


def test_actor_logs_are_capped_but_not_the_driver_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(driver_logs, "MAX_LOG_BYTES", 100)
    for name in ("rollout0.log", "trainer.log", "driver.log"):
        (tmp_path / name).write_text("x" * 500)
    (tmp_path / "trainer1.log").write_text("small")
    assert cap_actor_logs(tmp_path) == [tmp_path / "rollout0.log", tmp_path / "trainer.log"]
    assert (tmp_path / "rollout0.log").stat().st_size == 0
    assert (tmp_path / "rollout0.log.1").read_text() == "x" * 500
    assert (tmp_path / "driver.log").stat().st_size == 500  # its own handler rotates it
    assert (tmp_path / "trainer1.log").read_text() == "small"


def test_the_poll_loop_caps_actor_logs_about_once_a_minute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scheduling logic only (no actors): when the poll loop's cap runs."""
    monkeypatch.setattr(driver_logs, "MAX_LOG_BYTES", 100)
    run_plan = _plan(tmp_path)
    assert run_plan.trainer.log_dir is not None
    log_dir = Path(run_plan.trainer.log_dir)
    log_dir.mkdir()
    console = Console(file=io.StringIO())
    reporter = Reporter(run_plan, console)
    supervisor = Supervisor(
        TrainConfig(steps=20), run_plan, Actors(), reporter, Stopper(console), console
    )
    log = log_dir / "rollout0.log"
    log.write_text("x" * 500)
    asyncio.run(supervisor._cap_logs())
    assert log.stat().st_size == 500  # not yet: the first check is a minute in
    supervisor._next_log_cap = 0.0
    asyncio.run(supervisor._cap_logs())
    assert log.stat().st_size == 0
    log.write_text("y" * 500)
    asyncio.run(supervisor._cap_logs())
    assert log.stat().st_size == 500  # the next one is a minute later
