"""Test doubles for scheduling tests and benchmarks. NOT an inference engine.

`FakeEngine` implements the `GenerationEngine` protocol without a model: it produces random
tokens on a real asyncio clock so that the rollouter's scheduling (dispatch, drain, pause,
abort, weight versions, failures) can be tested and benchmarked quickly and
deterministically. Use it only in tests and benchmarks; the app always runs a real engine.

Behaviour:

- Response lengths are seeded per (seed, prompt, response index): a lognormal body
  (`median_length`, `length_sigma`) plus a long tail: a `long_tail_fraction` of responses
  run to `max_tokens`. `fixed_length` overrides both. A response that ends before
  `max_tokens` ends with `eos_token_id` and finish_reason "stop", otherwise "length".
- Time: every decoding step sleeps `time_per_token_s * tokens_per_step` (real
  `asyncio.sleep`; 0 gives a fast "virtual-ish" clock of one loop turn per step) and then
  appends `tokens_per_step` tokens to every unfinished response of every running request.
- Versions: each token is stamped with the engine version at the step that produced it;
  `load_weights` (only while paused) sets the version.
- pause("keep"): running requests stop producing until `resume()`; pause("abort"): running
  requests return at once with finish_reason "abort" and their tokens so far; pause("wait"):
  returns when running requests have finished. While paused, new requests wait for resume.
- A continuation (`prompt + tokens so far` of an aborted response, n=1) continues the same
  response: same target length, same token stream, so totals do not depend on abort timing.
- Failures: `fail_request(request_id)` may return an exception to raise, and
  `failure_rate` (seeded per request id) raises one of `failure_types`; the exception is
  raised after `fail_after_steps` decoding steps.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import zlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rollout_engine.types import Completion, PauseMode, PromptSample, SamplingConfig, Trajectory

__all__ = [
    "FakeEngine",
    "FakeEngineConfig",
    "GenerateCall",
    "ListSink",
    "burn_cpu",
    "make_prompts",
    "wait_until",
]

_NO_EOS = 1 << 60  # a target length that only max_tokens can end


@dataclass(frozen=True, slots=True)
class FakeEngineConfig:
    """Knobs of the fake; see the module docstring."""

    seed: int = 0
    time_per_token_s: float = 0.0
    tokens_per_step: int = 1
    median_length: float = 12.0
    length_sigma: float = 0.75
    long_tail_fraction: float = 0.0
    fixed_length: int | None = None
    vocab_size: int = 64
    eos_token_id: int = 0
    failure_rate: float = 0.0
    failure_types: tuple[type[BaseException], ...] = (RuntimeError,)
    fail_after_steps: int = 1
    load_delay_s: float = 0.0
    initial_version: int = 0

    def __post_init__(self) -> None:
        if self.tokens_per_step < 1:
            raise ValueError("tokens_per_step must be >= 1")
        if self.vocab_size < 2:
            raise ValueError("vocab_size must be >= 2 (one id is EOS)")


class GenerateCall(msgspec.Struct, kw_only=True):
    """What the fake received, and when (`time.monotonic()`)."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    n: int
    multi_modal_data: dict[str, Any] | None
    received_at: float


@dataclass
class _Response:
    """One response being decoded: a target length and its own token stream."""

    target: int  # tokens until (and including) EOS; _NO_EOS never stops on its own
    rng: random.Random
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class _Request:
    request_id: str
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


