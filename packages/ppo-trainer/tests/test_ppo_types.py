"""The trainer's wire types: field list, msgpack round trip, light import."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
from ppo_trainer import TRAJECTORY_SCHEMA_VERSION, MultiModalRef, Timings, Trajectory


def test_trajectory_fields_match_the_producer_contract() -> None:
    names = [f.name for f in msgspec.structs.fields(Trajectory)]
    assert names == [
        "schema_version",
        "response_id",
        "group_id",
        "prompt_id",
        "prompt_token_ids",
        "response_ids",
        "behaviour_logprobs",
        "token_versions",
        "finish_reason",
        "reward",
        "timings",
        "multimodal",
        "num_resumes",
        "loss_mask",
        "turn_starts",
    ]
    wire_names = {f.name: f.encode_name for f in msgspec.structs.fields(Trajectory)}
    assert wire_names["response_id"] == "sample_id"  # its schema 1-3 name, kept on the wire
    assert wire_names["prompt_token_ids"] == "prompt_ids"  # likewise
    defaults = {f.name: f.default for f in msgspec.structs.fields(Trajectory)}
    assert defaults["schema_version"] == TRAJECTORY_SCHEMA_VERSION == 3
    assert defaults["prompt_id"] == ""
    assert defaults["reward"] == 0.0
    assert defaults["multimodal"] is None
    assert defaults["num_resumes"] == 0
    factories = {f.name: f.default_factory for f in msgspec.structs.fields(Trajectory)}
    assert factories["loss_mask"] is list and factories["turn_starts"] is list
    assert [f.name for f in msgspec.structs.fields(Timings)] == [
        "admitted_at",
        "finished_at",
        "generation_s",
    ]
    assert [f.name for f in msgspec.structs.fields(MultiModalRef)] == [
        "messages_json",
        "image_sources",
    ]


def test_msgpack_round_trip_of_a_group() -> None:
    group = [
        Trajectory(
            response_id="s0",
            group_id="g",
            prompt_token_ids=[1, 2],
            response_ids=[3],
            behaviour_logprobs=[-0.5],
            token_versions=[4],
            finish_reason="stop",
            reward=1.0,
            timings=Timings(admitted_at=1.5, finished_at=2.0, generation_s=0.5),
            multimodal=MultiModalRef(messages_json="[]", image_sources=["a.png"]),
        )
    ]
    data = msgspec.msgpack.encode(group)
    decoded = msgspec.msgpack.decode(data, type=list[Trajectory])
    assert decoded == group
    assert decoded[0].min_version == 4


def test_prompt_ids_is_a_deprecated_alias_of_prompt_token_ids() -> None:
    trajectory = msgspec.msgpack.decode(
        msgspec.msgpack.encode(
            {
                "sample_id": "g:0",
                "group_id": "g",
                "prompt_ids": [5, 6],
                "response_ids": [7],
                "behaviour_logprobs": [-1.0],
                "token_versions": [0],
                "finish_reason": "stop",
                "timings": {"admitted_at": 0.0},
            }
        ),
        type=Trajectory,
    )
    assert trajectory.prompt_token_ids == [5, 6]
    with pytest.warns(DeprecationWarning, match="prompt_token_ids"):
        assert trajectory.prompt_ids == [5, 6]


def test_import_is_light() -> None:
    code = "import sys, ppo_trainer; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
