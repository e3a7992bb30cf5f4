"""`SimEngine`: a `rollout_engine.GenerationEngine` whose time comes from a `DecodeModel`.

It never steps token by token. Between two events (a sequence finishes, a request arrives, a
pause, a change of speed) every running sequence advances at the same rate, so the replica
keeps one progress counter `P` (decode iterations done, in token units) and a heap of the
progress at which each sequence ends; it schedules one timer callback on the loop for the next
end. An iteration's cost grows with the context (`per_ctx_token_s`), linearly in `P` between
events, so the time to advance `x` iterations is `(a x + b x^2 / 2) / speed`, solved exactly.

Semantics follow `rollout_engine.testing.FakeEngine` (and vLLM's pause modes):

- `pause("keep")`: running sequences freeze until `resume()`; `pause("abort")`: every request
  returns now with its tokens so far (`finish_reason="abort"`); a continuation (prompt + those
  tokens, `n=1`, the request id of `continue_aborted`) resumes the same response with the same
  target length; `pause("wait")`: returns once nothing runs. While paused, new requests wait.
- Every token carries the version of the weights that produced it (`load_weights`, paused).
- Lengths are drawn from the `LengthModel` with a generator seeded by (seed, prompt id,
  sample index): the same prompt gets the same lengths in every mode (common random numbers).
- `failure_rate`: a request fails (RuntimeError) part-way through, seeded by its id.

All times are the running loop's clock (`looptime` in the simulator).
"""

from __future__ import annotations

import asyncio
import heapq
import math
import random
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_engine import Completion, PauseMode, SamplingConfig

from sim_app.models import DecodeModel, LengthModel

__all__ = ["EngineStats", "SimEngine"]

_EPS = 1e-9


@dataclass
class EngineStats:
    requests: int = 0
    continuations: int = 0
    failures: int = 0
    aborted_sequences: int = 0
    tokens: int = 0  # real tokens decoded (continuations included)
    prefill_tokens: int = 0
    busy_s: float = 0.0  # seconds with at least one sequence decoding (not frozen)
    paused_s: float = 0.0


@dataclass(eq=False, slots=True)
class _Request:
    """A request's `n` sequences, by index: they join the running batch together."""

    request_id: str
    prompt_units: int
    n: int
    future: asyncio.Future[list[Completion]]
    base_keys: list[str]
    targets: list[int]  # tokens (units) each sequence produces in this request
    stops: list[bool]  # ends with EOS (else it runs to max_tokens: "length")
    live: list[bool]  # still decoding (or waiting to)
    results: list[Completion | None]
    remaining: int
    fail_fraction: float | None = None  # fails at this fraction of its longest sequence
    running: bool = False
    ctx_start: float = 0.0  # real context tokens of each sequence when it joined
    p_join: float = 0.0
    mark_index: int = 0  # first version mark after it joined
    version: int = 0  # engine version when it joined

    def alive(self, index: int) -> bool:
        """Heap entry `index` (a sequence, or -1: the failure marker) still counts."""
        if index < 0:
            return self.fail_fraction is not None and not self.future.done()
        return self.live[index]