class FakeEngine:
    """A deterministic, seeded fake `GenerationEngine` for tests and benchmarks only."""

    def __init__(
        self,
        config: FakeEngineConfig | None = None,
        *,
        fail_request: Callable[[str], BaseException | None] | None = None,
    ) -> None:
        self.config = config if config is not None else FakeEngineConfig()
        self._fail_request = fail_request
        self._version = self.config.initial_version
        self._accepting = asyncio.Event()  # new requests may start
        self._accepting.set()
        self._stepping = asyncio.Event()  # running requests may produce (cleared by keep)
        self._stepping.set()
        self._idle = asyncio.Event()  # no running request
        self._idle.set()
        self._paused = False
        self._closed = False
        self._running: dict[str, _Request] = {}
        # Aborted responses by their full context (prompt + tokens), for continuations.
        self._suspended: dict[tuple[int, ...], _Response] = {}
        self.calls: list[GenerateCall] = []
        self.pause_modes: list[PauseMode] = []
        self.loaded_versions: list[int] = []
        self.tokens_generated = 0

    # ------------------------------------------------------------------ protocol

    @property
    def version(self) -> int:
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def running_request_ids(self) -> list[str]:
        return list(self._running)

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingConfig,
        n: int = 1,
        multi_modal_data: dict[str, Any] | None = None,
    ) -> list[Completion]:
        if self._closed:
            raise RuntimeError("FakeEngine is closed")
        prompt = list(prompt_ids)
        self.calls.append(
            GenerateCall(
                request_id=request_id,
                prompt_ids=prompt,
                max_tokens=sampling.max_tokens,
                n=n,
                multi_modal_data=multi_modal_data,
                received_at=time.monotonic(),
            )
        )
        failure = self._failure_for(request_id)
        await self._accepting.wait()
        request = _Request(request_id)
        self._running[request_id] = request
        self._idle.clear()
        try:
            responses = [self._start_response(prompt, i, sampling) for i in range(n)]
            await self._decode(request, responses, sampling, failure)
            return [self._finish(prompt, r, request) for r in responses]
        finally:
            self._running.pop(request_id, None)
            if not self._running:
                self._idle.set()

    async def pause(self, mode: PauseMode = "keep", clear_cache: bool = True) -> None:
        if mode not in ("keep", "abort", "wait"):
            raise ValueError(f"unknown pause mode {mode!r}")
        self.pause_modes.append(mode)
        self._paused = True
        self._accepting.clear()
        if mode == "keep":
            self._stepping.clear()
            return
        if mode == "abort":
            for request in self._running.values():
                request.aborted.set()
        await self._idle.wait()

    async def resume(self) -> None:
        self._paused = False
        self._stepping.set()
        self._accepting.set()

    async def load_weights(self, weights: Any, version: int) -> None:
        if not self._paused:
            raise RuntimeError("pause the engine before loading weights")
        if self.config.load_delay_s > 0:
            await asyncio.sleep(self.config.load_delay_s)
        self._version = version
        self.loaded_versions.append(version)

    async def abort(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            request = self._running.get(request_id)
            if request is not None:
                request.aborted.set()

    async def close(self) -> None:
        self._closed = True
        await self.abort(list(self._running))
        self._stepping.set()
        self._accepting.set()

    # ------------------------------------------------------------------ decoding

    async def _decode(
        self,
        request: _Request,
        responses: list[_Response],
        sampling: SamplingConfig,
        failure: BaseException | None,
    ) -> None:
        step_s = self.config.time_per_token_s * self.config.tokens_per_step
        steps = 0
        while any(r.finish_reason is None for r in responses):
            if not self._stepping.is_set():
                await _first_of(self._stepping, request.aborted)
            if request.aborted.is_set():
                return
            await asyncio.sleep(step_s)
            if request.aborted.is_set():
                return
            if not self._stepping.is_set():
                continue  # paused (keep) during the sleep: produce nothing
            for response in responses:
                self._step(response, sampling)
            steps += 1
            if failure is not None and steps >= self.config.fail_after_steps:
                raise failure
        if failure is not None:
            raise failure

    def _step(self, response: _Response, sampling: SamplingConfig) -> None:
        for _ in range(self.config.tokens_per_step):
            if response.finish_reason is not None:
                return
            if len(response.token_ids) >= sampling.max_tokens:
                response.finish_reason = "length"
                return
            is_eos = len(response.token_ids) + 1 >= response.target and not sampling.ignore_eos
            token = self.config.eos_token_id if is_eos else self._token(response.rng)
            response.token_ids.append(token)
            response.logprobs.append(-0.05 - 3.0 * response.rng.random())
            response.versions.append(self._version)
            self.tokens_generated += 1
            if is_eos:
                response.finish_reason = "stop"
            elif len(response.token_ids) >= sampling.max_tokens:
                response.finish_reason = "length"

    def _token(self, rng: random.Random) -> int:
        token = rng.randrange(self.config.vocab_size - 1)
        return token + 1 if token >= self.config.eos_token_id else token

    def _start_response(self, prompt: list[int], index: int, sampling: SamplingConfig) -> _Response:
        suspended = self._suspended.pop(tuple(prompt), None) if index == 0 else None
        if suspended is not None:
            # Continue the aborted response: same remaining length, same token stream.
            remaining = suspended.target - len(suspended.token_ids)
            return _Response(target=remaining, rng=suspended.rng)
        key = f"{self.config.seed}:{_digest(prompt)}:{len(prompt)}:{index}"
        rng = random.Random(key)
        return _Response(target=self._target_length(rng), rng=random.Random(key + ":tokens"))

    def _target_length(self, rng: random.Random) -> int:
        config = self.config
        if config.fixed_length is not None:
            return config.fixed_length
        if rng.random() < config.long_tail_fraction:
            return _NO_EOS
        draw = rng.lognormvariate(math.log(config.median_length), config.length_sigma)
        return max(1, round(draw))

    def _finish(self, prompt: list[int], response: _Response, request: _Request) -> Completion:
        reason = response.finish_reason
        if reason is None:  # aborted before it finished
            reason = "abort"
            self._suspended[(*prompt, *response.token_ids)] = response
        return Completion(
            token_ids=response.token_ids,
            logprobs=response.logprobs,
            versions=response.versions,
            finish_reason=reason,
        )

    def _failure_for(self, request_id: str) -> BaseException | None:
        if self._fail_request is not None:
            failure = self._fail_request(request_id)
            if failure is not None:
                return failure
        if self.config.failure_rate <= 0:
            return None
        rng = random.Random(f"{self.config.seed}:fail:{request_id}")
        if rng.random() >= self.config.failure_rate:
            return None
        error_type = self.config.failure_types[rng.randrange(len(self.config.failure_types))]
        return error_type(f"injected failure in {request_id}")


class ListSink:
    """An in-memory `TrajectorySink` for tests and benchmarks.

    `on_put(group)` (optional) runs before the group is stored, e.g. to check invariants.
    """

    def __init__(self, on_put: Callable[[list[Trajectory]], None] | None = None) -> None:
        self.groups: list[list[Trajectory]] = []
        self._on_put = on_put

    async def put(self, group: list[Trajectory]) -> None:
        if self._on_put is not None:
            self._on_put(group)
        self.groups.append(group)

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for group in self.groups for t in group]


