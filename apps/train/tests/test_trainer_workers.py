"""`--trainer-workers N`: N data-parallel trainer ranks, one Ray actor each.

The plan tests need no Ray. The runs go through real Ray, the real queue and N real
`TrainerActor`s (torch.distributed over gloo, `PPOTrainer` with `DataParallel` on the tiny
Qwen2); the rollouter's engine is `rollout_engine.testing.FakeEngine` (random tokens, no
model) so that a run takes seconds, not a vLLM start-up: what is tested is the ranks'
wiring (the rendezvous, rank 0 alone reading the queue and pushing weights, collective
checkpoints, failure of one rank), not generation. That the ranks compute one process's
update is tested in packages/ppo-trainer/tests/test_data_parallel.py.
"""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from ppo_trainer import read_checkpoint_meta
from rich.console import Console
from train_app import cli
from train_app import driver as run_module
from train_app.config import TrainConfig
from train_app.driver import RunFailed, run
from train_app.plan import DP_STRATEGY, RunPlan, plan
from train_app.testing import fake_engines

# -- the plan (no Ray) ---------------------------------------------------------------------


def test_one_worker_is_the_one_process_trainer() -> None:
    run_plan = plan(TrainConfig(), cpu_count=2)
    assert run_plan.trainer.world_size == 1 and run_plan.trainer.rank == 0
    assert run_plan.trainer_ranks == (run_plan.trainer,)  # the same plan: the same path
    assert run_plan.trainer.log_name == "trainer"
    assert (run_plan.replicas[0].cpu, run_plan.trainer.cpu) == (0, 1)
    assert run_plan.ray_num_cpus == 2


@pytest.mark.parametrize("workers", [2, 3])
def test_every_rank_gets_the_same_plan_but_its_rank(workers: int) -> None:
    config = TrainConfig(trainer_workers=workers, batch_size=6, lr=1e-3, seed=4)
    run_plan = plan(config, cpu_count=2)
    ranks = run_plan.trainer_ranks
    assert [r.rank for r in ranks] == list(range(workers))
    assert all(r.world_size == workers for r in ranks)
    assert all(r.ppo == run_plan.trainer.ppo for r in ranks)  # one update, one config
    assert all(r.dp_strategy == DP_STRATEGY == "auto" for r in ranks)
    assert all(r.resume_from == run_plan.trainer.resume_from for r in ranks)
    assert [r.log_name for r in ranks] == ["trainer"] + [f"trainer{i}" for i in range(1, workers)]
    # 2 cores cannot give every actor its own: nothing is pinned.
    assert run_plan.replicas[0].cpu is None and all(r.cpu is None for r in ranks)
    # A local cluster has a CPU for every rollouter and every rank.
    assert run_plan.ray_num_cpus == 1 + workers


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_ranks_pinned_to_consecutive_cores_when_there_are_enough(workers: int) -> None:
    run_plan = plan(TrainConfig(trainer_workers=workers), cpu_count=1 + workers)
    assert run_plan.replicas[0].cpu == 0
    assert [r.cpu for r in run_plan.trainer_ranks] == list(range(1, 1 + workers))
    two_replicas = plan(TrainConfig(trainer_workers=workers, rollout_replicas=2), cpu_count=8)
    assert all(r.cpu is None for r in two_replicas.trainer_ranks)
    assert two_replicas.ray_num_cpus == 2 + workers


def test_trainer_workers_is_validated_and_reaches_the_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match="--trainer-workers must be at least 1"):
        plan(TrainConfig(trainer_workers=0))
    calls: list[TrainConfig] = []
    monkeypatch.setattr(
        run_module, "run", lambda c, _: calls.append(c) or run_module.RunResult(Path("x"), {})
    )
    assert cli.main(["--trainer-workers", "2"]) == 0
    assert cli.main(["--trainer-workers", "0"]) == 2
    assert [c.trainer_workers for c in calls] == [2]


