"""Run outputs: a resumed run rewinds metrics.jsonl and TensorBoard to its checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from train_app.outputs import (
    MetricsWriter,
    plot_metrics,
    read_metrics,
    rewind_metrics,
    summarize_metrics,
)


def _tb_steps(run_dir: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))  # purges orphaned data by default
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def test_resume_rewinds_jsonl_and_tensorboard_to_the_checkpoint_step(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path)
    for step in range(1, 8):  # a run checkpointed at step 4, then logged 5-7 and died
        writer.log({"reward/mean": step / 10}, step)
    writer.close()
    with (tmp_path / "metrics.jsonl").open("a") as file:
        file.write('{"step": 8, "reward/me')  # torn last line of a killed process

    # A resumed run is a later process: its event file must sort after the first one. In one
    # process within one second the names differ only by a counter, which sorts as text
    # ("10" before "9") once a long test session has made enough writers.
    time.sleep(1.1)
    resumed = MetricsWriter(tmp_path, resume_step=4)
    assert [r["step"] for r in resumed.kept] == [1, 2, 3, 4]
    for step in range(5, 7):  # the resumed run logs steps 5-6 again
        resumed.log({"reward/mean": 1.0}, step)
    resumed.close()

    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["reward/mean"] for r in records[3:]] == [0.4, 1.0, 1.0]
    assert _tb_steps(tmp_path, "reward/mean") == [1, 2, 3, 4, 5, 6]
    assert not list(tmp_path.glob(".*rewind*"))  # the temporary file was renamed


def test_rewind_keeps_one_row_per_step_and_tolerates_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    assert rewind_metrics(path, 3) == []
    rows = [{"step": 1, "x": 0}, {"step": 2, "x": 0}, {"step": 2, "x": 1}, {"step": 5, "x": 0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert rewind_metrics(path, 3) == [{"step": 1, "x": 0}, {"step": 2, "x": 1}]
    assert read_metrics(path) == [{"step": 1, "x": 0}, {"step": 2, "x": 1}]


def _rows(n: int) -> list[dict[str, float]]:
    return [
        {
            "reward/mean": (step % 10) / 10,
            "staleness/mean": 0.5,
            "staleness/max": float(step % 3),
            "trainer/version": float(step),
            **{f"other/{i}": float(i) for i in range(30)},  # a real row has dozens of keys
        }
        for step in range(1, n + 1)
    ]


def test_the_writer_holds_no_rows_however_long_the_run(tmp_path: Path) -> None:
    """5,000 rows of 34 keys are ~5 MB as dicts; the writer's memory must not grow with
    them (it keeps a count and the last row)."""
    import gc
    import tracemalloc

    rows = _rows(5_000)
    writer = MetricsWriter(tmp_path, tensorboard=False)
    gc.collect()
    tracemalloc.start()
    before, _ = tracemalloc.get_traced_memory()
    for step, row in enumerate(rows, start=1):
        writer.log(row, step)
    after, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    writer.close()
    assert after - before < 300_000, after - before
    assert writer.rows == 5_000 and writer.last_row == {"step": 5_000, **rows[-1]}


def test_summary_and_plot_stream_the_file(tmp_path: Path) -> None:
    rows = _rows(50)
    writer = MetricsWriter(tmp_path, tensorboard=False)
    for step, row in enumerate(rows, start=1):
        writer.log(row, step)
    writer.close()
    summary = summarize_metrics(tmp_path / "metrics.jsonl")
    rewards = [r["reward/mean"] for r in rows]
    assert summary == pytest.approx(
        {
            "steps": 50,
            "reward_first_tenth": sum(rewards[:5]) / 5,
            "reward_last_tenth": sum(rewards[-5:]) / 5,
            "staleness_max": 2.0,
            "weight_version": 50.0,
        }
    )
    png = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "reward.png", max_points=7)
    assert png.stat().st_size > 1000


def test_a_resumed_writer_counts_the_kept_rows(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(1, 6):
        writer.log({"reward/mean": step / 10}, step)
    writer.close()
    resumed = MetricsWriter(tmp_path, tensorboard=False, resume_step=3)
    assert (resumed.rows, resumed.kept_rows) == (3, 3)
    assert resumed.last_row == {"step": 3, "reward/mean": 0.3}
    resumed.log({"reward/mean": 1.0}, 4)
    assert [r["step"] for r in resumed.kept] == [1, 2, 3]  # the compatible list, from the file
    assert (resumed.rows, resumed.last_row) == (4, {"step": 4, "reward/mean": 1.0})
    resumed.close()


def test_cap_log_rotates_a_file_other_descriptors_append_to(tmp_path: Path) -> None:
    """An actor's stdout is an `O_APPEND` descriptor onto its log: after a rotation its next
    writes start the emptied file, and the earlier content is in `NAME.1`."""
    import os

    from train_app.outputs import cap_log

    path = tmp_path / "rollout0.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, b"old line\n" * 100)  # 900 bytes
        assert cap_log(path, max_bytes=1000) is False
        os.write(fd, b"old line\n" * 100)
        assert cap_log(path, max_bytes=1000) is True
        os.write(fd, b"new line\n")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"new line\n"  # no hole of zeros before it
    assert (tmp_path / "rollout0.log.1").read_bytes() == b"old line\n" * 200
    assert cap_log(tmp_path / "missing.log", max_bytes=1) is False
