"""Issue 14 item 1: a rollout replica killed with SIGKILL mid-run is restarted and the run
finishes every step, each prompt trained on at most once.

What is real: the local Ray cluster, the queue actor, the trainer actor (`PPOTrainer` on the
tiny Qwen2), the rollout actors and the driver's restart path (`driver.supervisor`), and the
kill (SIGKILL of the rollout actor's process, by the pid the run records in actors.json).
The engines are `rollout_engine.testing.FakeEngine` (random tokens, no model), as in
`test_replicas.py`: what is tested is the restart (a new actor, the trainer's weights and
version handed over, the prompts re-admitted without duplicates), which does not depend on
what the tokens are, and a fake engine starts in milliseconds instead of a minute. The
`--rollout-replicas 2` run with vLLM is what the chaos suite (`tests/chaos/`) kills.
"""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from ppo_trainer import read_checkpoint_meta
from rich.console import Console
from train_app.config import TrainConfig
from train_app.driver import WORKER_ENV, RunFailed, run
from train_app.testing import fake_engines

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One local Ray cluster for the module's runs (`run` joins a running cluster): 2
    replicas, the trainer and one spare CPU for a replacement starting while the dead
    replica's CPU is being released."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    runs = tmp_path_factory.mktemp("elastic")
    env = {**WORKER_ENV, "TORCHINDUCTOR_CACHE_DIR": str(runs / ".inductor")}
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": env},
        _temp_dir=os.environ.get("RAY_TMPDIR", "/tmp/ray"),
    )
    try:
        yield
    finally:
        ray.shutdown()


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class _Killer(threading.Thread):
    """Once the run has logged `after` steps, SIGKILLs rollouter `replica`'s process."""

    def __init__(self, run_dir: Path, after: int, replica: int = 0) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.after, self.replica = run_dir, after, replica
        self.killed_pid: int | None = None
        self.step_at_kill: int | None = None
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(0.1):
            records = _records(self.run_dir)
            actors = self.run_dir / "actors.json"
            if len(records) >= self.after and actors.exists():
                pid = json.loads(actors.read_text())["rollout"][self.replica]
                self.step_at_kill = len(records)
                os.kill(pid, signal.SIGKILL)
                self.killed_pid = pid
                return

    def stop(self) -> None:
        self._stop.set()


def _config(tmp_path: Path, name: str, **overrides: object) -> TrainConfig:
    fields = dict(
        runs_dir=tmp_path, name=name, steps=12, batch_size=4, group_size=2, max_staleness=1,
        rollout_replicas=2, max_tokens=6, checkpoint_every=0, progress=False,
        lr_schedule="constant",
    )  # fmt: skip
    return TrainConfig(**{**fields, **overrides})  # type: ignore[arg-type]


def test_killed_rollouter_is_restarted_and_the_run_finishes(
    ray_cluster: None, tmp_path: Path
) -> None:
    """`--rollout-replicas 2`, rollouter 0 SIGKILLed after step 3 of 12: it is restarted
    from the trainer's weights and version, the run logs every step once, the restart is
    counted, and no prompt is trained on twice. Costs ~40-90 s (four actor processes and a
    fifth for the replacement, each importing torch and transformers; ~12 short steps)."""
    run_dir = tmp_path / "killed-replica"
    killer = _Killer(run_dir, after=3)
    killer.start()
    try:
        result = run(_config(tmp_path, run_dir.name), Console(file=io.StringIO()),
                     adjust_plan=fake_engines)  # fmt: skip
    finally:
        killer.stop()
    assert killer.killed_pid is not None, "the run ended before the kill"
    assert not psutil.pid_exists(killer.killed_pid) or (
        psutil.Process(killer.killed_pid).status() == psutil.STATUS_ZOMBIE
    )
    records = _records(result.run_dir)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert records[-1]["rollout/restarts"] == 1.0
    assert all(r["staleness/max"] <= 1 for r in records)
    # The replacement generated after the kill: replica 0's tokens/s is live again.
    assert records[-1]["rollout/replica0/tokens/s"] > 0
    meta = read_checkpoint_meta(result.run_dir / "checkpoints" / "latest")
    # 48 distinct groups of 48 distinct prompts: no prompt trained on twice (a prompt
    # regenerated by the replacement has another group id) and a full batch every step.
    assert len(meta.consumed_group_ids) == len(set(meta.consumed_prompt_ids)) == 12 * 4
    assert len(meta.consumed_prompt_ids) == len(set(meta.consumed_prompt_ids))
    pids = json.loads((result.run_dir / "actors.json").read_text())
    assert killer.killed_pid not in pids["rollout"]  # actors.json names the replacement
    # The group accounting balances: the killed replica's deliveries are the queue's excess.
    groups = json.loads((result.run_dir / "summary.json").read_text())["groups"]
    assert groups["balanced"], groups
    assert groups["rollout"]["replaced"] == 1
    assert groups["rollout"]["delivered_by_replaced_replicas"] > 0, groups


def test_restarts_past_the_limit_fail_the_run_with_the_cause(
    ray_cluster: None, tmp_path: Path
) -> None:
    """`--max-rollout-restarts 0`: the first SIGKILL fails the run naming the rollouter, as
    before elastic restarts. Costs ~30-60 s (four actor processes, a few steps)."""
    run_dir = tmp_path / "no-restarts"
    killer = _Killer(run_dir, after=2)
    killer.start()
    started = time.monotonic()
    try:
        with pytest.raises(RunFailed, match="rollouter 0 failed"):
            run(_config(tmp_path, run_dir.name, steps=200, max_rollout_restarts=0),
                Console(file=io.StringIO()), adjust_plan=fake_engines)  # fmt: skip
    finally:
        killer.stop()
    assert killer.killed_pid is not None
    assert time.monotonic() - started < 200
