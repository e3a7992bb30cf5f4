"""Deprecated home of the driver: it lives in `train_app.driver` now. The names imported
from here still work, and the private ones warn (`DeprecationWarning`)."""

from __future__ import annotations

import warnings
from typing import Any

from train_app.driver import (
    RAY_SUBREAPER,
    WORKER_ENV,
    RunFailed,
    RunInterrupted,
    RunResult,
    TrainerRankFailed,
    capture_driver_logs,
    ensure_model,
    make_plan,
    prepare_run_dir,
    read_model_facts,
    run,
    worker_env,
)

__all__ = [
    "RAY_SUBREAPER",
    "WORKER_ENV",
    "RunFailed",
    "RunInterrupted",
    "RunResult",
    "TrainerRankFailed",
    "capture_driver_logs",
    "ensure_model",
    "make_plan",
    "prepare_run_dir",
    "read_model_facts",
    "run",
    "worker_env",
]

# The private names of the old module and where each lives now.
_MOVED = {
    "_resume_point": ("train_app.driver", "resume_point"),
    "_signals_raise": ("train_app.driver", "signals_raise"),
    "_Stopper": ("train_app.driver", "Stopper"),
    "_start_local_ray": ("train_app.driver", "start_local_ray"),
}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, new = _MOVED[name]
    warnings.warn(
        f"train_app.run.{name} is deprecated; use {module}.{new}",
        DeprecationWarning,
        stacklevel=2,
    )
    import importlib

    return getattr(importlib.import_module(module), new)
