"""Multi-turn episodes: a group member is an episode, not one response.

One episode (one member of a GRPO group), on the rollouter's event loop:

    observation = env.reset(sample)                     # appended to the prompt
    repeat up to `max_turns`:
        turn = generate(prompt + everything so far)     # trained on: loss_mask 1
        result = env.step(turn)                         # reward, done, observation
        stop if result.done
        append result.observation                       # not trained on: loss_mask 0

Everything the engine generated keeps its behaviour log-prob and the version of the weights
that produced it, token by token. A weight push may land at any point: inside a turn (the
engine keeps or aborts the request; an aborted turn continues from `context + tokens so far`
with `rollout_engine.continuation`, exactly like a single-turn response) or between turns (the
next turn simply starts under the new weights). Observation tokens get behaviour log-prob 0.0
and the engine's version when they are appended, which is never older than the tokens before
them, so `min(token_versions)` is the oldest *generated* token's version and the staleness
bound and admission apply unchanged. The episode ends with finish reason:

- the last turn's ("stop" or "length") when the environment says `done`;
- `"max_turns"` when `max_turns` turns were generated and the environment is not done (the
  last observation is not appended: nothing would read it);
- `"length"` when the next turn or observation would not fit in `max_total_tokens` (prompt +
  first observation + every turn and observation).

Blocking code. Environments are async (`Environment`) or plain (`SyncEnvironment`, whose
methods the runner calls in a bounded thread pool, so a tool that waits on I/O or a
subprocess, or computes in C code that releases the GIL, never blocks the loop). An async
environment that calls blocking code hands it to the same pool with
`await run_blocking(fn, *args)`. The pool is the rollouter's (`EpisodeConfig.tool_workers`
threads); `EpisodeConfig.step_timeout_s` bounds each call.

Pure-Python CPU work is different: a thread that computes holds the GIL, and the loop thread
then waits up to the interpreter's switch interval (5 ms) for it at *every* wake-up, longer
with several such threads (measured here: two threads burning 200 ms per call pushed the
loop's p99 lag to 70-90 ms). Such a tool belongs in a process: `await run_in_process(fn,
*args)` runs a picklable, importable function in the rollouter's bounded process pool
(`EpisodeConfig.tool_processes`, spawned on first use). Then the loop waits only for a free
core: its p99 lag stays within 20 ms when the machine has one (tested, skipped when a baseline
run shows the machine too busy to measure); on this 2-core machine shared with other jobs
(load average 5-7) it measured 20-60 ms, against >= 200 ms for the same tool on the loop.

Failure. An exception from the factory, `reset`, `step`, `close` or the engine fails the
episode; the group's other episodes are cancelled and the group becomes one failed sample
(counted by error type by the rollouter), as any group failure does.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import inspect
import logging
import multiprocessing
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from rollout_engine.continuation import PartialResponse, continue_aborted
from rollout_engine.group import GroupJob
from rollout_engine.types import (
    GenerationEngine,
    PromptSample,
    RewardFn,
    SamplingConfig,
    Timings,
    Trajectory,
)

__all__ = [
    "Environment",
    "EnvironmentFactory",
    "EpisodeConfig",
    "EpisodeRunner",
    "ModelTurn",
    "StepResult",
    "SyncEnvironment",
    "environment_reward",
    "run_blocking",
    "run_in_process",
]

T = TypeVar("T")

logger = logging.getLogger(__name__)

# The bounded pools of the episode that is running in this task (set by EpisodeRunner).
_TOOL_POOL: contextvars.ContextVar[Executor | None] = contextvars.ContextVar(
    "rollout_engine_tool_pool", default=None
)
_PROCESS_POOL: contextvars.ContextVar[Callable[[], Executor] | None] = contextvars.ContextVar(
    "rollout_engine_process_pool", default=None
)


@dataclass(frozen=True, slots=True)
class ModelTurn:
    """What the model generated in one turn, as the environment sees it."""

    index: int  # 0 for the first turn
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop token) or "length" (the turn's token budget)


@dataclass(frozen=True, slots=True)
class StepResult:
    """The environment's answer to one turn.

    `observation` is appended to the sequence (not trained on) before the next turn unless
    `done`; `reward` adds to the episode's reward (`Trajectory.reward`).
    """

    observation: Sequence[int] = ()
    reward: float = 0.0
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    """An async environment, one instance per episode. Must not block its loop: hand blocking
    calls to `run_blocking`. An optional `close()` (sync or async) runs when the episode ends,
    however it ends."""

    async def reset(self, sample: PromptSample) -> Sequence[int]:
        """The first observation's tokens (appended to the prompt; may be empty)."""
        ...

    async def step(self, turn: ModelTurn) -> StepResult: ...


