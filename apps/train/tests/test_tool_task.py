"""The built-in multi-turn `tool` task: prompts, the lookup environment and its rewards."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from rollout_engine import ModelTurn, SyncEnvironment, Timings, Trajectory
from train_app.tasks import make_task
from train_app.tasks.tool import CALL_CREDIT, KEYS
from train_app.tiny_model import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return build_char_tokenizer(Path(tmp_path_factory.mktemp("tok")))


def _turn(tokenizer, index: int, text: str, eos: bool = True) -> ModelTurn:
    ids = tokenizer.encode(text) + ([tokenizer.eos_token_id] if eos else [])
    return ModelTurn(index=index, token_ids=ids, finish_reason="stop" if eos else "length")


def test_prompts_are_seeded_keys_with_a_secret_table(tokenizer) -> None:
    task = make_task("tool", tokenizer)
    samples = list(itertools.islice(task.prompts(seed=3), 50))
    again = list(itertools.islice(task.prompts(seed=3), 50))
    assert [s.prompt_ids for s in samples] == [s.prompt_ids for s in again]
    for s in samples:
        key = s.metadata["key"]
        assert key in KEYS and tokenizer.decode(s.prompt_ids) == f"{key}?"
        assert len(s.answer) == 3 and s.answer.isdigit()
        assert f"{key}:{s.answer}" in s.metadata["table"]
        assert s.answer not in tokenizer.decode(s.prompt_ids)  # only the tool knows it
    assert len({s.answer for s in samples}) > 30


def test_the_right_call_then_the_right_answer_scores_one(tokenizer) -> None:
    task = make_task("tool", tokenizer)
    sample = next(task.prompts(seed=0))
    env = task.environment(sample)
    assert isinstance(env, SyncEnvironment)
    assert env.reset(sample) == []
    key = sample.metadata["key"]
    call = env.step(_turn(tokenizer, 0, f"5{key}a"))  # the first letter is the key
    assert tokenizer.decode(list(call.observation)) == f"={sample.answer}"
    assert call.reward == pytest.approx(CALL_CREDIT) and not call.done
    answer = env.step(_turn(tokenizer, 1, sample.answer))
    assert answer.done and call.reward + answer.reward == pytest.approx(1.0)


def test_a_wrong_or_missing_call_returns_no_answer(tokenizer) -> None:
    task = make_task("tool", tokenizer)
    sample = next(task.prompts(seed=1))
    key = sample.metadata["key"]
    other = next(k for k in KEYS if k != key)
    table = dict(item.split(":") for item in sample.metadata["table"].split(","))
    env = task.environment(sample)
    wrong = env.step(_turn(tokenizer, 0, other))
    assert tokenizer.decode(list(wrong.observation)) == f"={table[other]}"
    assert wrong.reward == 0.0
    none = task.environment(sample).step(_turn(tokenizer, 0, "12", eos=False))
    assert tokenizer.decode(list(none.observation)) == "=?" and none.reward == 0.0
    # partial credit on the answer, halved without EOS
    half = task.environment(sample).step(_turn(tokenizer, 1, sample.answer, eos=False))
    assert half.reward == pytest.approx((1 - CALL_CREDIT) * 0.5)


def test_the_task_reward_is_the_environments(tokenizer) -> None:
    task = make_task("tool", tokenizer)
    sample = next(task.prompts(seed=2))
    trajectory = Trajectory(
        response_id="s", group_id="g", prompt_ids=[1], response_ids=[], behaviour_logprobs=[],
        token_versions=[], finish_reason="stop", timings=Timings(admitted_at=0.0), reward=0.6,
    )  # fmt: skip
    assert task.reward(sample, trajectory) == 0.6
    assert getattr(task.reward, "blocking", True) is False
    assert task.episode.max_turns == 2