# -- runs through Ray (FakeEngine rollouts, real trainer ranks) ----------------------------


# A CPU for the rollouter and for each of two trainer ranks.
RAY_CLUSTER_CPUS = 3


def _fake_engine(run_plan: RunPlan) -> RunPlan:
    """Every replica on a FakeEngine (short responses, a real asyncio clock)."""
    return fake_engines(run_plan, time_per_token_s=0.001)


def _config(tmp_path: Path, **overrides: object) -> TrainConfig:
    options: dict = dict(
        runs_dir=tmp_path, name="dp", steps=4, batch_size=4, group_size=2, max_tokens=6,
        checkpoint_every=2, progress=False, lr_schedule="constant", trainer_workers=2,
    )  # fmt: skip
    options.update(overrides)
    return TrainConfig(**options)


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.slow
def test_two_ranks_train_checkpoint_and_resume(ray_cluster: None, tmp_path: Path) -> None:
    """Two runs of 4 and 2 steps with 2 ranks each: 63 s measured on 2 cores at load ~1
    (per run, actor start-ups importing torch and transformers; each step well under 1 s)."""
    result = run(_config(tmp_path), Console(file=io.StringIO()), adjust_plan=_fake_engine)
    run_dir = result.run_dir
    assert [r["step"] for r in _records(run_dir)] == [1, 2, 3, 4]
    assert result.summary["trainer_rank_steps"] == [4, 4]  # rank 1 took every step
    pids = json.loads((run_dir / "actors.json").read_text())
    assert len(set(pids["trainer_ranks"])) == 2 and pids["trainer"] == pids["trainer_ranks"][0]
    assert (run_dir / "logs" / "trainer1.log").exists()
    # Both ranks on this one node: they meet on loopback, not on the node's address.
    assert "trainer ranks meet at tcp://127.0.0.1:" in (run_dir / "logs" / "driver.log").read_text()
    meta = read_checkpoint_meta(run_dir / "checkpoints" / "latest")
    assert (meta.step, meta.version) == (4, 4)
    assert len(meta.consumed_prompt_ids) == 4 * 4

    # Resume with 2 ranks: every rank loads the checkpoint; rank 0 pushes its weights.
    resumed = run(
        _config(tmp_path, steps=6, resume=run_dir),
        Console(file=io.StringIO()),
        adjust_plan=_fake_engine,
    )
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["trainer/version"] == 6
    assert resumed.summary["trainer_rank_steps"] == [2, 2]
    meta = read_checkpoint_meta(run_dir / "checkpoints" / "latest")
    assert meta.step == 6
    assert len(set(meta.consumed_prompt_ids)) == 6 * 4  # no prompt trained on twice


@pytest.mark.slow
def test_a_dead_rank_fails_the_run_with_its_cause(ray_cluster: None, tmp_path: Path) -> None:
    """SIGKILL of rank 1 after the first step: the run fails naming rank 1, and every actor
    is killed. One run: 55 s measured on 2 cores at load ~1, 95 s at load ~10."""
    config = _config(tmp_path, name="dead", steps=10_000, checkpoint_every=0)
    run_dir = tmp_path / "dead"
    killed: list[int] = []

    def kill_rank_1() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists() and metrics.read_text().strip():
                pid = json.loads((run_dir / "actors.json").read_text())["trainer_ranks"][1]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    with pytest.raises(RunFailed, match="trainer failed: rank 1 of 2: ActorDiedError"):
        run(config, Console(file=io.StringIO()), adjust_plan=_fake_engine)
    killer.join(5)
    assert killed, "the run ended before rank 1 could be killed"
    pids = json.loads((run_dir / "actors.json").read_text())
    time.sleep(1)  # ray.kill is asynchronous
    for pid in pids["trainer_ranks"]:
        assert not _alive(pid), f"trainer rank process {pid} still alive"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (killed, not yet reaped by the raylet) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False
