"""Run outputs: a resumed run rewinds metrics.jsonl and TensorBoard to its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from train_app.outputs import MetricsWriter, read_metrics, rewind_metrics


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