@runtime_checkable
class SyncEnvironment(Protocol):
    """A plain (blocking) environment: the runner calls its methods in the tool pool."""

    def reset(self, sample: PromptSample) -> Sequence[int]: ...

    def step(self, turn: ModelTurn) -> StepResult: ...


EnvironmentFactory = Callable[[PromptSample], Environment | SyncEnvironment]
"""Makes the environment of one episode (called on the loop: keep it cheap; heavy set-up
belongs in `reset`)."""


@dataclass(frozen=True, slots=True)
class EpisodeConfig:
    """Limits of one episode and the size of the tool pool."""

    max_turns: int = 4
    # prompt + first observation + every turn and observation; each turn also respects
    # `SamplingConfig.max_tokens`.
    max_total_tokens: int = 512
    # Threads that run blocking environment and tool code (SyncEnvironment, run_blocking).
    tool_workers: int = 4
    # Processes for pure-Python CPU-heavy tools (run_in_process); 0: none. Spawned (not
    # forked) on first use, so they are safe next to threads, Ray and vLLM.
    tool_processes: int = 0
    # Bound on one reset/step/close call; None: no bound. A timed-out call fails the episode
    # (its thread, if any, cannot be killed and finishes on its own).
    step_timeout_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_total_tokens", "tool_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tool_processes < 0:
            raise ValueError(f"tool_processes must be >= 0, got {self.tool_processes}")
        if self.step_timeout_s is not None and self.step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")


