"""The built-in `repeat` task: prompts and the partial-credit reward."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from rollout_engine import Timings, Trajectory
from train_app.tasks import make_task, partial_credit
from train_app.tiny_model import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return build_char_tokenizer(Path(tmp_path_factory.mktemp("tok")))


def _trajectory(ids: list[int]) -> Trajectory:
    return Trajectory(
        response_id="s", group_id="g", prompt_ids=[], response_ids=ids, behaviour_logprobs=[],
        token_versions=[], finish_reason="stop", timings=Timings(admitted_at=0.0),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("output", "target", "ended", "expected"),
    [
        ("777", "777", True, 1.0),
        ("777", "777", False, 0.5),
        ("77", "777", True, 2 / 3),
        ("7777", "777", True, 3 / 4),
        ("", "777", True, 0.0),
        ("178", "777", True, 1 / 3),
    ],
)
def test_partial_credit(output: str, target: str, ended: bool, expected: float) -> None:
    assert partial_credit(output, target, ended) == pytest.approx(expected)


def test_prompts_are_seeded_and_answers_match(tokenizer) -> None:
    task = make_task("repeat", tokenizer)
    first = list(itertools.islice(task.prompts(seed=1), 20))
    again = list(itertools.islice(task.prompts(seed=1), 20))
    assert first == again
    assert len({p.prompt_id for p in first}) == 20
    for prompt in first:
        text = tokenizer.decode(prompt.prompt_ids)
        digit, count = text.rstrip("=").split("*")
        assert prompt.answer == digit * int(count)


def test_reward_decodes_the_response(tokenizer) -> None:
    task = make_task("repeat", tokenizer)
    prompt = next(task.prompts(seed=0))
    right = [*tokenizer.encode(prompt.answer), tokenizer.eos_token_id]
    assert task.reward(prompt, _trajectory(right)) == 1.0
    assert task.reward(prompt, _trajectory(right[:-1])) == 0.5
    assert task.reward(prompt, _trajectory([tokenizer.eos_token_id])) == 0.0
