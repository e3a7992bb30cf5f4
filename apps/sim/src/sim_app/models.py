"""Cost models of the simulated engine and trainer, and models of response lengths.

Every time is in seconds and every length in real tokens; the simulator may count tokens in
units of `token_unit` real tokens (see `SimConfig`) but the models never see that.

- `DecodeModel`: one engine replica (a vLLM instance, however many GPUs it spans). Decoding is
  continuous batching: in one decode iteration every running sequence gains one token, and the
  iteration takes `iteration_s + per_seq_s * running + per_ctx_token_s * context tokens`. A
  request that joins the batch first costs a prefill (`prefill_s + prefill_per_token_s *
  tokens`, the prompt once for its `n` samples; prompt + tokens so far for a continuation),
  during which the replica's decoding stalls. `pause_s` (modes keep and abort; "wait" costs
  the drain), `load_s`, `resume_s` are the weight push's costs on the engine side. At most
  `max_num_seqs` sequences run; later requests wait.
- `TrainerModel`: a step over a batch costs `step_s + per_token_s * tokens + per_token_sq_s *
  sum(sequence length ** 2)` (tokens: prompt + response of every sample), then `export_s`
  (weights out of the trainer), then the push: `push_s` of transfer before the replicas pause,
  load and resume. `overhead_s` per step and `checkpoint_s` every `checkpoint_every` steps.
  `background_push` is `PPOConfig.background_push`: the next step overlaps the push; pushes
  stay serial.
- `Contention`: where generation and training share a machine (this one: 2 cores): slowdowns
  while both run at once, and of the whole async mode. 1.0 for separate GPUs.
- `LengthModel`: response lengths: a lognormal body (`median`, `sigma`) or an empirical
  `histogram` of (length, weight), plus a fraction `cap_fraction` that runs to `max_tokens`
  (the long tail of truncated responses). `cap_schedule` makes that fraction follow the policy
  version (piecewise linear in the version), e.g. a model that learns to stop.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

__all__ = [
    "Contention",
    "DecodeModel",
    "LengthModel",
    "TrainerModel",
    "from_mapping",
]


@dataclass(frozen=True, slots=True)
class DecodeModel:
    """One engine replica's costs; see the module docstring."""

    iteration_s: float = 1e-3
    per_seq_s: float = 0.0
    per_ctx_token_s: float = 0.0
    prefill_s: float = 0.0
    prefill_per_token_s: float = 0.0
    pause_s: float = 0.0
    load_s: float = 0.0
    resume_s: float = 0.0
    max_num_seqs: int = 256

    def __post_init__(self) -> None:
        _non_negative(self)
        if self.iteration_s <= 0:
            raise ValueError("iteration_s must be > 0")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")

    def prefill_time(self, tokens: float) -> float:
        return self.prefill_s + self.prefill_per_token_s * tokens

    def scaled(self, factor: float) -> DecodeModel:
        """The same replica with decoding and prefill `factor` times slower."""
        return replace(
            self,
            iteration_s=self.iteration_s * factor,
            per_seq_s=self.per_seq_s * factor,
            per_ctx_token_s=self.per_ctx_token_s * factor,
            prefill_s=self.prefill_s * factor,
            prefill_per_token_s=self.prefill_per_token_s * factor,
        )


@dataclass(frozen=True, slots=True)
class TrainerModel:
    """The trainer's costs; see the module docstring."""

    step_s: float = 0.0
    per_token_s: float = 0.0
    per_token_sq_s: float = 0.0
    export_s: float = 0.0
    push_s: float = 0.0
    overhead_s: float = 0.0
    checkpoint_every: int = 0
    checkpoint_s: float = 0.0
    background_push: bool = True
    # Relative spread of a step's time (a normal factor, clipped at +-3 sigma and at 0.1x):
    # the noise of a real machine. 0: every step costs exactly the model.
    jitter: float = 0.0

    def __post_init__(self) -> None:
        _non_negative(self)

    def step_time(self, tokens: float, sq_tokens: float = 0.0) -> float:
        return self.step_s + self.per_token_s * tokens + self.per_token_sq_s * sq_tokens

    def scaled(self, factor: float) -> TrainerModel:
        """The same trainer with every step `factor` times slower (a shared machine)."""
        return replace(
            self,
            step_s=self.step_s * factor,
            per_token_s=self.per_token_s * factor,
            per_token_sq_s=self.per_token_sq_s * factor,
        )


@dataclass(frozen=True, slots=True)
class Contention:
    """Slowdowns where generation and training share hardware (1.0: separate GPUs).

    `trainer_factor` / `engine_factor`: while the engine decodes and the trainer steps at the
    same moment, the step runs that many times slower, and decoding too. `async_trainer_factor`
    / `async_engine_factor`: every step / decode iteration of an async run costs that many
    times the sync run's (what a calibration on a shared machine measures: the async trainer
    runs next to a live rollouter, queue and engine whatever the moment; a fit may find < 1).
    """

    trainer_factor: float = 1.0
    engine_factor: float = 1.0
    async_trainer_factor: float = 1.0
    async_engine_factor: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) <= 0.0:
                raise ValueError(f"Contention.{f.name} is a cost factor: > 0")

    @property
    def enabled(self) -> bool:
        """Overlap contention is modelled (the trainer watches the engines)."""
        return self.trainer_factor != 1.0 or self.engine_factor != 1.0