async def run_blocking(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run blocking `fn(*args, **kwargs)` off the loop, in the bounded tool pool of the episode
    that calls it (outside an episode: the loop's default executor)."""
    loop = asyncio.get_running_loop()
    call = functools.partial(fn, *args, **kwargs) if kwargs else functools.partial(fn, *args)
    return await loop.run_in_executor(_TOOL_POOL.get(), call)


async def run_in_process(fn: Callable[..., T], /, *args: Any) -> T:
    """Run `fn(*args)` in the bounded process pool of the episode that calls it (for
    pure-Python CPU work, which would hold the GIL in a thread). `fn` and `args` must pickle,
    and `fn` must be importable (a module-level function). Needs
    `EpisodeConfig.tool_processes >= 1`."""
    pool = _PROCESS_POOL.get()
    if pool is None:
        raise RuntimeError("run_in_process needs EpisodeConfig.tool_processes >= 1 (in an episode)")
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(pool(), functools.partial(fn, *args))


def environment_reward(sample: PromptSample, trajectory: Trajectory) -> float:
    """A `RewardFn` for episodes: the environment's summed step rewards (already in
    `trajectory.reward`)."""
    return trajectory.reward


environment_reward.blocking = False  # type: ignore[attr-defined]


@dataclass
class _Episode:
    """One episode's tokens, accumulated turn by turn."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)
    reward: float = 0.0
    resumes: int = 0
    finish_reason: str = "max_turns"

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)

    def add_turn(self, response: PartialResponse) -> None:
        self.turn_starts.append(len(self.token_ids))
        self.token_ids.extend(response.token_ids)
        self.logprobs.extend(response.logprobs)
        self.versions.extend(response.versions)
        self.loss_mask.extend([1] * len(response.token_ids))
        self.resumes += response.resumes

    def add_observation(self, token_ids: list[int], version: int) -> None:
        self.token_ids.extend(token_ids)
        self.logprobs.extend([0.0] * len(token_ids))
        self.versions.extend([version] * len(token_ids))
        self.loss_mask.extend([0] * len(token_ids))


class EpisodeRunner:
    """Turns a `GroupJob` into `group_size` scored episodes (the rollouter's group runner
    when it is given an environment factory). `close()` shuts the tool pool down.

    Snapshots (`rollout_engine.snapshot`) do not carry episodes: `responses_of` is always
    None, so an episode in flight at a snapshot is restored as a fresh admission of its
    prompt (its generated tokens are discarded, never delivered twice).
    `wait_engine_quiet()` returns once no engine call of any episode is outstanding.
    """

    def __init__(
        self,
        engine: GenerationEngine,
        reward_fn: RewardFn,
        environment: EnvironmentFactory,
        *,
        config: EpisodeConfig,
        group_size: int,
        sampling: SamplingConfig,
        wait_until_resumed: Callable[[], Awaitable[Any]],
        on_resubmit: Callable[[], Awaitable[None]],
        clock: Callable[[], float],
        reward_executor: Callable[[], Executor],
    ) -> None:
        self._engine = _CountingEngine(engine)
        self._reward_fn = reward_fn
        self._environment = environment
        self._config = config
        self._group_size = group_size
        self._sampling = sampling
        self._wait_until_resumed = wait_until_resumed
        self._on_resubmit = on_resubmit
        self._clock = clock
        self._reward_executor = reward_executor
        self._pool: ThreadPoolExecutor | None = None
        self._processes: ProcessPoolExecutor | None = None

    def responses_of(self, group_id: str) -> None:
        return None

    def forget(self, group_id: str) -> None:
        return None

    async def wait_engine_quiet(self) -> None:
        await self._engine.quiet.wait()

    def close(self) -> None:
        for pool in (self._pool, self._processes):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, job: GroupJob) -> list[Trajectory]:
        if job.sample.messages is not None:
            raise ValueError(
                f"prompt {job.sample.prompt_id}: multi-turn episodes take token prompts only "
                "(chat messages with images are not supported yet)"
            )
        # This task's context: its episodes (and their run_blocking calls) inherit it.
        _TOOL_POOL.set(self._tool_pool())
        if self._config.tool_processes > 0:
            _PROCESS_POOL.set(self._process_pool)
        members = [
            asyncio.create_task(self._episode(job, index), name=f"episode:{job.group_id}:{index}")
            for index in range(self._group_size)
        ]
        try:
            done, _ = await asyncio.wait(members, return_when=asyncio.FIRST_EXCEPTION)
            failed = [task for task in done if not task.cancelled() and task.exception()]
            if failed:
                raise failed[0].exception()  # type: ignore[misc]
            trajectories = [await task for task in members]  # all done: no wait
        finally:
            # On failure or cancellation (stop()), the other episodes end too.
            for task in members:
                task.cancel()
            await asyncio.gather(*members, return_exceptions=True)
        await self._score(job.sample, trajectories)
        return trajectories

    # ------------------------------------------------------------------ one episode

    async def _episode(self, job: GroupJob, index: int) -> Trajectory:
        env = self._environment(job.sample)
        try:
            episode = await self._play(job, index, env)
        except BaseException:
            await self._close(env, quiet=True)  # the episode's own error wins
            raise
        await self._close(env, quiet=False)
        return self._trajectory(job, index, episode)

    async def _play(
        self, job: GroupJob, index: int, env: Environment | SyncEnvironment
    ) -> _Episode:
        config = self._config
        first = await self._call(env.reset, job.sample)
        episode = _Episode(prompt_ids=[*job.sample.prompt_ids, *first])
        for turn in range(config.max_turns):
            budget = min(self._sampling.max_tokens, config.max_total_tokens - episode.length)
            if budget <= 0:
                episode.finish_reason = "length"
                break
            # A turn never starts into an engine that a weight push holds paused.
            await self._wait_until_resumed()
            response = await self._generate(
                f"{job.group_id}:{index}:t{turn}",
                [*episode.prompt_ids, *episode.token_ids],
                dataclasses.replace(self._sampling, max_tokens=budget),
            )
            episode.add_turn(response)
            result = await self._call(
                env.step,
                ModelTurn(
                    index=turn,
                    token_ids=list(response.token_ids),
                    finish_reason=response.finish_reason,
                ),
            )
            episode.reward += float(result.reward)
            if result.done:
                episode.finish_reason = response.finish_reason
                break
            if turn == config.max_turns - 1:
                break  # "max_turns": no turn will read the observation
            observation = list(result.observation)
            # Room for the observation and at least one generated token after it.
            if episode.length + len(observation) >= config.max_total_tokens:
                episode.finish_reason = "length"
                break
            episode.add_observation(observation, self._engine.version)
        return episode

    async def _close(self, env: Environment | SyncEnvironment, *, quiet: bool) -> None:
        close = getattr(env, "close", None)
        if close is None:
            return
        try:
            await self._call(close)
        except Exception:
            if not quiet:
                raise
            logger.warning("closing the environment of a failed episode raised", exc_info=True)

    async def _generate(
        self, request_id: str, context: list[int], sampling: SamplingConfig
    ) -> PartialResponse:
        """One turn; an aborted request (weight push, abort mode) continues to the end."""
        [completion] = await self._engine.generate(request_id, context, sampling, n=1)
        response = PartialResponse.from_completion(completion)
        if response.aborted:
            await continue_aborted(
                self._engine,
                response,
                request_id=request_id,
                prompt_ids=context,
                sampling=sampling,
                multi_modal_data=None,
                wait_until_resumed=self._wait_until_resumed,
                on_resubmit=self._on_resubmit,
            )
        return response

    async def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        """An environment method: awaited if async, else run in the tool pool; bounded by
        `step_timeout_s`."""
        if inspect.iscoroutinefunction(method):
            call: Awaitable[Any] = method(*args)
        else:
            loop = asyncio.get_running_loop()
            call = loop.run_in_executor(self._tool_pool(), functools.partial(method, *args))
        timeout = self._config.step_timeout_s
        if timeout is None:
            return await call
        async with asyncio.timeout(timeout):
            return await call

    def _trajectory(self, job: GroupJob, index: int, episode: _Episode) -> Trajectory:
        return Trajectory(
            response_id=f"{job.group_id}:{index}",
            group_id=job.group_id,
            prompt_id=job.sample.prompt_id,
            prompt_ids=episode.prompt_ids,
            response_ids=episode.token_ids,
            behaviour_logprobs=episode.logprobs,
            token_versions=episode.versions,
            finish_reason=episode.finish_reason,
            reward=episode.reward,
            timings=Timings(
                admitted_at=job.admitted_wall,
                finished_at=time.time(),
                generation_s=self._clock() - job.admitted_at,
            ),
            num_resumes=episode.resumes,
            loss_mask=episode.loss_mask,
            turn_starts=episode.turn_starts,
        )

    async def _score(self, sample: PromptSample, trajectories: list[Trajectory]) -> None:
        """The rollouter's reward function, as for single-turn groups (it sees the episode's
        summed environment reward in `trajectory.reward`; `environment_reward` keeps it)."""
        reward_fn = self._reward_fn
        if getattr(reward_fn, "blocking", True):
            loop = asyncio.get_running_loop()
            rewards = await loop.run_in_executor(
                self._reward_executor(),
                lambda: [float(reward_fn(sample, t)) for t in trajectories],
            )
        else:
            rewards = [float(reward_fn(sample, t)) for t in trajectories]
        for trajectory, reward in zip(trajectories, rewards, strict=True):
            trajectory.reward = reward

    def _process_pool(self) -> Executor:
        if self._processes is None:
            self._processes = ProcessPoolExecutor(
                max_workers=self._config.tool_processes,
                mp_context=multiprocessing.get_context("spawn"),
            )
        return self._processes

    def _tool_pool(self) -> Executor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self._config.tool_workers, thread_name_prefix="rollout-tools"
            )
        return self._pool


class _CountingEngine:
    """The engine with its outstanding `generate` calls counted (`quiet` is set at zero)."""

    def __init__(self, engine: GenerationEngine) -> None:
        self._inner = engine
        self._calls = 0
        self.quiet = asyncio.Event()
        self.quiet.set()

    @property
    def version(self) -> int:
        return self._inner.version

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        self._calls += 1
        self.quiet.clear()
        try:
            return await self._inner.generate(*args, **kwargs)
        finally:
            self._calls -= 1
            if self._calls == 0:
                self.quiet.set()
