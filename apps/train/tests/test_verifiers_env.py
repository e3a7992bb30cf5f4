"""`--env verifiers:TARGET`: verifiers' own classes (a `vf.Taskset`, `vf.Task` rubrics, a
multi-turn `vf.Env` driving `interaction().turn()`), built in files the tests write, run
through the adapter and the real `Rollouter` / `EpisodeRunner`.

The engine is `rollout_engine.testing.FakeEngine` (random tokens of the tiny vocabulary; a
fake because these tests check what reaches the samples, not what a model learns): the
expected reward of each trajectory is recomputed here from its decoded turns, so the test
shows verifiers' rubric scored exactly the text the engine generated. Costs ~20 s on this
loaded 2-core machine, nearly all verifiers' own import (`import verifiers.v1`: 17-28 s with
load average ~17); the whole run with the tiny model is in test_examples_e2e.py.
"""

from __future__ import annotations

import asyncio
import textwrap
from itertools import islice
from pathlib import Path

import pytest
from rollout_engine import ModelTurn, RolloutConfig, Rollouter, SamplingConfig
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink
from train_app.tasks import make_task
from train_app.tasks.spec import parse_env
from train_app.tasks.verifiers_env import check_target
from train_app.tiny_model import build_char_tokenizer

# Measured: 43 s for the module with load average ~20 on 2 shared cores, 34 s of it the first
# test's `import verifiers.v1`.
pytestmark = pytest.mark.slow

SINGLE_TURN = """
import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.5)
    async def short(self, trace: vf.Trace) -> float:
        return 1.0 / (1 + len(trace.last_reply))


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 6


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            yield SumTask(SumData(prompt=f"{i}+{i}=", answer=str(2 * i)), self.config.task)


__all__ = ["SumTaskset"]
"""