@dataclass(frozen=True, slots=True)
class LengthModel:
    """Response lengths in real tokens; see the module docstring."""

    kind: Literal["lognormal", "histogram"] = "lognormal"
    median: float = 256.0
    sigma: float = 1.0
    min_tokens: int = 1
    max_tokens: int = 1024
    cap_fraction: float = 0.0
    # (length, weight) pairs; a draw picks a pair by weight (kind "histogram").
    histogram: tuple[tuple[int, float], ...] = ()
    # (version, cap_fraction) pairs, increasing versions; overrides cap_fraction.
    cap_schedule: tuple[tuple[float, float], ...] = ()
    _cumulative: tuple[float, ...] = field(default=(), init=False, repr=False, compare=False)
    _versions: tuple[float, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in ("lognormal", "histogram"):
            raise ValueError(f"kind must be 'lognormal' or 'histogram', got {self.kind!r}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError("need 1 <= min_tokens <= max_tokens")
        if not 0.0 <= self.cap_fraction <= 1.0:
            raise ValueError("cap_fraction must be in [0, 1]")
        if self.kind == "histogram":
            if not self.histogram or any(w < 0 for _, w in self.histogram):
                raise ValueError("histogram needs (length, weight >= 0) pairs")
            total, cumulative = 0.0, []
            for _, weight in self.histogram:
                total += weight
                cumulative.append(total)
            if total <= 0:
                raise ValueError("histogram weights sum to 0")
            object.__setattr__(self, "_cumulative", tuple(c / total for c in cumulative))
        versions = tuple(v for v, _ in self.cap_schedule)
        if list(versions) != sorted(versions):
            raise ValueError("cap_schedule versions must increase")
        object.__setattr__(self, "_versions", versions)

    def cap_at(self, version: float) -> float:
        """The fraction of responses that run to `max_tokens` at a policy version."""
        schedule = self.cap_schedule
        if not schedule:
            return self.cap_fraction
        i = bisect.bisect_right(self._versions, version)
        if i == 0:
            return schedule[0][1]
        if i == len(schedule):
            return schedule[-1][1]
        (v0, c0), (v1, c1) = schedule[i - 1], schedule[i]
        return c0 + (c1 - c0) * (version - v0) / (v1 - v0)

    def sample(self, rng: random.Random, version: float = 0.0) -> int:
        """One response length (tokens, EOS included when it stops before `max_tokens`)."""
        if rng.random() < self.cap_at(version):
            return self.max_tokens
        if self.kind == "histogram":
            index = bisect.bisect_left(self._cumulative, rng.random())
            length = self.histogram[min(index, len(self.histogram) - 1)][0]
        else:
            length = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return max(self.min_tokens, min(self.max_tokens, length))

    def sample_many(self, rng: random.Random, n: int, version: float = 0.0) -> list[int]:
        """`n` draws of `sample` (the same stream), cheaper."""
        cap, top = self.cap_at(version), self.max_tokens
        low = self.min_tokens
        draw = rng.random
        out = []
        if self.kind == "histogram":
            cumulative, histogram, last = self._cumulative, self.histogram, len(self.histogram) - 1
            for _ in range(n):
                if draw() < cap:
                    out.append(top)
                    continue
                length = histogram[min(bisect.bisect_left(cumulative, draw()), last)][0]
                out.append(max(low, min(top, length)))
            return out
        mu, sigma, lognormal = math.log(self.median), self.sigma, rng.lognormvariate
        for _ in range(n):
            if draw() < cap:
                out.append(top)
                continue
            out.append(max(low, min(top, round(lognormal(mu, sigma)))))
        return out

    def mean(self, version: float = 0.0, draws: int = 20000, seed: int = 0) -> float:
        """Monte-Carlo mean length (for reports and fits)."""
        rng = random.Random(seed)
        return sum(self.sample(rng, version) for _ in range(draws)) / draws


def _non_negative(obj: Any) -> None:
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"{type(obj).__name__}.{f.name} must be >= 0, got {value}")


def from_mapping(cls: type[Any], data: dict[str, Any], base: Any = None) -> Any:
    """`cls(**data)` (or `replace(base, **data)`) with unknown keys refused by name; lists
    become tuples (TOML has no tuples)."""
    known = {f.name for f in fields(cls) if f.init}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown key(s) {unknown}; known: {sorted(known)}")
    values = {k: _tupled(v) for k, v in data.items()}
    return replace(base, **values) if base is not None else cls(**values)


def _tupled(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tupled(v) for v in value)
    return value
