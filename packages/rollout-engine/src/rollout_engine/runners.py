"""The one place that picks how a group is generated: `GroupRunner` (single-turn responses)
or `EpisodeRunner` (multi-turn episodes against an environment)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any

from rollout_engine.episode import EnvironmentFactory, EpisodeConfig, EpisodeRunner
from rollout_engine.group import GroupRunner
from rollout_engine.types import GenerationEngine, MultiModalPreprocessor, RewardFn, SamplingConfig

__all__ = ["close_group_runner", "make_group_runner", "settle_engine"]

logger = logging.getLogger(__name__)


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


async def settle_engine(runner: GroupRunner | EpisodeRunner, timeout_s: float) -> None:
    """Return once no engine call of `runner` is outstanding, or after `timeout_s` (a call
    still outstanding then was sent into a paused engine and holds no token)."""
    try:
        await asyncio.wait_for(runner.wait_engine_quiet(), timeout_s)
    except TimeoutError:
        logger.warning(
            "snapshot: engine calls still outstanding after %.1f s; taken anyway", timeout_s
        )


def close_group_runner(runner: GroupRunner | EpisodeRunner) -> None:
    """Release what the runner holds beyond the run (an `EpisodeRunner`'s tool pools)."""
    if isinstance(runner, EpisodeRunner):
        runner.close()
