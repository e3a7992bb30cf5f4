"""One vocabulary: the renamed public names, their deprecated aliases (which still work and
warn), the wire names that never change, and the shared `StalenessBound`."""

from __future__ import annotations

import dataclasses
import importlib

import msgspec
import pytest
import rollout_engine
from rollout_engine import (
    FailedGroup,
    PromptSample,
    RolloutConfig,
    Rollouter,
    StalenessBound,
    Timings,
    Trajectory,
)
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink, make_prompts


def _trajectory(**ids: list[int]) -> Trajectory:
    return Trajectory(
        response_id="g:0",
        group_id="g",
        response_ids=[4],
        behaviour_logprobs=[-0.1],
        token_versions=[0],
        finish_reason="stop",
        timings=Timings(admitted_at=0.0),
        **ids,
    )


def test_prompt_token_ids_keep_their_wire_name() -> None:
    sample = PromptSample(prompt_id="p", prompt_token_ids=[1, 2])
    trajectory = _trajectory(prompt_token_ids=[1, 2])
    for struct in (sample, trajectory):
        wire = msgspec.json.decode(msgspec.json.encode(struct))
        assert wire["prompt_ids"] == [1, 2] and "prompt_token_ids" not in wire
    older = b'{"prompt_id": "p", "prompt_ids": [7, 8]}'  # a payload from before the rename
    assert msgspec.json.decode(older, type=PromptSample).prompt_token_ids == [7, 8]


@pytest.mark.parametrize(
    "build",
    [
        lambda: PromptSample(prompt_id="p", prompt_ids=[1, 2]),
        lambda: _trajectory(prompt_ids=[1, 2]),
    ],
)
def test_the_old_prompt_ids_name_still_works_and_warns(build) -> None:
    with pytest.warns(DeprecationWarning, match="prompt_token_ids"):
        struct = build()
    assert struct.prompt_token_ids == [1, 2]
    with pytest.warns(DeprecationWarning, match="prompt_token_ids"):
        assert struct.prompt_ids == [1, 2]


@pytest.mark.parametrize(
    "module", ["rollout_engine", "rollout_engine.rollouter", "rollout_engine.metrics"]
)
def test_failed_sample_is_a_deprecated_alias_of_failed_group(module: str) -> None:
    with pytest.warns(DeprecationWarning, match="FailedGroup"):
        alias = importlib.import_module(module).FailedSample
    assert alias is FailedGroup
    assert "FailedSample" not in rollout_engine.__all__


def test_rollout_config_old_names_still_work_and_warn() -> None:
    with pytest.warns(DeprecationWarning, match="groups_per_step"):
        config = RolloutConfig(batch_size=4, sync_every=2)
    assert config.groups_per_step == 4 and config.groups_per_version == 8
    with pytest.warns(DeprecationWarning, match="groups_per_step"):
        assert config.batch_size == 4
    with pytest.warns(DeprecationWarning, match="groups_per_version"):
        assert config.samples_per_version == 8
    with pytest.warns(DeprecationWarning, match="groups_per_step"):
        assert dataclasses.replace(config, batch_size=3).groups_per_step == 3
    assert dataclasses.replace(config, max_concurrency=2).groups_per_step == 4


def test_staleness_bound() -> None:
    bound = StalenessBound(2)
    assert [bound.too_stale(s) for s in (0, 2, 3)] == [False, False, True]
    assert bound.staleness(5, [3, 4], admitted_at=1) == 2
    assert bound.staleness(5, [], admitted_at=4) == 1  # no token yet: from admission
    assert RolloutConfig(max_staleness=3).staleness_bound == StalenessBound(3)
    with pytest.raises(ValueError):
        StalenessBound(-1)


def test_the_rollouter_uses_the_bound_it_is_given_over_the_config() -> None:
    """config.max_staleness 2 but a shared bound of 0: admission opens one version's worth
    (eager: (0 + 1) * S), not three."""
    config = RolloutConfig(group_size=2, groups_per_step=4, max_staleness=2, pacing="eager")
    engine = FakeEngine(FakeEngineConfig(seed=0))
    shared = Rollouter(
        engine,
        make_prompts(2),
        ListSink(),
        lambda s, t: 0.0,
        config,
        staleness_bound=StalenessBound(0),
    )
    alone = Rollouter(engine, make_prompts(2), ListSink(), lambda s, t: 0.0, config)
    assert shared.staleness_bound.max_staleness == 0
    assert (shared.stats().budget, alone.stats().budget) == (4, 12)
