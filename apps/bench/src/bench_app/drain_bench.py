"""Resume-to-next-dispatch latency after a weight push, while long-tail requests are in flight.

Compared in the same run, on the same `FakeEngine` seeds (a fake engine: this benchmark is
about scheduling, not generation):

- `Rollouter` (rollout_engine): its drain loop waits on `{active tasks} | {resume}` with
  FIRST_COMPLETED, so `on_weights()` ends the wait at once.
- `WaitForAllDrain` (written here, the baseline): a minimal rollouter loop that, when it is
  paused or out of admission budget, awaits `asyncio.gather(*in_flight)` before admitting
  more, i.e. it waits for the slowest in-flight sequence.

Set-up per trial: lognormal response lengths (median 12 tokens at 2 ms/token) with 5% of
responses running to 300 tokens (0.6 s), groups of 4, staleness k = 0 with 8 groups per
version (so the budget runs out a few tens of ms after each push), a weight push
(pause keep -> load -> resume -> on_weights) every 0.3 s. A push is measured when, at that
moment, the budget is exhausted and at least one group is still generating (the long tail).
Latency = engine receives the next new group's `generate` - the push's `on_weights`.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout_engine import (
    Completion,
    PromptSample,
    RolloutConfig,
    Rollouter,
    SamplingConfig,
    Timings,
    Trajectory,
)
from rollout_engine.admission import AdmissionPolicy
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink, make_prompts

from bench_app.report import BenchReport

__all__ = ["WaitForAllDrain", "run"]

TARGET_RATIO = 100.0  # baseline latency / Rollouter latency (p50)
PUSH_INTERVAL_S = 0.3
ROLLOUT = RolloutConfig(
    group_size=4,
    max_concurrency=16,
    groups_per_step=8,
    sync_every=1,
    max_staleness=0,
    pause_mode="keep",
    sampling=SamplingConfig(max_tokens=300),
)


def _engine_config(seed: int) -> FakeEngineConfig:
    return FakeEngineConfig(
        seed=seed,
        time_per_token_s=0.002,
        median_length=12,
        length_sigma=0.6,
        long_tail_fraction=0.05,
    )


class WaitForAllDrain:
    """Baseline: on pause or budget exhaustion, wait for *every* in-flight group first.

    Same engine calls, same admission budget and weight-push sequence as `Rollouter`; only
    the drain differs.
    """

    def __init__(self, engine: FakeEngine, prompts: Iterator[PromptSample], sink: ListSink) -> None:
        self._engine = engine
        self._prompts = prompts
        self._sink = sink
        self._config = ROLLOUT
        self._policy = AdmissionPolicy(ROLLOUT.max_staleness, ROLLOUT.groups_per_version)
        self._tasks: set[asyncio.Task[None]] = set()
        self._resume = asyncio.Event()
        self._paused = False
        self._stopped = False
        self.version = 0
        self.delivered = 0

    def budget(self) -> int:
        return self._policy.budget(self.version, self.delivered, len(self._tasks))

    async def run(self) -> None:
        for sample in self._prompts:
            await self._wait_until_admissible()
            if self._stopped:
                return
            task = asyncio.create_task(self._group(sample))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _wait_until_admissible(self) -> None:
        while not self._stopped:
            if self._paused or self.budget() <= 0:
                if self._tasks:
                    # The behaviour under test: drain everything, the slowest sequence included.
                    await asyncio.gather(*self._tasks, return_exceptions=True)
                else:
                    self._resume.clear()
                    await self._resume.wait()
            elif len(self._tasks) >= self._config.max_concurrency:
                await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            else:
                return

    async def _group(self, sample: PromptSample) -> None:
        completions = await self._engine.generate(
            sample.prompt_id,
            sample.prompt_token_ids,
            self._config.sampling,
            n=self._config.group_size,
        )
        await self._sink.put([_trajectory(sample, c) for c in completions])
        self.delivered += 1

    async def update_weights(self, weights: Any, version: int) -> None:
        self._paused = True
        await self._engine.pause("keep")
        await self._engine.load_weights(weights, version)
        await self._engine.resume()
        self.version, self._paused = version, False
        self._resume.set()

    async def stop(self) -> None:
        self._stopped = True
        self._resume.set()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _trajectory(sample: PromptSample, completion: Completion) -> Trajectory:
    return Trajectory(
        response_id=f"{sample.prompt_id}:0",
        group_id=sample.prompt_id,
        prompt_id=sample.prompt_id,
        prompt_token_ids=sample.prompt_token_ids,
        response_ids=completion.token_ids,
        behaviour_logprobs=completion.logprobs,
        token_versions=completion.versions,
        finish_reason=completion.finish_reason,
        timings=Timings(admitted_at=time.time()),
    )


class _Subject(Protocol):
    async def update_weights(self, weights: Any, version: int) -> None: ...
    async def stop(self) -> None: ...


@dataclass
class TrialResult:
    latencies_ms: list[float] = field(default_factory=list)
    skipped: int = 0  # pushes with nothing in flight or budget left (not a drain)
    delivered: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


def _new_group_calls(engine: FakeEngine) -> list[float]:
    return [c.received_at for c in engine.calls if c.n == ROLLOUT.group_size]


async def _push_and_measure(
    subject: _Subject, engine: FakeEngine, version: int, draining: bool, result: TrialResult
) -> None:
    before = len(_new_group_calls(engine))
    await subject.update_weights(None, version)
    resumed_at = time.monotonic()  # on_weights ran just before update_weights returned
    if not draining:
        result.skipped += 1
        return
    async with asyncio.timeout(10):
        while len(_new_group_calls(engine)) <= before:  # noqa: ASYNC110 - polls the fake's log
            await asyncio.sleep(0.0005)
    result.latencies_ms.append((_new_group_calls(engine)[before] - resumed_at) * 1e3)


async def _trial(kind: str, seed: int, pushes: int) -> TrialResult:
    engine = FakeEngine(_engine_config(seed))
    sink = ListSink()
    prompts = iter(make_prompts(100_000, prefix=f"s{seed}-"))
    subject: Rollouter | WaitForAllDrain
    if kind == "rollouter":
        subject = Rollouter(engine, prompts, sink, lambda s, t: 0.0, ROLLOUT)
    else:
        subject = WaitForAllDrain(engine, prompts, sink)
    result = TrialResult()
    started = time.monotonic()
    run = asyncio.create_task(subject.run())
    for version in range(1, pushes + 1):
        await asyncio.sleep(PUSH_INTERVAL_S)
        budget = subject.stats().budget if isinstance(subject, Rollouter) else subject.budget()
        draining = budget <= 0 and bool(engine.running_request_ids)
        await _push_and_measure(subject, engine, version, draining, result)
    result.seconds = time.monotonic() - started
    await subject.stop()
    await asyncio.wait_for(run, timeout=10)
    result.delivered = len(sink.groups)
    if isinstance(subject, Rollouter):
        metrics = subject.metrics()
        result.extra = {
            "dropped": float(subject.stats().dropped),
            "idle_ratio": metrics["rollout/idle_ratio"],
        }
    return result


async def _run_all(trials: int, pushes: int) -> dict[str, list[TrialResult]]:
    results: dict[str, list[TrialResult]] = {"rollouter": [], "wait_for_all": []}
    for seed in range(trials):
        order = ["rollouter", "wait_for_all"] if seed % 2 == 0 else ["wait_for_all", "rollouter"]
        for kind in order:
            results[kind].append(await _trial(kind, seed, pushes))
    return results


def _summary(label: str, results: list[TrialResult]) -> dict[str, Any]:
    latencies = [ms for r in results for ms in r.latencies_ms]
    seconds = sum(r.seconds for r in results)
    return {
        "drain": label,
        "measured pushes": len(latencies),
        "skipped pushes": sum(r.skipped for r in results),
        "p50 ms": statistics.median(latencies) if latencies else float("nan"),
        "max ms": max(latencies, default=float("nan")),
        "groups/s": sum(r.delivered for r in results) / seconds if seconds else 0.0,
    }


def run(quick: bool) -> BenchReport:
    trials, pushes = (2, 4) if quick else (6, 8)  # quick: both orders, a smoke run
    results = asyncio.run(_run_all(trials, pushes))
    ours = _summary("Rollouter", results["rollouter"])
    base = _summary("wait-for-all baseline", results["wait_for_all"])
    ratio_p50 = base["p50 ms"] / ours["p50 ms"]
    ratio_max = base["max ms"] / ours["max ms"]
    dropped = sum(r.extra.get("dropped", 0.0) for r in results["rollouter"])
    idle = statistics.mean(r.extra.get("idle_ratio", 0.0) for r in results["rollouter"])
    figures = {
        "rollouter_p50_ms": round(ours["p50 ms"], 4),
        "rollouter_max_ms": round(ours["max ms"], 4),
        "baseline_p50_ms": round(base["p50 ms"], 2),
        "baseline_max_ms": round(base["max ms"], 2),
        "ratio_p50": round(ratio_p50, 1),
        "ratio_max": round(ratio_max, 1),
        "target_ratio": TARGET_RATIO,
        "met": ratio_p50 >= TARGET_RATIO,
        "trials": trials,
        "pushes_per_trial": pushes,
    }
    notes = [
        f"{trials} trials x {pushes} pushes per drain, same FakeEngine seeds, "
        f"push every {PUSH_INTERVAL_S}s; latency = next new-group generate - on_weights.",
        f"ratio p50 {ratio_p50:.0f}x (target {TARGET_RATIO:.0f}x), ratio max {ratio_max:.0f}x.",
        f"Rollouter dropped {dropped:.0f} too-stale groups (k=0: stragglers overtaken by a "
        f"push); mean rollout/idle_ratio {idle:.3f}.",
        "groups/s: delivered groups per second of each drain (the baseline idles while it "
        "waits for the tail).",
    ]
    return BenchReport(
        title="drain interrupt: resume-to-next-dispatch latency with long-tail requests in flight",
        rows=[ours, base],
        figures=figures,
        notes=notes,
    )
