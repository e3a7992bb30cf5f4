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

Images. An observation may carry images (`StepResult.images`, or an `Observation` from
`reset`), and the prompt may be chat `messages` with images (as for single-turn groups): they
go through the rollouter's `preprocessor` (e.g. `mm_preprocess.VisionPreprocessor`, which
decodes in its own bounded thread pool, never on the loop) when the observation is appended,
and every later turn's engine request carries all the episode's images so far, in order, as
`multi_modal_data={"image": [...]}` (an aborted turn's continuation too). The observation's
tokens must hold each image's placeholder, as the prompt's do (the rollouter never looks
inside tokens). The trajectory's `MultiModalRef` names every image of the episode in that
order: `messages_json` is the prompt's messages (if any) followed by one user message per
observation with images (its image elements only; the observation's text is in the tokens),
and `image_sources` lists them, so the trainer decodes the same images again, in order. An
image with no preprocessor is a `ValueError`: the group fails and is counted, like any failure.

Failure. An exception from the factory, `reset`, `step`, `close`, the preprocessor or the
engine fails the episode; the group's other episodes are cancelled and the group becomes one
failed sample (counted by error type by the rollouter), as any group failure does.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import inspect
import json
import logging
import multiprocessing
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from rollout_engine.continuation import PartialResponse, continue_aborted
from rollout_engine.group import GroupJob, image_sources
from rollout_engine.types import (
    GenerationEngine,
    MultiModalPreprocessor,
    MultiModalRef,
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
    "ImageRef",
    "ModelTurn",
    "Observation",
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


ImageRef = str | Mapping[str, Any]
"""One image of an observation, as a qwen-vl-utils chat message names it: a path or URI
(`"/data/a.png"`, `"file:///data/a.png"`, a data URI; http(s) if the preprocessor allows
remote images), or a whole content element with a string `"image"` and per-image options
(e.g. `{"image": "/data/a.png", "resized_height": 56, "resized_width": 56}`). References,
not pixels: the trajectory carries them to the trainer, which decodes them again."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """The environment's answer to one turn.

    `observation` is appended to the sequence (not trained on) before the next turn unless
    `done`; `reward` adds to the episode's reward (`Trajectory.reward`). `images` are the
    observation's images, in the order of their placeholders in `observation` (which must
    hold each image's placeholder tokens, as a VLM prompt does); they need the rollouter's
    `preprocessor`.
    """

    observation: Sequence[int] = ()
    reward: float = 0.0
    done: bool = False
    images: Sequence[ImageRef] = ()


@dataclass(frozen=True, slots=True)
class Observation:
    """A first observation with images: what `reset` returns instead of plain tokens when it
    shows the model images (same rules as `StepResult.images`)."""

    token_ids: Sequence[int] = ()
    images: Sequence[ImageRef] = ()


@runtime_checkable
class Environment(Protocol):
    """An async environment, one instance per episode. Must not block its loop: hand blocking
    calls to `run_blocking`. An optional `close()` (sync or async) runs when the episode ends,
    however it ends."""

    async def reset(self, sample: PromptSample) -> Sequence[int] | Observation:
        """The first observation's tokens (appended to the prompt; may be empty), or an
        `Observation` with images."""
        ...

    async def step(self, turn: ModelTurn) -> StepResult: ...


@runtime_checkable
class SyncEnvironment(Protocol):
    """A plain (blocking) environment: the runner calls its methods in the tool pool."""

    def reset(self, sample: PromptSample) -> Sequence[int] | Observation: ...

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
    # Every image of the episode in placeholder order (prompt first): the decoded images for
    # the engine, and the chat messages naming them for the trajectory's MultiModalRef.
    images: list[Any] = field(default_factory=list)
    image_messages: list[dict[str, Any]] = field(default_factory=list)
    has_multimodal: bool = False  # a messages prompt or an image observation

    @property
    def multi_modal_data(self) -> dict[str, Any] | None:
        """What the next engine request carries (a copy: later images are not added to it)."""
        return {"image": list(self.images)} if self.images else None

    def multimodal_ref(self) -> MultiModalRef | None:
        if not self.has_multimodal:
            return None
        return MultiModalRef(
            messages_json=json.dumps(self.image_messages, default=str),
            image_sources=image_sources(self.image_messages),
        )

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

    `preprocessor` (the rollouter's) decodes the images of chat-message prompts and of
    observations, in its own bounded pool; None: an image fails its group.

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
        preprocessor: MultiModalPreprocessor | None = None,
    ) -> None:
        self._engine = _CountingEngine(engine)
        self._preprocessor = preprocessor
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
        # The prompt's images are decoded once for the whole group (as for single-turn).
        prompt_images = await self._prompt_images(job.sample)
        # This task's context: its episodes (and their run_blocking calls) inherit it.
        _TOOL_POOL.set(self._tool_pool())
        if self._config.tool_processes > 0:
            _PROCESS_POOL.set(self._process_pool)
        members = [
            asyncio.create_task(
                self._episode(job, index, prompt_images), name=f"episode:{job.group_id}:{index}"
            )
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

    async def _episode(
        self, job: GroupJob, index: int, prompt_images: list[Any] | None
    ) -> Trajectory:
        env = self._environment(job.sample)
        try:
            episode = await self._play(job, index, env, prompt_images)
        except BaseException:
            await self._close(env, quiet=True)  # the episode's own error wins
            raise
        await self._close(env, quiet=False)
        return self._trajectory(job, index, episode)

    async def _play(
        self,
        job: GroupJob,
        index: int,
        env: Environment | SyncEnvironment,
        prompt_images: list[Any] | None,
    ) -> _Episode:
        config = self._config
        first = await self._call(env.reset, job.sample)
        first_images: Sequence[ImageRef] = ()
        if isinstance(first, Observation):
            first, first_images = first.token_ids, first.images
        episode = _Episode(prompt_ids=[*job.sample.prompt_token_ids, *first])
        if prompt_images is not None:
            assert job.sample.messages is not None
            episode.images.extend(prompt_images)
            episode.image_messages.extend(job.sample.messages)
            episode.has_multimodal = True
        await self._add_images(episode, job, first_images, "the first observation")
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
                episode.multi_modal_data,
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
            await self._add_images(
                episode, job, result.images, f"the observation after turn {turn}"
            )
            # Read after the images' await: the version is never older than the turn's.
            episode.add_observation(observation, self._engine.version)
        return episode

    async def _prompt_images(self, sample: PromptSample) -> list[Any] | None:
        """The decoded images of a chat-message prompt (None for a token prompt)."""
        if sample.messages is None:
            return None
        return await self._decode(sample.messages, f"prompt {sample.prompt_id} has messages")

    async def _add_images(
        self, episode: _Episode, job: GroupJob, images: Sequence[ImageRef], what: str
    ) -> None:
        """Decode an observation's images (in the preprocessor's pool) and add them to the
        episode: to every later engine request and to the trajectory's MultiModalRef."""
        if not images:
            return
        message = {"role": "user", "content": [_image_element(image) for image in images]}
        decoded = await self._decode(
            [message], f"prompt {job.sample.prompt_id}: {what} has {len(images)} image(s)"
        )
        if len(decoded) != len(images):
            raise ValueError(
                f"prompt {job.sample.prompt_id}: the preprocessor returned {len(decoded)} "
                f"images for the {len(images)} of {what}"
            )
        episode.images.extend(decoded)
        episode.image_messages.append(message)
        episode.has_multimodal = True

    async def _decode(self, messages: list[dict[str, Any]], what: str) -> list[Any]:
        """`preprocessor.process_vision_info(messages)` images (result[0]); it decodes in its
        own bounded thread pool, never on this loop."""
        if self._preprocessor is None:
            raise ValueError(
                f"{what} but the rollouter has no preprocessor: pass "
                "Rollouter(preprocessor=...), e.g. an mm_preprocess.VisionPreprocessor"
            )
        result = await self._preprocessor.process_vision_info(messages)
        return list(result[0] or [])

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
        self,
        request_id: str,
        context: list[int],
        sampling: SamplingConfig,
        multi_modal_data: dict[str, Any] | None,
    ) -> PartialResponse:
        """One turn; an aborted request (weight push, abort mode) continues to the end."""
        [completion] = await self._engine.generate(
            request_id, context, sampling, n=1, multi_modal_data=multi_modal_data
        )
        response = PartialResponse.from_completion(completion)
        if response.aborted:
            await continue_aborted(
                self._engine,
                response,
                request_id=request_id,
                prompt_ids=context,
                sampling=sampling,
                multi_modal_data=multi_modal_data,
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
            prompt_token_ids=episode.prompt_ids,
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
            multimodal=episode.multimodal_ref(),
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


def _image_element(image: ImageRef) -> dict[str, Any]:
    """An `ImageRef` as a qwen-vl-utils image content element."""
    if isinstance(image, str):
        return {"type": "image", "image": image}
    if isinstance(image, Mapping) and isinstance(image.get("image"), str):
        return {"type": "image", **image}
    raise TypeError(
        "an observation image is a path/URI string or a mapping with a string 'image' "
        f"(a reference the trainer can decode again), got {image!r:.80}"
    )


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
