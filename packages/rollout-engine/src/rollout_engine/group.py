"""One GRPO group: preprocess, generate `n` responses (continuing aborted ones), score.

The rollouter runs one `GroupRunner.run(job)` per admitted prompt as an asyncio task; the
staleness check and the delivery to the sink live in `rollout_engine.delivery`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from rollout_engine.continuation import PartialResponse, continue_aborted
from rollout_engine.snapshot import GroupSnapshot
from rollout_engine.types import (
    Completion,
    GenerationEngine,
    MultiModalPreprocessor,
    MultiModalRef,
    PromptSample,
    RewardFn,
    SamplingConfig,
    Timings,
    Trajectory,
)

__all__ = ["GroupJob", "GroupRunner", "MultiModalInputs", "image_sources", "request_seed"]

# Request seeds stay below 2**31 (numpy's and some samplers' limit) with room for vLLM's
# per-response offset (`seed + response index` for a request of n samples).
_SEED_SPACE = 2**31 - 2**16


def request_seed(seed: int, prompt_id: str) -> int:
    """The sampling seed of the group of `prompt_id` in a run seeded `seed`: the same for
    the same pair in every run and process (unlike `hash`), unrelated across prompts."""
    digest = hashlib.blake2b(f"{seed}:{prompt_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % _SEED_SPACE


def _seeded(sampling: SamplingConfig, prompt_id: str, offset: int = 0) -> SamplingConfig:
    """`sampling` with its seed (if set) turned into this group's (+ `offset`, a response
    index): a fixed seed repeats a run's samples without every prompt sharing one stream."""
    if sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=request_seed(sampling.seed, prompt_id) + offset)


@dataclass(frozen=True, slots=True)
class GroupJob:
    """An admitted prompt: what its task needs and what a failure record reports."""

    sample: PromptSample
    group_id: str
    version: int  # rollouter version at admission
    admitted_wall: float  # time.time(), for Timings
    admitted_at: float  # rollouter clock, for durations
    # A group restored from a snapshot: its responses so far (unfinished ones continue).
    restored: tuple[PartialResponse, ...] | None = None

    @classmethod
    def admit(
        cls, item: PromptSample | GroupSnapshot, *, index: int, version: int, admitted_at: float
    ) -> GroupJob:
        """The job of a new prompt (its group id numbered by `index`, the admissions so far)
        or of a restored group (its id kept, its responses continued)."""
        if isinstance(item, GroupSnapshot):
            sample, group_id = item.sample, item.group_id
            restored = tuple(r.to_partial() for r in item.responses) or None
        else:
            sample, group_id, restored = item, f"{item.prompt_id}:{index}", None
        return cls(
            sample=sample,
            group_id=group_id,
            version=version,
            admitted_wall=time.time(),
            admitted_at=admitted_at,
            restored=restored,
        )


@dataclass(frozen=True, slots=True)
class MultiModalInputs:
    engine_data: dict[str, Any] | None = None
    ref: MultiModalRef | None = None


