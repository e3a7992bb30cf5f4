"""Evaluation: held-out prompts decoded by the rollouter's engine, outside training.

`Rollouter.evaluate(prompts, sampling, n=...)` runs each prompt as one group of `n`
responses through a runner of its own (the same engine, weight gate and reward executor as
training, so a weight push pauses it like any request), and returns an `EvalResult`. An
evaluation is a separate admission class: its groups are never admitted to training, never
put on the sink, and never counted in the staleness budget, the group ledger, the pacing
estimates or `RolloutStats`; its concurrency has its own bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from rollout_engine.episode import EnvironmentFactory, EpisodeConfig, EpisodeRunner
from rollout_engine.group import GroupJob
from rollout_engine.runners import make_group_runner
from rollout_engine.types import (
    GenerationEngine,
    MultiModalPreprocessor,
    PromptSample,
    RewardFn,
    SamplingConfig,
    Trajectory,
)

__all__ = [
    "DEFAULT_EVAL_CONCURRENCY",
    "EvalResult",
    "EvalSetup",
    "Evaluator",
    "evaluate",
    "pass_at_k",
    "run_eval_groups",
]

# Groups of one evaluation in flight at once: enough to keep a batching engine busy, few
# enough that an evaluation beside training does not crowd out training's requests.
DEFAULT_EVAL_CONCURRENCY = 8


@dataclass(frozen=True, slots=True)
class EvalResult:
    """One evaluation: per prompt (in the order given) its scored responses, or None when
    the group failed (its error, `TypeName: message`, is in `errors` at the same index)."""

    groups: tuple[tuple[Trajectory, ...] | None, ...]
    errors: tuple[str | None, ...]
    version: int
    """The rollouter's weight version when the evaluation started (a push during it may
    give later tokens a newer version: evaluation runs beside training)."""
    seconds: float

    @property
    def scored(self) -> list[tuple[Trajectory, ...]]:
        """The groups that did not fail."""
        return [g for g in self.groups if g is not None]

    @property
    def failed(self) -> int:
        return sum(g is None for g in self.groups)

    def mean_reward(self) -> float:
        """Mean reward over every response of the scored groups (NaN if none)."""
        rewards = [t.reward for g in self.scored for t in g]
        return sum(rewards) / len(rewards) if rewards else float("nan")

    def pass_at_k(self, threshold: float) -> float:
        """Fraction of scored prompts with at least one response whose reward reaches
        `threshold` (pass@k with k = the responses per prompt; NaN if none scored)."""
        return pass_at_k([[t.reward for t in g] for g in self.scored], threshold)


def pass_at_k(rewards: Sequence[Sequence[float]], threshold: float) -> float:
    """Fraction of prompts (one list of response rewards each) with a response whose reward
    is at least `threshold`; NaN for no prompts."""
    if not rewards:
        return float("nan")
    return sum(any(r >= threshold for r in group) for group in rewards) / len(rewards)


async def run_eval_groups(
    prompts: Sequence[PromptSample],
    run_group: Callable[[GroupJob], Awaitable[list[Trajectory]]],
    *,
    label: str,
    version: int,
    clock: Callable[[], float],
    max_concurrency: int,
) -> EvalResult:
    """Run `run_group(job)` for every prompt, at most
    `max_concurrency` at once; group ids are `{label}:{prompt_id}`."""
    limit = asyncio.Semaphore(max_concurrency)
    started = clock()

    async def one(sample: PromptSample) -> list[Trajectory]:
        async with limit:
            job = GroupJob(
                sample=sample,
                group_id=f"{label}:{sample.prompt_id}",
                version=version,
                admitted_wall=time.time(),
                admitted_at=clock(),
            )
            return await run_group(job)

    outcomes = await asyncio.gather(*(one(p) for p in prompts), return_exceptions=True)
    groups: list[tuple[Trajectory, ...] | None] = []
    errors: list[str | None] = []
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            groups.append(None)
            errors.append(f"{type(outcome).__name__}: {outcome}")
        else:
            groups.append(tuple(outcome))
            errors.append(None)
    return EvalResult(tuple(groups), tuple(errors), version, clock() - started)


@dataclass(slots=True)
class EvalSetup:
    """What an evaluation reuses from its rollouter: the reward path, preprocessor and
    multi-turn setup; `evaluations` numbers the runs (their group ids' label)."""

    reward_fn: RewardFn | None
    preprocessor: MultiModalPreprocessor | None
    environment: EnvironmentFactory | None
    episode: EpisodeConfig | None
    evaluations: int = 0


@dataclass(frozen=True, slots=True)
class Evaluator:
    """A rollouter's evaluations (`Rollouter.evaluate` is `Evaluator.evaluate`): its engine,
    weight gate, reward executor and default sampling, with the `setup` it reuses."""

    setup: EvalSetup
    engine: GenerationEngine
    sampling: SamplingConfig
    wait_until_resumed: Callable[[], Awaitable[None]]
    version: Callable[[], int]
    clock: Callable[[], float]
    reward_executor: Callable[[], Executor]

    async def evaluate(
        self,
        prompts: Iterable[PromptSample],
        sampling: SamplingConfig | None = None,
        *,
        n: int = 1,
        reward_fn: RewardFn | None = None,
        max_concurrency: int = DEFAULT_EVAL_CONCURRENCY,
    ) -> EvalResult:
        """Decode held-out `prompts` (`n` responses each, `sampling`, default the training
        sampling) on this rollouter's engine and score them, beside the dispatch loop.

        A separate admission class (`rollout_engine.evaluation`): nothing here is admitted,
        delivered, put on the sink or counted in the staleness budget, the ledger, the pacing
        or `stats()`. Requests go through the weight gate like training's (a push pauses and
        continues them), rewards run in the same reward executor. `reward_fn` scores with
        another function (a held-out set of another task; single-turn); by default the
        rollouter's own (and its environment, for multi-turn). A group that fails is
        reported in the result, never raised. Safe to call while `run()` runs, or without
        it; concurrent evaluations are independent."""
        return await evaluate(
            list(prompts),
            self.setup,
            engine=self.engine,
            sampling=sampling if sampling is not None else self.sampling,
            n=n,
            reward_fn=reward_fn,
            max_concurrency=max_concurrency,
            wait_until_resumed=self.wait_until_resumed,
            version=self.version(),
            clock=self.clock,
            reward_executor=self.reward_executor,
        )


async def evaluate(
    prompts: Sequence[PromptSample],
    setup: EvalSetup,
    *,
    engine: GenerationEngine,
    sampling: SamplingConfig,
    n: int,
    reward_fn: RewardFn | None,
    max_concurrency: int,
    wait_until_resumed: Callable[[], Awaitable[None]],
    version: int,
    clock: Callable[[], float],
    reward_executor: Callable[[], Executor],
) -> EvalResult:
    """One evaluation with a group runner of its own (see `Rollouter.evaluate`)."""
    if n < 1 or max_concurrency < 1:
        raise ValueError(f"n and max_concurrency must be >= 1, got {n}, {max_concurrency}")
    setup.evaluations += 1
    own = reward_fn is None
    runner = make_group_runner(
        engine,
        setup.reward_fn if own else reward_fn,  # type: ignore[arg-type]
        group_size=n,
        sampling=sampling,
        preprocessor=setup.preprocessor,
        environment=setup.environment if own else None,
        episode=setup.episode if own else None,
        wait_until_resumed=wait_until_resumed,
        on_resubmit=_not_counted,  # training's `resumed` counts training requests only
        clock=clock,
        reward_executor=reward_executor,
    )

    async def run_group(job: GroupJob) -> list[Trajectory]:
        try:
            return await runner.run(job)
        finally:
            runner.forget(job.group_id)

    try:
        return await run_eval_groups(
            prompts,
            run_group,
            label=f"eval{setup.evaluations}",
            version=version,
            clock=clock,
            max_concurrency=max_concurrency,
        )
    finally:
        if isinstance(runner, EpisodeRunner):
            runner.close()


async def _not_counted() -> None:
    return None
