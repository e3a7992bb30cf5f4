"""The rollouter's configuration (`RolloutConfig`) and the dispatch loop's states
(`LoopState`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from rollout_engine.admission import PacingName, StalenessBound
from rollout_engine.group_filter import GroupFilterName
from rollout_engine.types import PauseMode, SamplingConfig

__all__ = ["DEFAULT_MAX_STALENESS", "LoopState", "RolloutConfig"]

# Two versions: enough to overlap a trainer step with the next batch's generation even when a
# batch takes longer than a step, while keeping importance weights close to 1.
DEFAULT_MAX_STALENESS = 2

LoopState = Literal[
    "idle",
    "fetching",
    "admitting",
    "saturated",
    "held",
    "draining",
    "paused",
    "finishing",
    "stopped",
    "finished",
    "failed",
]
"""What the dispatch loop is doing now (`Rollouter.state`, `RolloutStats.state`).

- `"idle"`: `run()` has not started.
- `"fetching"`: waiting for the prompt source's next prompt (finished groups are still
  reaped meanwhile).
- `"admitting"`: a group was just dispatched; the loop goes round again at once.
- `"saturated"`: `max_concurrency` groups are in flight; waiting for one to finish.
- `"held"`: new prompts are held (`hold_new_prompts()`); waiting for
  `release_new_prompts()`. Restored groups are still admitted.
- `"draining"`: the staleness budget is exhausted; waiting for a group to finish or for
  `on_weights()` (which ends the wait at once).
- `"paused"`: a weight push is in progress (`pause()` was called); waiting for
  `on_weights()`.
- `"finishing"`: the prompts are exhausted; waiting for the last groups in flight.
- `"stopped"` (final): `stop()` was called; in-flight groups were cancelled.
- `"finished"` (final): every prompt was delivered, failed or dropped.
- `"failed"` (final): `max_consecutive_failures` groups failed in a row; `run()` raised
  `RolloutFailed`.
"""


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    """How the rollouter admits, generates and syncs. Counts are groups (prompts).

    `groups_per_version = groups_per_step * sync_every` of this rollouter's groups are
    consumed per weight version (`groups_per_step` is this rollouter's share of a trainer
    batch: the whole batch with one rollouter); at most `max_staleness = k` versions may
    separate a delivered response's oldest token from the rollouter's version.
    `partial_rollout=False` makes a weight push wait for every in-flight request (pause mode
    "wait"); otherwise requests are kept or aborted (`pause_mode`) and continue with the new
    weights. `batch_size=` is the deprecated name of `groups_per_step`.

    `generation_only=True` is for runs without a consumer that advances the weight version
    (batch generation, evaluation): admission is then limited by `max_concurrency` alone, so
    a finite prompt list runs to the end. With a trainer, leave it False.
    """

    group_size: int = 8
    max_concurrency: int = 16
    groups_per_step: int = 16
    sync_every: int = 1
    max_staleness: int = DEFAULT_MAX_STALENESS
    # "fresh": admit only as far ahead as keeps the consumer fed (fresher samples);
    # "eager": spend the whole staleness budget at once. See rollout_engine.admission.
    pacing: PacingName = "fresh"
    # Fresh pacing's relative head-room on the measured batch generation latency.
    pacing_margin: float = 0.25
    partial_rollout: bool = True
    pause_mode: Literal["keep", "abort"] = "keep"
    clear_cache: bool = True
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # Threads that run the reward function (off the loop; a reward function marked
    # `blocking = False` runs on the loop instead).
    reward_workers: int = 1
    # How long stop() waits for cancelled tasks to unwind.
    stop_timeout_s: float = 10.0
    # Give up (run() raises RolloutFailed) after this many groups in a row failed: a dead
    # engine or a closed sink fails every group. A delivered group resets the count;
    # cancellations by stop() do not count.
    max_consecutive_failures: int = 32
    # How many recent FailedGroups `Rollouter.failures` keeps (counts per error type are
    # kept for the whole run; pass `on_failure` to see every one).
    recent_failures: int = 256
    # Dynamic sampling: "zero-variance" drops (and replaces) groups whose rewards all
    # match; see rollout_engine.group_filter.
    filter_groups: GroupFilterName = "none"
    # No consumer advances the version: admit up to max_concurrency, ignore the budget.
    generation_only: bool = False
    # Warn (once per stall) when admission has waited this long on the staleness budget with
    # no new weight version: nothing may be consuming (see `generation_only`).
    stall_warning_s: float = 120.0
    # A group dropped as too stale at delivery gives its prompt back: it is admitted again,
    # from scratch, before any new prompt, so a finite prompt stream loses none to staleness.
    retry_stale: bool = False

    def __post_init__(self) -> None:
        for name in (
            "group_size",
            "max_concurrency",
            "groups_per_step",
            "sync_every",
            "max_consecutive_failures",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.pacing not in ("eager", "fresh"):
            raise ValueError(f"pacing must be 'eager' or 'fresh', got {self.pacing!r}")
        for name in ("pacing_margin", "recent_failures", "stall_warning_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.filter_groups not in ("none", "zero-variance"):
            raise ValueError(
                f"filter_groups must be 'none' or 'zero-variance', got {self.filter_groups!r}"
            )
        if self.pause_mode not in ("keep", "abort"):
            raise ValueError(f"pause_mode must be 'keep' or 'abort', got {self.pause_mode!r}")

    @property
    def groups_per_version(self) -> int:
        """Groups of this rollouter consumed per weight version."""
        return self.groups_per_step * self.sync_every

    @property
    def samples_per_version(self) -> int:
        """Deprecated name of `groups_per_version`."""
        _deprecated("RolloutConfig.samples_per_version", "groups_per_version")
        return self.groups_per_version

    @property
    def batch_size(self) -> int:
        """Deprecated name of `groups_per_step`."""
        _deprecated("RolloutConfig.batch_size", "groups_per_step")
        return self.groups_per_step

    @property
    def staleness_bound(self) -> StalenessBound:
        return StalenessBound(self.max_staleness)

    @property
    def push_pause_mode(self) -> PauseMode:
        """The engine pause mode used by `update_weights`."""
        return self.pause_mode if self.partial_rollout else "wait"


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, stacklevel=3)


_dataclass_init = RolloutConfig.__init__


def _init_accepting_batch_size(self: RolloutConfig, *args: Any, **kwargs: Any) -> None:
    # The keyword `batch_size=` (and `dataclasses.replace(config, batch_size=...)`) keep
    # working for one release; when given it wins over `groups_per_step`.
    if "batch_size" in kwargs:
        _deprecated("RolloutConfig(batch_size=...)", "groups_per_step")
        kwargs["groups_per_step"] = kwargs.pop("batch_size")
    _dataclass_init(self, *args, **kwargs)


RolloutConfig.__init__ = _init_accepting_batch_size  # type: ignore[method-assign]