class SimEngine:
    """A modelled engine replica; see the module docstring."""

    def __init__(
        self,
        decode: DecodeModel,
        lengths: LengthModel,
        *,
        seed: int = 0,
        replica: int = 0,
        token_unit: int = 1,
        failure_rate: float = 0.0,
        initial_version: int = 0,
        on_busy: Callable[[SimEngine, bool], None] | None = None,
        trace: Callable[..., None] | None = None,
    ) -> None:
        if token_unit < 1:
            raise ValueError("token_unit must be >= 1")
        self.decode = decode
        self.lengths = lengths
        self.replica = replica
        self.stats = EngineStats()
        self._seed = seed
        self._unit = token_unit
        self._max_units = max(1, math.ceil(lengths.max_tokens / token_unit))
        self._failure_rate = failure_rate
        self._version = initial_version
        self._on_busy = on_busy
        self._trace = trace
        self._loop: asyncio.AbstractEventLoop | None = None
        # Decode state (see the module docstring).
        self._p = 0.0
        self._t = 0.0
        self._speed = 1.0
        self._stall_until = 0.0
        self._heap: list[tuple[float, int, _Request, int]] = []
        self._counter = 0
        self._n = 0
        self._ctx_sum = 0.0  # sum of ctx_start over running sequences
        self._join_sum = 0.0  # sum of p_join over running sequences
        self._waiting: deque[_Request] = deque()
        self._requests: dict[str, _Request] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._busy = False
        self._busy_since = 0.0
        # Pause state.
        self._paused = False
        self._frozen = False  # keep: running sequences make no progress
        self._paused_at = 0.0
        self._accepting = asyncio.Event()
        self._accepting.set()
        self._drained: asyncio.Future[None] | None = None  # pause("wait")
        self._closed = False
        # Version marks: at progress marks_p[i] the engine switched to marks_v[i].
        self._marks_p: list[float] = []
        self._marks_v: list[int] = []
        # Aborted responses: base key -> (remaining units, stops).
        self._suspended: dict[str, tuple[int, bool]] = {}

    # ------------------------------------------------------------------ protocol

    @property
    def version(self) -> int:
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def running_sequences(self) -> int:
        return self._n

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingConfig,
        n: int = 1,
        multi_modal_data: dict[str, Any] | None = None,
    ) -> list[Completion]:
        if self._closed:
            raise RuntimeError("SimEngine is closed")
        loop = self._get_loop()
        if not self._accepting.is_set():
            await self._accepting.wait()
            if self._closed:
                raise RuntimeError("SimEngine is closed")
        request = self._make_request(request_id, len(prompt_ids), sampling, n, loop)
        self._requests[request_id] = request
        self._waiting.append(request)
        self._admit(self._now())
        self._reschedule()
        try:
            return await request.future
        except asyncio.CancelledError:
            self._drop(request)
            raise

    async def pause(self, mode: PauseMode = "keep", clear_cache: bool = True) -> None:
        if mode not in ("keep", "abort", "wait"):
            raise ValueError(f"unknown pause mode {mode!r}")
        now = self._now()
        self._advance(now)
        self._paused = True
        self._paused_at = now
        self._accepting.clear()
        if mode == "keep":
            self._frozen = True
        elif mode == "abort":
            for request in [*self._requests.values()]:
                self._abort_request(request, now)
        else:  # wait: let everything admitted or queued finish
            if self._requests:
                self._drained = self._get_loop().create_future()
                self._admit(now)
                self._reschedule()
                await self._drained
        self._reschedule()
        self._update_busy(now)
        if mode != "wait" and self.decode.pause_s > 0:
            await asyncio.sleep(self.decode.pause_s)

    async def resume(self) -> None:
        if self.decode.resume_s > 0:
            await asyncio.sleep(self.decode.resume_s)
        now = self._now()
        self._advance(now)
        if self._paused:
            self.stats.paused_s += now - self._paused_at
        self._paused = False
        self._frozen = False
        self._accepting.set()
        self._admit(now)
        self._reschedule()
        self._update_busy(now)

    async def load_weights(self, weights: Any, version: int) -> None:
        if not self._paused:
            raise RuntimeError("pause the engine before loading weights")
        if self.decode.load_s > 0:
            await asyncio.sleep(self.decode.load_s)
        self._advance(self._now())
        self._version = version
        self._marks_p.append(self._p)
        self._marks_v.append(version)
        if self._trace is not None:
            self._trace("load", self._now(), self.replica, version)

    async def abort(self, request_ids: Sequence[str]) -> None:
        now = self._now()
        self._advance(now)
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is not None:
                self._abort_request(request, now)
        self._admit(now)
        self._reschedule()
        self._update_busy(now)
        self._check_drained()

    async def close(self) -> None:
        self._closed = True
        await self.abort(list(self._requests))
        self._accepting.set()

    # ------------------------------------------------------------------ speed

    def set_speed(self, speed: float) -> None:
        """Change the decode speed factor (contention); takes effect now."""
        if speed == self._speed:
            return
        self._advance(self._now())
        self._speed = speed
        self._reschedule()

    @property
    def busy(self) -> bool:
        return self._busy

    # ------------------------------------------------------------------ requests

    def _make_request(
        self,
        request_id: str,
        prompt_units: int,
        sampling: SamplingConfig,
        n: int,
        loop: asyncio.AbstractEventLoop,
    ) -> _Request:
        self.stats.requests += 1
        max_units = min(self._max_units, sampling.max_tokens)
        head, sep, _ = request_id.rpartition(":r")
        if sep and n == 1 and head in self._suspended:
            self.stats.continuations += 1
            remaining, stops = self._suspended.pop(head)
            base_keys = [head]
            targets = [min(remaining, max_units)]
            ends = [stops and remaining <= max_units]
        else:
            prompt_id = request_id.split(":", 1)[0]
            rng = random.Random(zlib.crc32(f"{self._seed}:{prompt_id}".encode()))
            base_keys = [f"{request_id}:{i}" for i in range(n)]
            unit = self._unit
            targets = [
                max(1, -(-tokens // unit))
                for tokens in self.lengths.sample_many(rng, n, self._version)
            ]
            ends = [t < max_units for t in targets]
            targets = [min(t, max_units) for t in targets]
        request = _Request(
            request_id,
            prompt_units,
            n,
            loop.create_future(),
            base_keys,
            targets,
            ends,
            [True] * n,
            [None] * n,
            n,
        )
        if self._failure_rate > 0:
            frng = random.Random(zlib.crc32(f"{self._seed}:fail:{request_id}".encode()))
            if frng.random() < self._failure_rate:
                request.fail_fraction = frng.random()
        return request

    def _admit(self, now: float) -> None:
        """Move waiting requests into the running batch while there is room."""
        if not self._waiting or (self._paused and self._drained is None):
            return
        self._advance(now)
        cap = self.decode.max_num_seqs
        admitted_tokens = 0.0
        heap, p = self._heap, self._p
        while self._waiting:
            request = self._waiting[0]
            if self._n > 0 and self._n + request.n > cap:
                break
            self._waiting.popleft()
            request.running = True
            prompt_tokens = request.prompt_units * self._unit
            admitted_tokens += prompt_tokens
            request.ctx_start = prompt_tokens
            request.p_join = p
            request.mark_index = len(self._marks_p)
            request.version = self._version
            self._n += request.n
            self._ctx_sum += prompt_tokens * request.n
            self._join_sum += p * request.n
            counter = self._counter
            for index, target in enumerate(request.targets):
                counter += 1
                heapq.heappush(heap, (p + target, counter, request, index))
            if request.fail_fraction is not None:
                counter += 1
                end = p + max(1e-6, request.fail_fraction * max(request.targets))
                heapq.heappush(heap, (end, counter, request, -1))
            self._counter = counter
            if self._trace is not None:
                self._trace("admit", now, self.replica, request.request_id, request.n)
        if admitted_tokens:
            self.stats.prefill_tokens += int(admitted_tokens)
            cost = self.decode.prefill_time(admitted_tokens) / self._speed
            if cost > 0:
                self._stall_until = max(self._stall_until, now) + cost
        self._update_busy(now)

    # ------------------------------------------------------------------ progress

    def _get_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def _now(self) -> float:
        return max(self._get_loop().time(), self._t)

    def _coefficients(self) -> tuple[float, float]:
        """(a, b): an iteration (token unit) at progress P + x costs a + b x seconds."""
        d, unit, n = self.decode, self._unit, self._n
        context = self._ctx_sum + unit * (n * self._p - self._join_sum)
        a = unit * (d.iteration_s + d.per_seq_s * n + d.per_ctx_token_s * context)
        b = unit * unit * d.per_ctx_token_s * n
        return a, b

    def _progress_for(self, seconds: float) -> float:
        a, b = self._coefficients()
        c = seconds * self._speed
        if b <= 0:
            return c / a
        return 2.0 * c / (a + math.sqrt(a * a + 2.0 * b * c))

    def _time_for(self, progress: float) -> float:
        a, b = self._coefficients()
        return (a * progress + 0.5 * b * progress * progress) / self._speed

    def _advance(self, now: float) -> None:
        """Bring the progress counter up to `now`."""
        start = self._t
        if now <= start:
            return
        self._t = now
        if self._frozen or self._n == 0:
            return
        if self._stall_until > start:
            start = min(now, self._stall_until)
        if now > start:
            produced = self._progress_for(now - start)
            self._p += produced
            self.stats.tokens += int(produced * self._n * self._unit)

    def _reschedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._frozen or self._n == 0:
            return
        heap = self._heap
        while heap and not heap[0][2].alive(heap[0][3]):
            heapq.heappop(heap)
        if not heap:
            return
        end_p = heap[0][0]
        when = max(self._t, self._stall_until) + self._time_for(max(0.0, end_p - self._p))
        self._timer = self._get_loop().call_at(when, self._on_timer, when, end_p)

    def _on_timer(self, when: float, end_p: float) -> None:
        self._timer = None
        now = max(self._now(), when)
        self._advance(now)
        self._p = max(self._p, end_p)  # the clock's resolution must not leave it short
        heap = self._heap
        while heap and heap[0][0] <= self._p + _EPS:
            _, _, request, index = heapq.heappop(heap)
            if not request.alive(index):
                continue
            if index >= 0:
                self._finish_seq(request, index, now, aborted=False)
            else:
                self._fail_request(request, now)
        self._admit(now)
        self._reschedule()
        self._update_busy(now)
        self._check_drained()

    def _update_busy(self, now: float) -> None:
        busy = self._n > 0 and not self._frozen
        if busy == self._busy:
            return
        self._busy = busy
        if busy:
            self._busy_since = now
        else:
            self.stats.busy_s += now - self._busy_since
        if self._on_busy is not None:
            self._on_busy(self, busy)

    def busy_seconds(self, now: float) -> float:
        return self.stats.busy_s + (now - self._busy_since if self._busy else 0.0)

    # ------------------------------------------------------------------ endings

    def _remove_seq(self, request: _Request, index: int) -> None:
        """Sequence `index` leaves the running batch."""
        request.live[index] = False
        self._n -= 1
        self._ctx_sum -= request.ctx_start
        self._join_sum -= request.p_join
        if self._n == 0:  # no drift of the running sums
            self._ctx_sum = self._join_sum = 0.0

    def _finish_seq(self, request: _Request, index: int, now: float, aborted: bool) -> None:
        target = request.targets[index]
        if aborted:
            produced = min(target, max(0, math.floor(self._p - request.p_join + _EPS)))
            reason = "abort"
        else:
            produced = target
            reason = "stop" if request.stops[index] else "length"
        if request.live[index] and request.running:
            self._remove_seq(request, index)
        request.live[index] = False
        request.results[index] = Completion(
            token_ids=[1] * produced if reason != "stop" else [1] * (produced - 1) + [0],
            logprobs=[-1.0] * produced,
            versions=self._versions(request, produced),
            finish_reason=reason,
        )
        if aborted:
            self.stats.aborted_sequences += 1
            self._suspended[request.base_keys[index]] = (target - produced, request.stops[index])
        request.remaining -= 1
        if request.remaining == 0:
            self._complete(request, now)

    def _versions(self, request: _Request, produced: int) -> list[int]:
        if produced <= 0:
            return []
        marks_p, marks_v = self._marks_p, self._marks_v
        if request.mark_index == len(marks_p):  # no weight load since it joined
            return [request.version] * produced
        out: list[int] = []
        version, done = request.version, 0
        for i in range(request.mark_index, len(marks_p)):
            before = min(produced, max(0, math.floor(marks_p[i] - request.p_join + _EPS)))
            if before > done:
                out.extend([version] * (before - done))
                done = before
            version = marks_v[i]
            if done >= produced:
                break
        if produced > done:
            out.extend([version] * (produced - done))
        return out

    def _complete(self, request: _Request, now: float) -> None:
        self._requests.pop(request.request_id, None)
        if not request.future.done():
            request.future.set_result(request.results)  # type: ignore[arg-type]
        if self._trace is not None:
            self._trace("done", now, self.replica, request.request_id)

    def _abort_request(self, request: _Request, now: float) -> None:
        if request.future.done():
            return
        if not request.running:
            self._waiting.remove(request)
        if not request.running:  # never joined: no tokens
            request.p_join = self._p
            request.mark_index = len(self._marks_p)
            request.version = self._version
        for index in range(request.n):
            if request.results[index] is None:
                self._finish_seq(request, index, now, aborted=True)
        request.fail_fraction = None

    def _fail_request(self, request: _Request, now: float) -> None:
        self.stats.failures += 1
        for index in range(request.n):
            if request.live[index]:
                self._remove_seq(request, index)
        self._requests.pop(request.request_id, None)
        request.fail_fraction = None
        if not request.future.done():
            request.future.set_exception(
                RuntimeError(f"injected engine failure in {request.request_id}")
            )
        if self._trace is not None:
            self._trace("fail", now, self.replica, request.request_id)

    def _drop(self, request: _Request) -> None:
        """The caller cancelled `generate`: forget the request."""
        now = self._now()
        self._advance(now)
        if request in self._waiting:
            self._waiting.remove(request)
        for index in range(request.n):
            if request.live[index] and request.running:
                self._remove_seq(request, index)
            request.live[index] = False
        request.fail_fraction = None
        self._requests.pop(request.request_id, None)
        self._admit(now)
        self._reschedule()
        self._update_busy(now)
        self._check_drained()

    def _check_drained(self) -> None:
        if self._drained is not None and not self._requests:
            self._drained.set_result(None)
            self._drained = None
