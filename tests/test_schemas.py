"""The rollouter's and the trainer's `Trajectory` are two classes; their wire form must agree."""

from __future__ import annotations

import msgspec
import ppo_trainer
import rollout_engine


def _schema(struct: type[msgspec.Struct]) -> dict:
    """JSON schema without docstrings: field names, types, defaults, nested structs by name."""
    schema = msgspec.json.schema(struct)
    for definition in schema["$defs"].values():
        definition.pop("description", None)
    return schema


def _producer_trajectory() -> rollout_engine.Trajectory:
    return rollout_engine.Trajectory(
        response_id="g1-0",
        group_id="g1",
        prompt_id="p7",
        prompt_ids=[3, 4, 5],
        response_ids=[6, 7, 1],
        behaviour_logprobs=[-0.5, -1.25, -0.125],
        token_versions=[2, 3, 3],
        finish_reason="stop",
        reward=0.75,
        timings=rollout_engine.Timings(admitted_at=10.0, finished_at=11.5, generation_s=1.5),
        multimodal=rollout_engine.MultiModalRef(
            messages_json='[{"role": "user"}]', image_sources=["/tmp/a.png"]
        ),
        num_resumes=1,
        loss_mask=[1, 0, 1],
        turn_starts=[0, 2],
    )


def test_trajectory_structs_have_the_same_fields() -> None:
    schema = _schema(rollout_engine.Trajectory)
    assert schema == _schema(ppo_trainer.Trajectory)
    assert set(schema["$defs"]) == {"Trajectory", "Timings", "MultiModalRef"}
    assert rollout_engine.TRAJECTORY_SCHEMA_VERSION == ppo_trainer.TRAJECTORY_SCHEMA_VERSION


def test_a_rollout_group_decodes_into_the_trainer_struct_and_back() -> None:
    group = [_producer_trajectory()]
    wire = msgspec.msgpack.encode(group)
    decoded = msgspec.msgpack.decode(wire, type=list[ppo_trainer.Trajectory])
    assert msgspec.to_builtins(decoded) == msgspec.to_builtins(group)
    back = msgspec.msgpack.decode(
        msgspec.msgpack.encode(decoded), type=list[rollout_engine.Trajectory]
    )
    assert back == group


def test_a_trajectory_without_multimodal_inputs_round_trips() -> None:
    producer = msgspec.structs.replace(_producer_trajectory(), multimodal=None)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(producer), type=ppo_trainer.Trajectory)
    assert decoded.multimodal is None
    assert decoded.token_versions == [2, 3, 3]
    assert decoded.prompt_id == "p7"


def test_a_multi_turn_episode_keeps_its_mask_and_turns() -> None:
    decoded = msgspec.msgpack.decode(
        msgspec.msgpack.encode(_producer_trajectory()), type=ppo_trainer.Trajectory
    )
    assert decoded.loss_mask == [1, 0, 1]
    assert decoded.turn_starts == [0, 2]
    assert decoded.generated_versions == [2, 3]
    assert decoded.num_generated == 2


def test_the_response_id_keeps_its_older_wire_name() -> None:
    """`response_id` was `sample_id` through schema 3; the wire keeps that name, so a payload
    of an older producer still decodes (and a new one decodes in an older consumer)."""
    wire = msgspec.to_builtins(_producer_trajectory())
    assert wire["sample_id"] == "g1-0" and "response_id" not in wire
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=ppo_trainer.Trajectory)
    assert decoded.response_id == "g1-0"


def test_a_schema_2_payload_decodes_with_an_empty_prompt_id() -> None:
    legacy = msgspec.to_builtins(_producer_trajectory())
    del legacy["prompt_id"]
    legacy["schema_version"] = 2
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(legacy), type=ppo_trainer.Trajectory)
    assert decoded.prompt_id == "" and decoded.group_id == "g1"


def test_a_schema_1_payload_decodes_as_a_single_turn_response() -> None:
    # A producer without the multi-turn fields: every response token counts as generated.
    legacy = msgspec.to_builtins(_producer_trajectory())
    del legacy["loss_mask"], legacy["turn_starts"]
    legacy["schema_version"] = 1
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(legacy), type=ppo_trainer.Trajectory)
    assert decoded.loss_mask == [] and decoded.turn_starts == []
    assert decoded.num_generated == 3 and decoded.min_version == 2