def make_prompts(count: int, prefix: str = "p", length: int = 4) -> list[PromptSample]:
    """`count` distinct prompts with ids `{prefix}{i}` and `length` token ids each."""
    return [
        PromptSample(
            prompt_id=f"{prefix}{i}",
            prompt_token_ids=[1 + (i * 7 + j) % 997 for j in range(length)],
        )
        for i in range(count)
    ]


async def wait_until(
    condition: Callable[[], bool], within_s: float = 5.0, interval_s: float = 0.001
) -> None:
    """Poll `condition` on the event loop; TimeoutError if it stays false for `within_s`."""
    async with asyncio.timeout(within_s):
        while not condition():  # noqa: ASYNC110 - polling arbitrary state is the point
            await asyncio.sleep(interval_s)


async def _first_of(*events: asyncio.Event) -> None:
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


def burn_cpu(seconds: float) -> int:
    """Pure-Python busy work (it holds the GIL) for `seconds` of the calling thread's CPU
    time: a stand-in for a CPU-heavy tool. Module-level, so `run_in_process` can run it."""
    start = time.thread_time()
    x = 0
    while time.thread_time() - start < seconds:
        for i in range(1000):
            x = (x * 31 + i) % 1_000_003
    return x


def _digest(tokens: list[int]) -> int:
    return zlib.crc32(array("q", tokens).tobytes())
