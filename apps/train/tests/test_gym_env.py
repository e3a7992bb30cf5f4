"""`--env reasoning-gym:NAME`: reasoning-gym's real generators (offline) as a prompt stream,
scored by its own `score_answer`. No engine: the responses are the tokenized answers. Costs
about 5 s (reasoning-gym's import)."""

from __future__ import annotations

from itertools import islice
from pathlib import Path

import pytest
from rollout_engine import Timings, Trajectory
from train_app.tasks import make_task
from train_app.tasks.gym import check_names
from train_app.tiny_model import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return build_char_tokenizer(Path(tmp_path_factory.mktemp("tok")))


def _response(ids: list[int]) -> Trajectory:
    return Trajectory(
        response_id="s", group_id="g", prompt_ids=[], response_ids=ids, behaviour_logprobs=[],
        token_versions=[], finish_reason="stop", timings=Timings(admitted_at=0.0),
    )  # fmt: skip


def test_generated_questions_are_scored_by_reasoning_gym(tokenizer) -> None:
    import reasoning_gym

    task = make_task("reasoning-gym", tokenizer, names=("gcd", "basic_arithmetic"), seed=4)
    samples = list(islice(task.prompts(7), 6))
    assert [s.metadata["dataset"] for s in samples] == ["gcd", "basic_arithmetic"] * 3
    assert len({s.prompt_id for s in samples}) == 6
    assert samples == list(islice(task.prompts(7), 6))  # seeded
    assert {s.prompt_id for s in islice(task.prompts(8), 6)}.isdisjoint(
        s.prompt_id for s in samples
    )
    for sample in samples:
        entry = reasoning_gym.create_dataset(sample.metadata["dataset"], size=10**6, seed=4)[
            int(sample.metadata["item"])
        ]
        assert sample.answer == str(entry["answer"])  # the library's own question and answer
        right = [*tokenizer.encode(sample.answer), tokenizer.eos_token_id]
        assert task.reward(sample, _response(right)) == 1.0
        assert task.reward(sample, _response(tokenizer.encode("=="))) < 1.0


def test_unknown_names_list_the_available_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown dataset.*no_such.*available: .*leg_counting"):
        check_names(["gcd", "no_such"])


@pytest.mark.parametrize(
    ("module", "call", "extra"),
    [
        ("reasoning_gym", lambda: check_names(["gcd"]), "asyncrl-train[reasoning-gym]"),
        ("datasets", lambda: __import__("train_app.tasks.dataset").tasks.dataset.load_rows("x"),
         "asyncrl-train[datasets]"),
    ],
)  # fmt: skip
def test_a_missing_library_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, module: str, call, extra: str
) -> None:
    monkeypatch.setitem(__import__("sys").modules, module, None)  # import raises ImportError
    with pytest.raises(ValueError, match="extra") as info:
        call()
    assert extra in str(info.value)
