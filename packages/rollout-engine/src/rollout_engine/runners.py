"""The one place that picks how a group is generated: `GroupRunner` (single-turn responses)
or `EpisodeRunner` (multi-turn episodes against an environment)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any

from rollout_engine.episode import EnvironmentFactory, EpisodeConfig, EpisodeRunner
from rollout_engine.group import GroupRunner
from rollout_engine.types import GenerationEngine, MultiModalPreprocessor, RewardFn, SamplingConfig

__all__ = ["make_group_runner"]


def make_group_runner(
    engine: GenerationEngine,
    reward_fn: RewardFn,
    *,
    group_size: int,
    sampling: SamplingConfig,
    preprocessor: MultiModalPreprocessor | None,
    environment: EnvironmentFactory | None,
    episode: EpisodeConfig | None,
    wait_until_resumed: Callable[[], Awaitable[Any]],
    on_resubmit: Callable[[], Awaitable[None]],
    clock: Callable[[], float],
    reward_executor: Callable[[], Executor],
) -> GroupRunner | EpisodeRunner:
    """An `EpisodeRunner` when `environment` is given, else a `GroupRunner`."""
    common: dict[str, Any] = {
        "group_size": group_size,
        "sampling": sampling,
        "preprocessor": preprocessor,
        "wait_until_resumed": wait_until_resumed,
        "on_resubmit": on_resubmit,
        "clock": clock,
        "reward_executor": reward_executor,
    }
    if environment is None:
        return GroupRunner(engine, reward_fn, **common)
    config = episode if episode is not None else EpisodeConfig()
    return EpisodeRunner(engine, reward_fn, environment, config=config, **common)
