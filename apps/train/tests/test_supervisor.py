"""The plan of a dead rollouter's replacement (`driver.supervisor.replacement_plan`), without
Ray: which prompts it skips and which restored in-flight groups it continues."""

from __future__ import annotations

from rollout_engine import GroupSnapshot, PromptSample, ResponseSnapshot, RolloutSnapshot
from train_app.config import TrainConfig
from train_app.driver.supervisor import replacement_plan
from train_app.plan import ResumePoint, plan


def _group(prompt_id: str, version: int = 3) -> GroupSnapshot:
    response = ResponseSnapshot(token_ids=[5, 6], logprobs=[-0.5, -0.5], versions=[version] * 2)
    return GroupSnapshot(
        group_id=f"{prompt_id}:0",
        sample=PromptSample(prompt_id=prompt_id, prompt_ids=[1, 2, 3]),
        admitted_version=version,
        sampling_seed=7,
        responses=[response, response],
    )


def _resumed_replica(*restored: str) -> tuple:
    """Replica 0 of a resumed run (trained before on "old") continuing `restored` groups."""
    snapshot = RolloutSnapshot(
        version=4, group_size=2, taken_at=1.0, groups=[_group(p) for p in restored]
    )
    resume = ResumePoint(
        checkpoint="ckpt", step=4, version=4, consumed_prompt_ids=frozenset({"old"}),
        inflight=(snapshot,),
    )  # fmt: skip
    return plan(TrainConfig(group_size=2), resume=resume).replicas[0]


def _restored(replica) -> list[str]:
    return [] if replica.restore is None else [g.sample.prompt_id for g in replica.restore.groups]


def test_restored_groups_its_predecessor_delivered_are_not_generated_again() -> None:
    """After a resume, the predecessor delivered restored group "a" (now trained or queued):
    the replacement continues only "b". (It used to continue both: the restored ids were
    subtracted from what to skip, since the resumed plan's skip set holds them too.)"""
    base = _resumed_replica("a", "b")
    assert _restored(base) == ["a", "b"]
    replacement = replacement_plan(base, frozenset({"a", "new1"}))
    assert _restored(replacement) == ["b"]
    assert {"old", "a", "b", "new1"} <= replacement.consumed_prompt_ids
    assert replacement.requeued == 0


def test_nothing_left_to_continue_when_every_restored_group_was_delivered() -> None:
    base = _resumed_replica("a", "b")
    assert replacement_plan(base, frozenset({"a", "b"})).restore is None


def test_no_restored_group_delivered_continues_them_all() -> None:
    base = _resumed_replica("a", "b")
    replacement = replacement_plan(base, frozenset({"new1", "new2"}))
    assert _restored(replacement) == ["a", "b"]
    assert replacement.prompt_seed == base.prompt_seed  # the same prompt stream


def test_a_replacement_starts_from_its_streams_position_at_the_last_checkpoint() -> None:
    """With the replica's last checkpointed snapshot: its stream starts at that position and
    the snapshot's groups (in flight then) not handed over since are continued, with the
    prompts that state still had to generate again."""
    base = _resumed_replica("a")
    last = RolloutSnapshot(
        version=9, group_size=2, taken_at=2.0, groups=[_group("s0-40"), _group("s0-41")],
        prompt_state={"seed": 0, "position": 42, "redo": ["s0-7", "s0-8"], "skip": ["s0-50"]},
    )  # fmt: skip
    replacement = replacement_plan(base, frozenset({"s0-41", "s0-8", "s0-42"}), last)
    assert replacement.prompt_position == 42
    assert _restored(replacement) == ["s0-40"]
    assert replacement.redo_prompt_ids == ("s0-7",)
    assert {"s0-42", "s0-50"} <= replacement.consumed_prompt_ids
