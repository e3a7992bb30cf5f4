"""The rollouter used on its own, with no consumer that advances the weight version (batch
generation, evaluation): a finite run finishes with `generation_only`, and without it the
stall on the staleness budget is reported once, naming the pacing and what to set.

These are scheduling tests: FakeEngine decodes on `asyncio.sleep`, and `looptime` fast-forwards
the loop's clock whenever every coroutine waits, so minutes of virtual time take milliseconds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import looptime
import pytest
from rollout_engine import RolloutConfig, Rollouter, RolloutStats
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink, make_prompts

PROMPTS = 40
STALL_S = 30.0


def _config(**overrides: Any) -> RolloutConfig:
    base: dict[str, Any] = {
        "group_size": 2,
        "max_concurrency": 4,
        "groups_per_step": 4,
        "max_staleness": 2,
        "stall_warning_s": STALL_S,
    }
    return RolloutConfig(**{**base, **overrides})


def _virtual(coro: Coroutine[Any, Any, Any]) -> Any:
    loop = looptime.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def _rollouter(config: RolloutConfig, sink: ListSink) -> Rollouter:
    engine = FakeEngine(FakeEngineConfig(seed=0, time_per_token_s=0.01))
    return Rollouter(engine, make_prompts(PROMPTS), sink, lambda s, t: 0.0, config)


@pytest.mark.parametrize("pacing", ["fresh", "eager"])
def test_generation_only_runs_a_finite_prompt_list_to_the_end(pacing: str) -> None:
    """No consumer ever calls on_weights: every prompt is still generated and run() returns
    (without `generation_only` the budget closes after (lookahead + 1) * S groups)."""
    sink = ListSink()
    rollouter = _rollouter(_config(pacing=pacing, generation_only=True), sink)

    async def main() -> RolloutStats:
        return await asyncio.wait_for(rollouter.run(), timeout=3600)  # virtual seconds

    stats = _virtual(main())
    assert stats.state == "finished"
    assert stats.delivered == len(sink.groups) == PROMPTS
    assert stats.dropped == stats.failed == 0
    assert max(len(g) for g in sink.groups) == 2


def test_a_budget_stall_without_new_versions_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    """Fresh pacing, no consumer: admission stops after (1 + 1) * S groups and waits for a
    version that never comes. After `stall_warning_s` one warning names the pacing and
    `generation_only`; waiting longer does not repeat it."""
    sink = ListSink()
    rollouter = _rollouter(_config(), sink)

    async def main() -> RolloutStats:
        run = asyncio.create_task(rollouter.run())
        await asyncio.sleep(STALL_S * 0.5)
        early = _stall_warnings(caplog)
        await asyncio.sleep(STALL_S * 5)
        assert early == [], early  # not before stall_warning_s
        assert rollouter.state == "draining"
        await rollouter.stop()
        return await run

    with caplog.at_level(logging.WARNING, logger="rollout_engine"):
        stats = _virtual(main())
    warnings = _stall_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "pacing 'fresh'" in warnings[0] and "generation_only=True" in warnings[0]
    assert stats.delivered == 8  # (lookahead 1 + 1) * S groups, then the stall


def test_a_new_version_rearms_the_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A stall, a new version (the budget reopens, groups flow), then a second stall: two
    warnings, one per stall."""
    sink = ListSink()
    rollouter = _rollouter(_config(), sink)

    async def main() -> None:
        run = asyncio.create_task(rollouter.run())
        await asyncio.sleep(STALL_S * 2)
        assert len(_stall_warnings(caplog)) == 1
        await rollouter.update_weights(None, 1)
        await asyncio.sleep(STALL_S * 2)
        assert len(sink.groups) == 12  # S more groups: the budget reopened once
        await rollouter.stop()
        await run

    with caplog.at_level(logging.WARNING, logger="rollout_engine"):
        _virtual(main())
    assert len(_stall_warnings(caplog)) == 2


def test_a_fed_run_never_warns(caplog: pytest.LogCaptureFixture) -> None:
    """A consumer that advances the version every few seconds never triggers the warning,
    however long the run."""
    sink = ListSink()
    rollouter = _rollouter(_config(stall_warning_s=STALL_S), sink)

    async def main() -> RolloutStats:
        run = asyncio.create_task(rollouter.run())
        version = 0
        while not run.done():
            await asyncio.sleep(5.0)
            version += 1
            await rollouter.update_weights(None, version)
        return await run

    with caplog.at_level(logging.WARNING, logger="rollout_engine"):
        stats = _virtual(main())
    assert stats.state == "finished" and stats.delivered == PROMPTS
    assert _stall_warnings(caplog) == []


def _stall_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "staleness budget" in r.getMessage()]
