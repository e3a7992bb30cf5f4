"""A tool that burns 200 ms of CPU per call cannot stall the rollouter's event loop.

`event_loop/lag_ms_p99` is measured by a 10 ms timer on the loop that runs the
rollouter. Three ways a tool burns CPU, three expectations:

- pure-Python work through `run_in_process` (the rollouter's process pool): the loop's p99 lag
  stays <= 20 ms (the bar);
- C work that releases the GIL (hashing) in a `SyncEnvironment`, in the tool thread pool: the
  same bar;
- the negative control: the same burn in an async `step`, on the loop: the probe sees the
  200 ms stall.

(Pure-Python work in tool *threads* holds the GIL; the loop then waits for it at every wake-up
and its p99 lag was measured at 70-90 ms with two such threads: see rollout_engine.episode.)
The engine is `rollout_engine.testing.FakeEngine` (a fake: these are scheduling tests).
Costs ~8 s (about 2 s of tool CPU in other threads or processes per run, spawning processes,
baseline runs); the 20 ms tests skip, saying why, on a machine too busy to measure a loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest
from rollout_engine import (
    EpisodeConfig,
    ModelTurn,
    PromptSample,
    RolloutConfig,
    Rollouter,
    SamplingConfig,
    StepResult,
    environment_reward,
    run_in_process,
)
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink, burn_cpu, make_prompts

BURN_S = 0.2
BLOCK = b"x" * (1 << 20)


class LagProbe:
    """How late a 10 ms timer fires on the running loop (the same measure as
    `mm_preprocess.EventLoopLagMonitor`, which this package must not import)."""

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.lags_ms: list[float] = []
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._due = loop.time() + self.interval_s
        self._handle = loop.call_at(self._due, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        self.lags_ms.append(max(0.0, now - self._due) * 1e3)
        self._due = now + self.interval_s
        self._handle = loop.call_at(self._due, self._tick, loop)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()

    def p99(self) -> float:
        ordered = sorted(self.lags_ms)
        return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


class ProcessTool:
    """Every step burns 200 ms of pure-Python CPU in the rollouter's process pool."""

    async def reset(self, sample: PromptSample) -> list[int]:
        return []

    async def step(self, turn: ModelTurn) -> StepResult:
        await run_in_process(burn_cpu, BURN_S)
        return StepResult(observation=[9, 9], reward=1.0, done=turn.index == 1)


def hash_for(seconds: float) -> int:
    """C work that releases the GIL (sha256 of 1 MiB blocks) for `seconds` of thread CPU."""
    start, rounds = time.thread_time(), 0
    while time.thread_time() - start < seconds:
        hashlib.sha256(BLOCK).digest()
        rounds += 1
    return rounds


class NativeTool:
    """A SyncEnvironment (runs in the tool threads) whose step burns 200 ms in C code."""

    def reset(self, sample: PromptSample) -> list[int]:
        return []

    def step(self, turn: ModelTurn) -> StepResult:
        hash_for(BURN_S)
        return StepResult(observation=[9, 9], reward=1.0, done=turn.index == 1)


class SleepingTool:
    """The baseline: a tool that takes 200 ms but no CPU."""

    async def reset(self, sample: PromptSample) -> list[int]:
        return []

    async def step(self, turn: ModelTurn) -> StepResult:
        await asyncio.sleep(BURN_S)
        return StepResult(observation=[9, 9], reward=1.0, done=turn.index == 1)


class BurningOnTheLoop:
    """The bug: the burn inside an async step, on the event loop."""

    async def reset(self, sample: PromptSample) -> list[int]:
        return []

    async def step(self, turn: ModelTurn) -> StepResult:
        burn_cpu(BURN_S)
        return StepResult(reward=1.0, done=True)


async def _probe_run(make_env: object, prompts: int, episode: EpisodeConfig) -> LagProbe:
    engine = FakeEngine(FakeEngineConfig(seed=1, median_length=8, time_per_token_s=0.001))
    config = RolloutConfig(
        group_size=2, max_concurrency=4, groups_per_step=4, sampling=SamplingConfig(max_tokens=16)
    )
    sink = ListSink()
    rollouter = Rollouter(
        engine,
        make_prompts(prompts),
        sink,
        environment_reward,
        config,
        environment=make_env,  # type: ignore[arg-type]
        episode=episode,
    )
    probe = LagProbe()
    probe.start()
    try:
        stats = await asyncio.wait_for(rollouter.run(), timeout=60)
    finally:
        probe.stop()
    assert stats.delivered == prompts and stats.failed == 0
    return probe


TOOLS = {
    # 2 groups x 2 episodes x 2 steps = 8 tool calls = 1.6 s of CPU in 1 process/thread: on a
    # 2-core machine one core stays free for the loop (two burning workers would take both,
    # and the loop would wait for a core whatever it does).
    "pure-python-in-processes": (ProcessTool, EpisodeConfig(max_turns=2, tool_processes=1)),
    "native-in-threads": (NativeTool, EpisodeConfig(max_turns=2, tool_workers=1)),
}


@pytest.mark.parametrize("tool", list(TOOLS))
async def test_a_tool_burning_200ms_of_cpu_per_call_never_stalls_the_loop(tool: str) -> None:
    """Holds on any machine: no tick waits anywhere near one tool call (the on-loop control
    below waits >= 150 ms)."""
    make, episode = TOOLS[tool]
    probe = await _probe_run(lambda s: make(), 2, episode)
    assert len(probe.lags_ms) >= 40  # the run lasted >= 0.4 s of ticks
    assert probe.p99() < 0.5 * BURN_S * 1e3, f"p99 {probe.p99():.1f} ms"


@pytest.mark.parametrize("tool", list(TOOLS))
async def test_a_tool_burning_200ms_of_cpu_per_call_keeps_loop_lag_p99_under_20ms(
    tool: str,
) -> None:
    """The 20 ms bar. It is about this loop, so it is measured only when the machine lets a
    loop be measured: the same run with tools that take 200 ms but no CPU must show a p99
    lag <= 5 ms first (on a machine whose other processes keep every core busy, the loop
    waits for a core even with no tool at all; then the test skips and says so)."""
    baseline = await _probe_run(lambda s: SleepingTool(), 2, EpisodeConfig(max_turns=2))
    if baseline.p99() > 5.0:
        pytest.skip(f"machine too busy to measure loop lag: baseline p99 {baseline.p99():.1f} ms")
    make, episode = TOOLS[tool]
    probe = await _probe_run(lambda s: make(), 2, episode)
    assert probe.p99() <= 20.0, f"p99 lag {probe.p99():.1f} ms, max {max(probe.lags_ms):.1f} ms"


async def test_negative_control_the_same_burn_on_the_loop_stalls_it() -> None:
    probe = await _probe_run(lambda s: BurningOnTheLoop(), 1, EpisodeConfig(max_turns=1))
    assert max(probe.lags_ms) >= 0.75 * BURN_S * 1e3


async def test_run_in_process_needs_tool_processes() -> None:
    with pytest.raises(RuntimeError, match="tool_processes"):
        await run_in_process(burn_cpu, 0.0)
