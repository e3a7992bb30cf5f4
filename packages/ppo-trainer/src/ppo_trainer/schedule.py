"""Learning-rate schedules: constant, linear or cosine decay after a linear warmup."""

from __future__ import annotations

import functools
import math

import torch

from ppo_trainer.config import LRSchedule

__all__ = ["lr_multiplier", "make_scheduler"]


def lr_multiplier(
    step: int,
    *,
    schedule: LRSchedule,
    warmup_steps: int,
    total_steps: int | None,
    min_ratio: float = 0.0,
) -> float:
    """Multiplier of the peak LR at (0-based) trainer step `step`.

    Warmup: m(s) = (s + 1) / W for s < W (so the first step already learns).
    After warmup, with progress p = (s - W) / max(1, T - W) clamped to [0, 1]:

    - constant: m = 1
    - linear:   m = r + (1 - r) * (1 - p)
    - cosine:   m = r + (1 - r) * (1 + cos(pi * p)) / 2

    where r = `min_ratio` and T = `total_steps`.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if total_steps is None:
        raise ValueError(f"schedule {schedule!r} needs total_steps")
    progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    if schedule == "linear":
        decay = 1.0 - progress
    elif schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown lr schedule {schedule!r}")
    return min_ratio + (1.0 - min_ratio) * decay


def make_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    schedule: LRSchedule,
    warmup_steps: int,
    total_steps: int | None,
    min_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A `LambdaLR` stepped once per trainer step; its state_dict round-trips (a partial)."""
    fn = functools.partial(
        lr_multiplier,
        schedule=schedule,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        min_ratio=min_ratio,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=fn)
