"""`--wandb-project`: the run's rows, configuration and plot reach Weights & Biases through
`MetricsWriter`'s mirrors, beside metrics.jsonl and TensorBoard. Real `wandb` in offline mode
(`WANDB_MODE=offline`, no network); what it wrote is read back from its run file."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from train_app.config import TrainConfig
from train_app.mirrors import WANDB_MISSING, open_mirrors
from train_app.outputs import MetricsWriter, plot_run

# The run file is a LevelDB-style log: a 7-byte file header (":W&B", magic, version), then
# 32 KiB blocks (counted from the file's start) of chunks, each with a 7-byte header (CRC-32
# of type + data, little-endian length, type).
WANDB_BLOCK = 32768
WANDB_HEADER = 7
FULL, LAST = 1, 4
# How long W&B's service may take to write the run's last records after `finish()` returns.
EXIT_RECORD_WAIT_S = 60.0


def _wandb_records(path: Path) -> Iterator[Any]:
    """The run file's records, up to its first incomplete or corrupt chunk: W&B's service may
    still be writing the tail (the exit records) after `finish()` returns, and a LevelDB log
    reader ends the log there too. A record the test needs and this misses fails its assert."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunk = WANDB_HEADER, b""
    while pos + WANDB_HEADER <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < WANDB_HEADER:  # block trailer padding
            pos += left
            continue
        crc = int.from_bytes(data[pos : pos + 4], "little")
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        end = pos + WANDB_HEADER + length
        if end > len(data) or zlib.crc32(data[pos + 6 : end]) != crc:
            return  # the torn tail
        chunk += data[pos + WANDB_HEADER : end]
        if data[pos + 6] in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record
        pos = end


def _history(run_file: Path) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """(the run's config, {step: {key: value}}) as W&B recorded them, once the run file
    holds the run's exit record: `finish()` ends by telling W&B's service to close the run
    (`inform_finish`, not waited for), and the service may write the file's tail, the last
    step's row included, after that on a loaded machine."""
    deadline = time.monotonic() + EXIT_RECORD_WAIT_S
    records = list(_wandb_records(run_file))
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, "no exit record in the W&B run file"
        time.sleep(0.2)
        records = list(_wandb_records(run_file))
    config: dict[str, Any] = {}
    history: dict[int, dict[str, Any]] = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "history":
            row = history.setdefault(record.history.step.num, {})
            for item in record.history.item:
                row[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return config, history


@pytest.mark.slow  # ~37 s measured on 2 cores at load ~16 (W&B's service start and finish)
def test_rows_config_and_plot_reach_wandb_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run-a"
    run_dir.mkdir()
    config = TrainConfig(wandb_project="asyncrl-test", steps=7, runs_dir=tmp_path)
    writer = MetricsWriter(run_dir, tensorboard=False, mirrors=open_mirrors(config, run_dir))
    rows = [{"reward/mean": 0.25, "note": "text", "bad": float("nan")}, {"reward/mean": 0.75}]
    for step, row in enumerate(rows, start=1):
        writer.log(row, step)
    records = [{"step": s, **r} for s, r in enumerate(rows, start=1)]
    writer.add_plot(plot_run(records, run_dir / "reward.png"))
    writer.close()

    assert len(read := (run_dir / "metrics.jsonl").read_text().splitlines()) == 2, read
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    wandb_config, history = _history(run_file)
    assert set(history) >= {1, 2}, history
    assert wandb_config["steps"] == 7 and wandb_config["runs_dir"] == str(tmp_path)
    assert wandb_config["wandb_project"] == "asyncrl-test"
    assert history[1]["reward/mean"] == 0.25 and history[2]["reward/mean"] == 0.75
    assert "note" not in history[1] and "bad" not in history[1]  # scalars only, finite
    plot = next(row for row in history.values() if "plot/reward/_type" in row)
    assert plot["plot/reward/_type"] == "image-file"
    assert (run_file.parent / "files" / plot["plot/reward/path"]).exists()


def test_no_project_no_mirror_and_missing_wandb_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert open_mirrors(TrainConfig(), Path("unused")) == []
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(ImportError, match="`wandb` extra"):
        open_mirrors(TrainConfig(wandb_project="p"), Path("unused"))
    assert "uv sync --extra wandb" in WANDB_MISSING
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name)
    )
    with pytest.raises(ValueError, match="`wandb` extra"):  # before Ray starts
        TrainConfig(wandb_project="p").validate()


@pytest.mark.slow  # ~40 s measured on 2 cores at load ~20 (W&B's service start and finish)
def test_eval_rows_reach_wandb_at_the_latest_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A held-out evaluation's row arrives after later steps' rows; W&B drops a step that
    goes back, so it is logged at the latest step, its own in `eval/step`."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run-e"
    run_dir.mkdir()
    config = TrainConfig(wandb_project="asyncrl-test", runs_dir=tmp_path)
    writer = MetricsWriter(run_dir, tensorboard=False, mirrors=open_mirrors(config, run_dir))
    writer.log({"reward/mean": 0.25}, 1)
    writer.log({"reward/mean": 0.75}, 2)
    writer.log_eval({"eval/reward/mean": 0.5, "eval/step": 1.0}, 1)
    writer.close()
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    _, history = _history(run_file)
    assert set(history) >= {1, 2}, history
    assert history[2]["eval/reward/mean"] == 0.5 and history[2]["eval/step"] == 1
    assert history[2]["reward/mean"] == 0.75 and history[1]["reward/mean"] == 0.25