MULTI_TURN = '''
import verifiers.v1 as vf


class TwoStepData(vf.TaskData):
    start: int


class TwoStepTask(vf.Task[TwoStepData]):
    @vf.reward(weight=1.0)
    async def both(self, trace: vf.Trace) -> float:
        replies = [m.content or "" for m in trace.assistant_messages]
        wanted = [str(self.data.start + 1), str(2 * (self.data.start + 1))]
        return sum(r == w for r, w in zip(replies, wanted)) / 2

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class TwoStepTaskset(vf.Taskset[TwoStepTask, vf.TasksetConfig]):
    def load(self):
        for i in range(4):
            yield TwoStepTask(TwoStepData(prompt=f"{i}+1=", start=i), self.config.task)


class TwoStepConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class TwoStepEnv(vf.Env[TwoStepConfig]):
    """Turn 1 answers the prompt; the env then asks to double it (turn 2)."""

    async def run(self, task, agents):
        async with agents.player.interaction(task) as chat:
            first = await chat.turn()
            if not first.terminated:
                await chat.turn("*2=")

    async def finalize(self, task, episode):
        for trace in episode.traces:
            trace.record_reward("finalized", 0.0)


__all__ = ["TwoStepEnv", "TwoStepTaskset"]
'''


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return build_char_tokenizer(Path(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def env_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("envs")
    files = {}
    for name, source in (("vf_sum_env", SINGLE_TURN), ("vf_two_step_env", MULTI_TURN)):
        path = folder / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        files[name] = str(path)
    return files


def _text(tokenizer, ids: list[int]) -> str:
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=True)


async def _rollout(task, tokenizer, prompts: int, max_tokens: int = 4) -> tuple[ListSink, dict]:
    """The groups of `prompts` prompts, and the verifiers task of each prompt id."""
    engine = FakeEngine(
        FakeEngineConfig(
            seed=5, median_length=2, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id
        )
    )
    sink = ListSink()
    config = RolloutConfig(
        group_size=2,
        max_concurrency=4,
        groups_per_step=8,
        sampling=SamplingConfig(max_tokens=max_tokens),
    )
    samples = list(islice(task.prompts(seed=0), prompts))
    rollouter = Rollouter(
        engine,
        samples,
        sink,
        task.reward,
        config,
        environment=task.environment,
        episode=task.episode,
    )
    await asyncio.wait_for(rollouter.run(), timeout=60)
    return sink, {s.prompt_id: task._tasks[int(s.metadata["task"])] for s in samples}


async def test_single_turn_rewards_come_from_the_rubric(tokenizer, env_files) -> None:
    task = make_task("verifiers", tokenizer, target=env_files["vf_sum_env"], chat_template="none")
    sink, tasks = await _rollout(task, tokenizer, prompts=5)
    assert len(sink.trajectories) == 10
    for t in sink.trajectories:
        i = int(tasks[t.prompt_id].data.prompt[0])
        assert t.prompt_token_ids == tokenizer.encode(f"{i}+{i}=")
        reply = _text(tokenizer, list(t.response_ids)).strip()
        expected = float(reply == str(2 * i)) + 0.5 / (1 + len(reply))
        assert t.reward == pytest.approx(expected)
        assert t.loss_mask == [1] * len(t.response_ids)  # one turn: all generated


async def test_multi_turn_masks_the_environments_tokens(tokenizer, env_files) -> None:
    task = make_task(
        "verifiers", tokenizer, target=env_files["vf_two_step_env"], chat_template="none"
    )
    sink, tasks = await _rollout(task, tokenizer, prompts=4)
    feedback = tokenizer.encode("*2=")
    two_turns = 0
    for t in sink.trajectories:
        start = tasks[t.prompt_id].data.start
        assert t.prompt_token_ids == tokenizer.encode(f"{start}+1=")
        ids, mask = list(t.response_ids), list(t.loss_mask)
        turns = [
            ids[a:b] for a, b in zip(t.turn_starts, [*t.turn_starts[1:], len(ids)], strict=True)
        ]
        replies = [_text(tokenizer, turn[: len(turn) - len(feedback)]) for turn in turns[:-1]]
        replies.append(_text(tokenizer, turns[-1]))
        if len(turns) == 2:
            two_turns += 1
            first_end = t.turn_starts[1] - len(feedback)
            assert ids[first_end : t.turn_starts[1]] == feedback
            assert mask[first_end : t.turn_starts[1]] == [0] * len(feedback)
            assert mask[:first_end] == [1] * first_end
            assert mask[t.turn_starts[1] :] == [1] * (len(ids) - t.turn_starts[1])
        wanted = [str(start + 1), str(2 * (start + 1))]
        expected = sum(r.strip() == w for r, w in zip(replies, wanted, strict=False)) / 2
        assert t.reward == pytest.approx(expected)
    assert two_turns == len(sink.trajectories)  # every episode played both turns
    metrics = task.metrics()  # the rubric's own names: its reward, its metric, finalize's
    assert metrics["verifiers/turns"] == pytest.approx(2.0)
    assert set(metrics) == {"reward/both", "reward/finalized", "verifiers/turns"}
    assert metrics["reward/both"] == pytest.approx(
        sum(t.reward for t in sink.trajectories) / len(sink.trajectories)
    )


def _turn(tokenizer, index: int, text: str) -> ModelTurn:
    return ModelTurn(
        index=index,
        token_ids=[*tokenizer.encode(text), tokenizer.eos_token_id],
        finish_reason="stop",
    )


async def test_right_answers_score_one_and_a_turn_limit_ends_the_exchange(
    tokenizer, env_files
) -> None:
    task = make_task(
        "verifiers", tokenizer, target=env_files["vf_two_step_env"], chat_template="none"
    )
    sample = next(task.prompts(seed=1))
    start = task._tasks[int(sample.metadata["task"])].data.start
    env = task.environment(sample)
    assert await env.reset(sample) == tokenizer.encode(f"{start}+1=")
    step = await env.step(_turn(tokenizer, 0, str(start + 1)))
    assert list(step.observation) == tokenizer.encode("*2=") and not step.done
    last = await env.step(_turn(tokenizer, 1, str(2 * (start + 1))))
    assert last.done and last.reward == pytest.approx(1.0)
    await env.close()
    # One turn allowed: the env's second turn() gets a terminated segment; the rubric still
    # scores the half-played exchange.
    short = make_task(
        "verifiers",
        tokenizer,
        target=env_files["vf_two_step_env"],
        chat_template="none",
        max_turns=1,
    )
    env = short.environment(sample)
    await env.reset(sample)
    only = await env.step(_turn(tokenizer, 0, str(start + 1)))
    assert only.done and only.reward == pytest.approx(0.5)
    await env.close()


async def test_a_chat_template_renders_turns_incrementally(tmp_path, env_files) -> None:
    from tiny_models import CHAT_SPECIAL_TOKENS, CHAT_TEMPLATE

    chat = build_char_tokenizer(
        tmp_path, extra_special_tokens=CHAT_SPECIAL_TOKENS, eos_token="<|im_end|>",
        chat_template=CHAT_TEMPLATE,
    )  # fmt: skip
    task = make_task("verifiers", chat, target=env_files["vf_two_step_env"])
    sample = next(task.prompts(seed=0))
    start = task._tasks[int(sample.metadata["task"])].data.start
    env = task.environment(sample)
    opening = await env.reset(sample)
    assert chat.decode(opening) == f"<|user|>{start}+1=<|im_end|><|assistant|>"
    step = await env.step(_turn(chat, 0, str(start + 1)))
    assert chat.decode(list(step.observation)) == "<|user|>*2=<|im_end|><|assistant|>"
    await env.close()  # mid-exchange: the `Env`'s run is cancelled


async def test_the_default_tiny_tokenizer_covers_the_environments_text(tmp_path: Path) -> None:
    """Without `--model`, the tiny tokenizer gets the characters of the tasks' openings
    (`--system-prompt` included) and answers: the first request has no `<unk>`."""
    from train_app.config import TrainConfig
    from train_app.driver.startup import ensure_model
    from train_app.models import load_tokenizer
    from train_app.tasks.spec import task_options

    path = tmp_path / "vf_words_env.py"
    path.write_text(textwrap.dedent(SINGLE_TURN).replace('f"{i}+{i}="', 'f"Sum {i} & {i}."'))
    config = TrainConfig(env=f"verifiers:{path}", system_prompt="Be brief!")
    tokenizer = load_tokenizer(ensure_model(config, tmp_path / "run"))
    task = make_task("verifiers", tokenizer, **task_options(config, tmp_path))
    for sample in islice(task.prompts(seed=0), 6):
        env = task.environment(sample)
        opening = await env.reset(sample)
        await env.close()
        assert tokenizer.unk_token_id not in opening
        assert tokenizer.decode(opening).startswith("Be brief!\nSum ")
        assert tokenizer.unk_token_id not in tokenizer.encode(sample.answer)


def test_the_env_flag_names_one_target_and_unknown_ones_list_the_available() -> None:
    assert parse_env("verifiers:examples/x.py") == ("verifiers", ("examples/x.py",))
    with pytest.raises(ValueError, match="name the environment"):
        parse_env("verifiers:")
    with pytest.raises(ValueError, match=r"no such environment; available: .*textarena"):
        check_target("no_such_vf_env")
    with pytest.raises(ValueError, match="no such file"):
        check_target("/nonexistent/env.py")


def test_a_missing_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "verifiers.v1", None)
    with pytest.raises(ValueError, match=r"asyncrl-train\[verifiers\]"):
        check_target("anything")


CONTAINER = """
import verifiers.v1 as vf


class BoxTask(vf.Task[vf.TaskData]):
    NEEDS_CONTAINER = True


class BoxTaskset(vf.Taskset[BoxTask, vf.TasksetConfig]):
    def load(self):
        return [BoxTask(vf.TaskData(prompt="1"))]


__all__ = ["BoxTaskset"]
"""


def test_the_run_checks_the_target_before_ray_starts(tmp_path: Path, env_files) -> None:
    from train_app.config import TrainConfig
    from train_app.tasks.spec import check_task_inputs, task_name, task_options

    config = TrainConfig(env=f"verifiers:{env_files['vf_sum_env']}", max_model_len=96)
    check_task_inputs(config)
    assert task_name(config) == "verifiers"
    options = task_options(config, tmp_path)
    assert options["target"] == env_files["vf_sum_env"] and options["max_total_tokens"] == 96
    boxed = tmp_path / "vf_box_env.py"
    boxed.write_text(textwrap.dedent(CONTAINER))
    with pytest.raises(ValueError, match="need a container"):
        check_task_inputs(TrainConfig(env=f"verifiers:{boxed}"))
