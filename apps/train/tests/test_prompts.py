"""`PromptSource`: the seeded prompt stream of one replica and its resume state (the real
`repeat` task with the app's character tokenizer; no Ray, no engine)."""

from __future__ import annotations

from itertools import islice
from pathlib import Path

import pytest
from train_app.prompts import PromptSource
from train_app.tasks import make_task
from train_app.tiny_model import build_char_tokenizer


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory):
    return make_task("repeat", build_char_tokenizer(Path(tmp_path_factory.mktemp("tok"))))


def _ids(source: PromptSource, n: int) -> list[str]:
    return [p.prompt_id for p in islice(source, n)]


def test_the_stream_is_the_tasks_seeded_stream(task) -> None:
    assert _ids(PromptSource(task, seed=3), 5) == [p.prompt_id for p in islice(task.prompts(3), 5)]
    assert _ids(PromptSource(task, seed=3), 5) == _ids(PromptSource(task, seed=3), 5)


def test_resume_skips_exactly_the_consumed_prompts(task) -> None:
    """Consumed: trained on before the checkpoint. The others, including prompts admitted but
    lost with the old queue, come again, in stream order."""
    first = _ids(PromptSource(task, seed=0), 10)
    consumed = {first[0], first[1], first[4], first[7]}
    resumed = _ids(PromptSource(task, seed=0, consumed=consumed), 6)
    assert resumed == [i for i in first if i not in consumed]


def test_state_round_trips_into_a_fresh_source(task) -> None:
    source = PromptSource(task, seed=5, consumed=["s5-1", "s5-0"])
    state = source.state_dict()
    assert state == {"seed": 5, "consumed_prompt_ids": ["s5-0", "s5-1"]}
    fresh = PromptSource(task, seed=0)
    fresh.load_state_dict(state)
    assert _ids(fresh, 3) == ["s5-2", "s5-3", "s5-4"]
    with pytest.raises(ValueError, match="unknown PromptSource state keys"):
        fresh.load_state_dict({"seed": 1, "position": 4})


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_replicas_never_share_a_prompt(task, replicas: int) -> None:
    """Each replica has its own seed (plan.py: seed * 1000 + replica); their ids never meet,
    so one consumed set serves every replica."""
    streams = [set(_ids(PromptSource(task, seed=1000 + r), 50)) for r in range(replicas)]
    assert sum(len(s) for s in streams) == len(set().union(*streams)) == 50 * replicas
