"""User reward functions (`--reward`): loading, signatures, sync/async calls, components,
weights, and every failure (raise, timeout, NaN/inf, non-number) as a `RewardFailed` naming
the function; a run of such failures ends the real Rollouter with `RolloutFailed`.
The rollouter test uses rollout_engine's FakeEngine: it is about the failure accounting, not
generation. The whole file costs about 3 s."""

from __future__ import annotations

import asyncio
import textwrap
import time
from pathlib import Path

import pytest
from rollout_engine import RolloutConfig, Rollouter, RolloutFailed, SamplingConfig
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink, make_prompts
from train_app.failure_log import FailureJournal, read_failures
from train_app.tasks.rewards import RewardFailed, RewardSet, RewardSpecError, load_reward

REWARDS = """
import asyncio, math, time

def exact(completion, answer):
    return float(completion == answer)

def parts(completion, answer, metadata, **kwargs):
    return {"length": len(completion) / 10, "bonus": float(metadata.get("bonus", 0))}

async def slow_async(completion):
    await asyncio.sleep(0.01)
    return 0.5

def raises(completion):
    raise ValueError("bad input " + completion)

def sleeps(completion):
    time.sleep(5)
    return 1.0

async def sleeps_async(completion):
    await asyncio.sleep(5)
    return 1.0

def mean(completion):
    return 0.25

def nan(completion):
    return math.nan

def text(completion):
    return "high"

def extra_required(completion, judge):
    return 1.0

NOT_CALLABLE = 3
"""


@pytest.fixture
def reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(REWARDS))
    return path


def _call(rewards: RewardSet, completion: str = "777", **extra):
    arguments = dict(
        completion=completion, prompt="7*3=", answer="777", metadata={"bonus": 2},
        finished=True, completion_ids=[1, 2, 3],
    )  # fmt: skip
    arguments.update(extra)
    return rewards.score(**arguments)


def test_weighted_sum_of_sync_async_and_dict_rewards(reward_file: Path) -> None:
    rewards = RewardSet(
        [f"{reward_file}:exact", f"{reward_file}:parts", f"{reward_file}:slow_async"],
        weights=[2.0, 1.0, 4.0],
    )
    try:
        assert _call(rewards) == pytest.approx(2 * 1.0 + (0.3 + 2.0) + 4 * 0.5)
        assert _call(rewards, completion="7") == pytest.approx(0.0 + (0.1 + 2.0) + 2.0)
        metrics = rewards.metrics()
        assert metrics == pytest.approx(
            {"reward/exact": 0.5, "reward/length": 0.2, "reward/bonus": 2.0,
             "reward/slow_async": 0.5}
        )  # fmt: skip
        assert rewards.metrics() == {}  # means since the last call
    finally:
        rewards.close()


def test_module_form_imports_from_the_search_path(reward_file: Path) -> None:
    rewards = RewardSet(["my_rewards:exact"], search_paths=[str(reward_file.parent)])
    try:
        assert _call(rewards) == 1.0
    finally:
        rewards.close()


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("raises", "raised ValueError: bad input 777"),
        ("sleeps", "timed out after 0.2 s"),
        ("sleeps_async", "timed out after 0.2 s"),
        ("nan", "returned nan"),
        ("text", "non-number (str"),
    ],
)
def test_failures_name_the_function(reward_file: Path, function: str, message: str) -> None:
    rewards = RewardSet([f"{reward_file}:{function}"], timeout_s=0.2)
    try:
        started = time.monotonic()
        with pytest.raises(RewardFailed) as info:
            _call(rewards)
        assert time.monotonic() - started < 2.0  # the timeout bounds the call
        assert f"{reward_file}:{function}" in str(info.value) and message in str(info.value)
    finally:
        rewards.close()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{file}:extra_required", "parameter 'judge' is not one a reward gets"),
        ("{file}:NOT_CALLABLE", "'NOT_CALLABLE' is not callable"),
        ("{file}:missing", "has no 'missing'"),
        ("no_such_module_xyz:f", "cannot import no_such_module_xyz (ModuleNotFoundError"),
        ("{dir}/absent.py:f", "no such file"),
        ("just_a_name", "expected MODULE:FUNCTION"),
    ],
)
def test_unusable_rewards_are_refused(reward_file: Path, spec: str, message: str) -> None:
    spec = spec.format(file=reward_file, dir=reward_file.parent)
    with pytest.raises(RewardSpecError, match="--reward") as info:
        load_reward(spec)
    assert message in str(info.value)


def test_weights_must_match_the_functions(reward_file: Path) -> None:
    with pytest.raises(RewardSpecError, match="2 values for 1"):
        RewardSet([f"{reward_file}:exact"], weights=[1.0, 2.0])


def test_consecutive_reward_failures_end_the_rollouter_naming_the_function(
    reward_file: Path, tmp_path: Path
) -> None:
    """Scheduling/accounting logic: FakeEngine responses, the real Rollouter and journal."""
    rewards = RewardSet([f"{reward_file}:raises"])
    journal = FailureJournal(tmp_path / "failures.jsonl", replica=0)

    def reward_fn(sample, trajectory):
        return _call(rewards)

    config = RolloutConfig(
        group_size=2, max_concurrency=4, batch_size=4, max_staleness=1000, pacing="eager",
        max_consecutive_failures=5, sampling=SamplingConfig(max_tokens=4),
    )  # fmt: skip
    engine = FakeEngine(FakeEngineConfig(seed=1, fixed_length=3))
    rollouter = Rollouter(
        engine, make_prompts(100), ListSink(), reward_fn, config, on_failure=journal
    )
    try:
        with pytest.raises(RolloutFailed) as info:
            asyncio.run(rollouter.run())
    finally:
        journal.close()
        rewards.close()
    assert f"RewardFailed: reward {reward_file}:raises raised ValueError" in str(info.value)
    # Groups still in flight when it gave up are journalled as cancelled; the rest are ours.
    records = [r for r in read_failures(tmp_path / "failures.jsonl") if not r["cancelled"]]
    assert len(records) >= 5
    assert all(r["error_type"] == "RewardFailed" for r in records)
    assert all(f"{reward_file}:raises" in r["message"] for r in records)


def test_a_component_never_overwrites_the_runs_reward_mean(reward_file: Path) -> None:
    rewards = RewardSet([f"{reward_file}:mean"])
    try:
        assert _call(rewards) == 0.25
        assert rewards.metrics() == {"reward/component/mean": 0.25}
    finally:
        rewards.close()