class GroupRunner:
    """Turns a `GroupJob` into `n` scored trajectories.

    `wait_until_resumed` blocks while a weight push is in progress (continuations wait on
    it); `on_resubmit` is awaited once per continuation request (for the `resumed` count).
    The reward function runs in `reward_executor` (off the event loop: rewards often decode
    tokens or run a verifier) unless it is marked `reward_fn.blocking = False`, which runs it
    on the loop (for trivially cheap functions; it saves one thread hop per group).

    For snapshots (`rollout_engine.snapshot`): `responses_of(group_id)` is the live list of a
    group's responses once its first engine call returned (continuations extend them in
    place), and `wait_engine_quiet()` returns when no engine call is outstanding. A group's
    first request also waits for `wait_until_resumed`, so nothing is sent into an engine
    paused for a weight push or a snapshot.
    """

    def __init__(
        self,
        engine: GenerationEngine,
        reward_fn: RewardFn,
        *,
        group_size: int,
        sampling: SamplingConfig,
        preprocessor: MultiModalPreprocessor | None,
        wait_until_resumed: Callable[[], Awaitable[Any]],
        on_resubmit: Callable[[], Awaitable[None]],
        clock: Callable[[], float],
        reward_executor: Callable[[], Executor],
    ) -> None:
        self._engine = engine
        self._reward_fn = reward_fn
        self._group_size = group_size
        self._sampling = sampling
        self._preprocessor = preprocessor
        self._wait_until_resumed = wait_until_resumed
        self._on_resubmit = on_resubmit
        self._clock = clock
        self._reward_executor = reward_executor
        self._responses: dict[str, list[PartialResponse]] = {}
        self._engine_calls = 0
        self._engine_quiet = asyncio.Event()
        self._engine_quiet.set()
        self._counted = _CountedEngine(self)

    def responses_of(self, group_id: str) -> list[PartialResponse] | None:
        """The group's responses so far (live objects), or None before its first engine call
        returned."""
        return self._responses.get(group_id)

    def forget(self, group_id: str) -> None:
        """Drop the group's responses (its task ended)."""
        self._responses.pop(group_id, None)

    async def wait_engine_quiet(self) -> None:
        """Return once no engine call of any group is outstanding."""
        await self._engine_quiet.wait()

    async def _engine_generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingConfig,
        n: int = 1,
        multi_modal_data: dict[str, Any] | None = None,
    ) -> list[Completion]:
        self._engine_calls += 1
        self._engine_quiet.clear()
        try:
            return await self._engine.generate(
                request_id, prompt_ids, sampling, n=n, multi_modal_data=multi_modal_data
            )
        finally:
            self._engine_calls -= 1
            if self._engine_calls == 0:
                self._engine_quiet.set()

    async def run(self, job: GroupJob) -> list[Trajectory]:
        multimodal = await self._prepare_multimodal(job.sample)
        responses = await self._generate(job, multimodal.engine_data)
        trajectories = self._trajectories(job, responses, multimodal.ref)
        await self._score(job.sample, trajectories)
        return trajectories

    async def _prepare_multimodal(self, sample: PromptSample) -> MultiModalInputs:
        if sample.messages is None:
            return MultiModalInputs()
        if self._preprocessor is None:
            raise ValueError(f"prompt {sample.prompt_id} has messages but no preprocessor is set")
        # The preprocessor decodes images in its own bounded executor; result[0] = images.
        result = await self._preprocessor.process_vision_info(sample.messages)
        images = result[0]
        ref = MultiModalRef(
            messages_json=json.dumps(sample.messages, default=str),
            image_sources=image_sources(sample.messages),
        )
        return MultiModalInputs(engine_data={"image": images} if images else None, ref=ref)

    async def _generate(
        self, job: GroupJob, multi_modal_data: dict[str, Any] | None
    ) -> list[PartialResponse]:
        prompt_ids = list(job.sample.prompt_token_ids)
        sampling = _seeded(self._sampling, job.sample.prompt_id)
        if job.restored:
            responses = list(job.restored)
        else:
            await self._wait_until_resumed()
            completions = await self._engine_generate(
                job.group_id,
                prompt_ids,
                sampling,
                n=self._group_size,
                multi_modal_data=multi_modal_data,
            )
            if len(completions) != self._group_size:
                raise RuntimeError(
                    f"engine returned {len(completions)} completions for n={self._group_size}"
                )
            responses = [PartialResponse.from_completion(c) for c in completions]
        self._responses[job.group_id] = responses
        continuations = [
            continue_aborted(
                self._counted,
                response,
                request_id=f"{job.group_id}:{index}",
                prompt_ids=prompt_ids,
                # One stream per response, as vLLM seeds the samples of an n-sample request.
                sampling=_seeded(self._sampling, job.sample.prompt_id, index),
                multi_modal_data=multi_modal_data,
                wait_until_resumed=self._wait_until_resumed,
                on_resubmit=self._on_resubmit,
            )
            for index, response in enumerate(responses)
            if response.aborted
        ]
        if continuations:
            # Let every continuation finish, then fail the group on the first error.
            results = await asyncio.gather(*continuations, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
        return responses

    def _trajectories(
        self, job: GroupJob, responses: list[PartialResponse], ref: MultiModalRef | None
    ) -> list[Trajectory]:
        finished_wall = time.time()
        generation_s = self._clock() - job.admitted_at
        return [
            Trajectory(
                response_id=f"{job.group_id}:{index}",
                group_id=job.group_id,
                prompt_id=job.sample.prompt_id,
                prompt_token_ids=list(job.sample.prompt_token_ids),
                response_ids=response.token_ids,
                behaviour_logprobs=response.logprobs,
                token_versions=response.versions,
                finish_reason=response.finish_reason,
                timings=Timings(
                    admitted_at=job.admitted_wall,
                    finished_at=finished_wall,
                    generation_s=generation_s,
                ),
                multimodal=ref,
                num_resumes=response.resumes,
            )
            for index, response in enumerate(responses)
        ]

    async def _score(self, sample: PromptSample, trajectories: list[Trajectory]) -> None:
        if getattr(self._reward_fn, "blocking", True):
            loop = asyncio.get_running_loop()
            rewards = await loop.run_in_executor(
                self._reward_executor(), _score_all, self._reward_fn, sample, trajectories
            )
        else:
            rewards = _score_all(self._reward_fn, sample, trajectories)
        for trajectory, reward in zip(trajectories, rewards, strict=True):
            trajectory.reward = reward


class _CountedEngine:
    """The engine as continuations see it: `generate` goes through the runner's counter."""

    def __init__(self, runner: GroupRunner) -> None:
        self._runner = runner

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingConfig,
        n: int = 1,
        multi_modal_data: dict[str, Any] | None = None,
    ) -> list[Completion]:
        return await self._runner._engine_generate(
            request_id, prompt_ids, sampling, n=n, multi_modal_data=multi_modal_data
        )


def _score_all(
    reward_fn: RewardFn, sample: PromptSample, trajectories: list[Trajectory]
) -> list[float]:
    return [float(reward_fn(sample, trajectory)) for trajectory in trajectories]


def image_sources(messages: list[dict[str, Any]]) -> list[str]:
    """The `image` entries (paths/URIs) of qwen-vl-utils style chat messages."""
    sources: list[str] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for item in content:
            if isinstance(item, dict) and isinstance(item.get("image"), str):
                sources.append(item["image"])
    return sources
