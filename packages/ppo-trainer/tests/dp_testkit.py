"""Runs of the data-parallel tests: one process, or one rank of a spawned gloo world.

A module of its own (not the test file) so that `torch.multiprocessing.spawn` children can
import `rank_main` by name; `conftest.py` puts this directory on `sys.path`, and spawned
children inherit it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import torch
from ppo_testkit import ListSource, RecordingWeightSink, make_group, tiny_qwen2
from ppo_trainer import PPOConfig, PPOTrainer, Trajectory

STEPS = 4
BASE = {
    "lr": 1e-3,
    "batch_size": 3,
    "ppo_epochs": 1,  # 2 updates a step all the same (2 minibatches); GAE runs 2 epochs
    "num_minibatches": 2,
    "grad_accum": 2,
    "sync_every": 2,
    "max_staleness": 100,
}
# Every loss aggregation mode, both critic-free advantages, GAE with its value head, and the
# KL / entropy terms (whose aggregation uses the same global denominators).
CASES: dict[str, dict[str, Any]] = {
    "token-mean": {"loss_agg": "token-mean"},
    "token-sum": {"loss_agg": "token-sum"},
    "seq-mean-token-sum": {"loss_agg": "seq-mean-token-sum"},
    "seq-mean-token-sum-norm": {"loss_agg": "seq-mean-token-sum-norm", "loss_agg_horizon": 8},
    "seq-mean-token-mean": {"loss_agg": "seq-mean-token-mean"},
    "rloo": {"advantage": "rloo"},
    "gae": {"advantage": "gae", "loss_agg": "token-mean", "ppo_epochs": 2},
    "gae-seq-mean": {"advantage": "gae", "loss_agg": "seq-mean-token-mean"},
    "kl-entropy": {"kl_coef": 0.1, "entropy_coef": 0.01, "loss_agg": "seq-mean-token-sum"},
}
STRATEGIES = ("ddp", "fsdp2")
# fsdp2 shares every line of the loss and its denominators with ddp (only the gradient
# reduction differs), so it runs a subset: the two aggregation families and GAE (+ the
# checkpoint runs); each of its passes is several collectives, slow on a loaded machine.
FSDP2_CASES = ("token-mean", "seq-mean-token-mean", "gae")
CHECKPOINT_CASE = "gae"


def groups() -> list[list[Trajectory]]:
    """3 + 3 + 3 + 1 groups of uneven sizes (4, 2, 3, ...): shards never divide evenly, and
    the last step has one group, so one of two ranks holds nothing."""
    sizes = [4, 2, 3, 3, 4, 2, 2, 3, 4, 3]
    return [make_group(f"g{i}", n=n, seed=7) for i, n in enumerate(sizes)]


def state(trainer: PPOTrainer, dp: Any = None) -> dict[str, torch.Tensor] | None:
    """Full policy weights (+ value head) on rank 0 / the single process; None elsewhere."""
    if dp is None:
        weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    else:
        weights = dp.full_model_state(trainer.model)
    head = trainer._updater.value_head
    if weights is not None and head is not None:
        weights.update(
            {f"value_head.{k}": v.detach().clone() for k, v in head.state_dict().items()}
        )
    return weights


def run_case(
    name: str,
    data: list[list[Trajectory]],
    *,
    dp: Any = None,
    checkpoint_dir: Path | None = None,
    resume_from: Path | None = None,
) -> dict[str, Any]:
    """Train a fresh tiny Qwen2 on `data`; return weights, pushes and metrics (rank 0)."""
    overrides = dict(BASE)
    overrides.update(CASES[name])
    if checkpoint_dir is not None:
        overrides.update(checkpoint_dir=str(checkpoint_dir), checkpoint_every=2, keep_checkpoints=0)
    config = PPOConfig(**overrides)
    # A resumed run starts from other weights: the checkpoint must overwrite all of them.
    model = tiny_qwen2(seed=5 if resume_from is not None else 0)
    ref = tiny_qwen2(seed=1) if config.kl_coef else None
    sink = RecordingWeightSink()
    trainer = PPOTrainer(model, config, weight_sink=sink, ref_model=ref, data_parallel=dp)

    async def main() -> Any:
        if resume_from is not None:
            await trainer.load_checkpoint(resume_from)
        return await trainer.train(ListSource(data))

    try:
        summary = asyncio.run(main())
        return {
            "params": state(trainer, dp),
            "pushes": [(v, w) for v, w, _ in sink.pushes],
            "step": trainer.step,
            "version": trainer.version,
            "metrics": summary.metrics,
            "full_state_dict": None if dp is None else dp.full_state_dict(trainer.model),
        }
    finally:
        trainer.close()


def rank_main(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """One rank: every case under every strategy, then checkpoint + resume; rank r saves
    its results to `out_dir/rank{r}.pt`."""
    from ppo_trainer import DataParallel

    torch.set_num_threads(1)
    started = time.perf_counter()
    DataParallel.init(rank, world_size, init_method=f"tcp://127.0.0.1:{port}", timeout_s=120)
    data = groups()
    timings: dict[str, float] = {"init": time.perf_counter() - started}
    results: dict[str, Any] = {"out_dir": out_dir, "timings": timings}
    try:
        for strategy in STRATEGIES:
            dp = DataParallel(strategy=strategy)
            for name in CASES if strategy == "ddp" else FSDP2_CASES:
                started = time.perf_counter()
                results[f"{strategy}/{name}"] = run_case(name, data, dp=dp)
                timings[f"{strategy}/{name}"] = time.perf_counter() - started
            started = time.perf_counter()
            root = Path(out_dir) / f"ckpt-{strategy}"
            straight = run_case(CHECKPOINT_CASE, data, dp=dp, checkpoint_dir=root)
            resumed = run_case(
                CHECKPOINT_CASE,
                data[2 * BASE["batch_size"] :],
                dp=dp,
                resume_from=root / "step_000002",
            )
            results[f"{strategy}/checkpoint"] = {"straight": straight, "resumed": resumed}
            timings[f"{strategy}/checkpoint"] = time.perf_counter() - started
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        DataParallel(strategy="ddp").close()


def loopback_rank(rank: int, world_size: int, out_dir: str) -> None:
    """One rank of a group that meets on loopback: rank 0 opens `listen_for_ranks()` and
    writes its address for the others; rank 0 records its listening sockets once the group
    is up (`out_dir/listening.json`), then every rank does one all-reduce and one
    `broadcast_object`."""
    import json
    import os

    import psutil
    from ppo_trainer import DataParallel, listen_for_ranks

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own sockets, as the app sets
    address_file = Path(out_dir) / "address"
    sock = None
    if rank == 0:
        sock = listen_for_ranks("127.0.0.1")
        host, port = sock.getsockname()[:2]
        (Path(out_dir) / "address.tmp").write_text(f"tcp://{host}:{port}")
        (Path(out_dir) / "address.tmp").rename(address_file)
    deadline = time.monotonic() + 60
    while not address_file.exists():
        assert time.monotonic() < deadline, "rank 0 never wrote its address"
        time.sleep(0.05)
    init_method = address_file.read_text()
    dp = DataParallel.init(
        rank, world_size, init_method=init_method, timeout_s=60, store_socket=sock
    )
    total = dp.all_reduce(torch.tensor([float(rank + 1)]))
    got = dp.broadcast_object({"from": "rank 0"} if rank == 0 else None)
    if rank == 0:
        listening = [
            [c.laddr.ip, c.laddr.port]
            for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        result = {"listening": listening, "address": init_method, "sum": float(total[0])}
        (Path(out_dir) / "listening.json").write_text(json.dumps({**result, "got": got}))
    dp.all_reduce(torch.zeros(1))  # rank 0 has written before anyone leaves
    dp.close()
