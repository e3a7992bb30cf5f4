"""Test helpers of the app: the run with `rollout_engine.testing.FakeEngine` replicas.

Never used by the app itself (its engine is vLLM). Tests of scheduling and of faults
(replicas, restarts, the chaos suite) pass `fake_engines` as `run(..., adjust_plan=...)`: the
real Ray, queue, trainer and driver with engines that start in milliseconds and produce
random tokens. `local_ray_cluster` is the one local cluster those tests' fixtures start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

from rollout_engine.testing import FakeEngineConfig

from train_app.plan import RunPlan

__all__ = ["TEST_CLUSTER_CPUS", "fake_engines", "local_ray_cluster"]

# CPUs of a test cluster: two rollouters, the trainer and one spare for a replacement
# rollouter starting while a dead one's CPU is being released.
TEST_CLUSTER_CPUS = 4


@contextlib.contextmanager
def local_ray_cluster(work_dir: Path, num_cpus: int = TEST_CLUSTER_CPUS) -> Iterator[str]:
    """A local Ray cluster started as the app starts its own (`start_local_ray`: retried
    under load, orphans of SIGKILLed actors reaped), with the app's worker environment;
    yields its GCS address (`run` and subprocesses join it). A cluster already up in this
    process (another module's, with another environment) is shut down first."""
    import ray

    from train_app.driver import WORKER_ENV, start_local_ray
    from train_app.driver.cluster import compile_cache_dir

    if ray.is_initialized():
        ray.shutdown()
    env = {**WORKER_ENV, "TORCHINDUCTOR_CACHE_DIR": str(compile_cache_dir(work_dir / ".inductor"))}
    options = {
        "log_to_driver": False,
        "runtime_env": {"env_vars": env},
        "_temp_dir": os.environ.get("RAY_TMPDIR", "/tmp/ray"),
    }
    start_local_ray(num_cpus=num_cpus, options=options)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def fake_engines(
    run_plan: RunPlan, time_per_token_s: float = 0.01, fixed_length: int | None = None
) -> RunPlan:
    """Every replica on a FakeEngine: its own seed, responses of ~4 tokens (exactly
    `fixed_length` when given) from a 20-token vocabulary, `time_per_token_s` of real
    asyncio time per token, and the plan's starting weight version (a resumed run's)."""
    eos = run_plan.replicas[0].rollout.sampling.stop_token_ids[0]
    replicas = tuple(
        dataclasses.replace(
            r,
            engine=FakeEngineConfig(
                seed=r.replica,
                vocab_size=20,
                eos_token_id=eos,
                median_length=4,
                fixed_length=fixed_length,
                time_per_token_s=time_per_token_s,
                initial_version=r.engine.initial_version,
            ),
        )
        for r in run_plan.replicas
    )
    return dataclasses.replace(run_plan, replicas=replicas)
