"""The driver of a run: starts Ray and the actors, watches them, writes the outputs.

Modules, in the order a run meets them (each imports only those before it):

- `errors`: the exceptions a run ends with (`RunFailed`, `RunInterrupted`, ...);
- `aio`: small asyncio helpers;
- `cluster`: Ray started locally or joined, every actor's environment;
- `logs`: the driver's log capture (`logs/driver.log`, a quiet terminal);
- `signals`: SIGINT / SIGTERM, graceful first, immediate second;
- `resume`: the checkpoint a `--resume` continues from, verified before Ray starts;
- `startup`: run dir, model, plan with its resume point, actors created and started;
- `reporting`: metrics rows, progress, summary, plot;
- `accounting`: where every group went (a pure balance and its live counts);
- `supervisor`: training under watch, rollouter restarts, failure with cause;
- `session`: `run()`, the table of contents of one run.
"""

from train_app.driver.cluster import RAY_SUBREAPER, WORKER_ENV, start_local_ray, worker_env
from train_app.driver.errors import RunFailed, RunInterrupted, TrainerRankFailed
from train_app.driver.logs import capture_driver_logs
from train_app.driver.reporting import RunResult
from train_app.driver.session import run
from train_app.driver.signals import Stopper, signals_raise
from train_app.driver.startup import (
    ensure_model,
    make_plan,
    prepare_run_dir,
    read_model_facts,
    resume_point,
)

__all__ = [
    "RAY_SUBREAPER",
    "WORKER_ENV",
    "RunFailed",
    "RunInterrupted",
    "RunResult",
    "Stopper",
    "TrainerRankFailed",
    "capture_driver_logs",
    "ensure_model",
    "make_plan",
    "prepare_run_dir",
    "read_model_facts",
    "resume_point",
    "run",
    "signals_raise",
    "start_local_ray",
    "worker_env",
]
