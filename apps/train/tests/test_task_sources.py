"""Every task source becomes a prompt stream and a scorer: task plugins found through the
`asyncrl.tasks` entry points, `--dataset` files (JSONL, JSON, Parquet, save_to_disk) as
epoch-ordered, seeded, sharded streams, and the one-line refusals of bad input before Ray
starts. Real `datasets`, real tokenizer; no engine. Costs about 10 s (mostly imports)."""

from __future__ import annotations

import json
import textwrap
from collections import Counter
from itertools import islice
from pathlib import Path

import pytest
from rollout_engine import Timings, Trajectory
from train_app import cli
from train_app import driver as run_module
from train_app.config import TrainConfig, load_toml, to_toml
from train_app.tasks import UnknownTask, all_tasks, make_task
from train_app.tasks.dataset import DatasetTask, format_prompt
from train_app.tasks.spec import task_name, task_options
from train_app.tiny_model import build_char_tokenizer

PLUGIN_MODULE = '''
import random
from dataclasses import dataclass
from rollout_engine import PromptSample

@dataclass
class EchoTask:
    """Prompt `d=`, answer `d` (a plugin task for the tests)."""
    tokenizer: object
    name: str = "echo"

    def prompts(self, seed):
        rng, index = random.Random(seed), 0
        while True:
            digit = str(rng.randrange(10))
            yield PromptSample(prompt_id=f"s{seed}-{index}",
                               prompt_ids=self.tokenizer.encode(digit + "="), answer=digit)
            index += 1

    def reward(self, sample, trajectory):
        ids = [i for i in trajectory.response_ids if i != self.tokenizer.eos_token_id]
        return float(self.tokenizer.decode(ids) == sample.answer)
'''


def make_plugin(root: Path, task: str = "echo-plugin") -> Path:
    """An installed distribution in `root` (put it on sys.path / PYTHONPATH): a module and a
    dist-info whose entry_points.txt registers `task` under `asyncrl.tasks`."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "echo_task_plugin.py").write_text(textwrap.dedent(PLUGIN_MODULE))
    info = root / "echo_task_plugin-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-task-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[asyncrl.tasks]\n{task} = echo_task_plugin:EchoTask\n")
    return root


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return build_char_tokenizer(Path(tmp_path_factory.mktemp("tok")))


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[TrainConfig]:
    calls: list[TrainConfig] = []

    def fake_run(config: TrainConfig, console: object) -> run_module.RunResult:
        calls.append(config)
        return run_module.RunResult(Path("runs/x"), {})

    monkeypatch.setattr(run_module, "run", fake_run)
    return calls


def _trajectory(ids: list[int]) -> Trajectory:
    return Trajectory(
        response_id="s", group_id="g", prompt_ids=[], response_ids=ids, behaviour_logprobs=[],
        token_versions=[], finish_reason="stop", timings=Timings(admitted_at=0.0),
    )  # fmt: skip


def test_builtin_tasks_come_from_the_entry_points() -> None:
    from importlib.metadata import entry_points

    names = {p.name for p in entry_points(group="asyncrl.tasks")}
    assert {"repeat", "shapes", "tool"} <= names
    assert {"repeat", "shapes", "tool"} <= set(all_tasks())


def test_an_installed_plugin_is_found_and_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer
) -> None:
    with pytest.raises(UnknownTask, match="available: repeat, shapes, tool"):
        make_task("echo-plugin", tokenizer)
    monkeypatch.syspath_prepend(str(make_plugin(tmp_path / "site")))
    assert "echo-plugin" in all_tasks()
    task = make_task("echo-plugin", tokenizer)
    sample = next(iter(task.prompts(3)))
    answer = [*tokenizer.encode(sample.answer), tokenizer.eos_token_id]
    assert task.reward(sample, _trajectory(answer)) == 1.0
    with pytest.raises(UnknownTask, match="available: echo-plugin, repeat"):
        make_task("nope", tokenizer)


ROWS = [{"prompt": f"{d}*{k}=", "answer": str(d) * k, "level": k} for d in range(5) for k in (1, 2)]


def _write(path: Path, rows: list[dict]) -> Path:
    import datasets

    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def _reward_file(tmp_path: Path) -> str:
    path = tmp_path / "score.py"
    path.write_text(
        "def exact(completion, answer, metadata):\n    return float(completion == answer)\n"
    )
    return f"{path}:exact"


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json", "rows.parquet", "rows_dir"])
def test_dataset_formats_stream_each_row_once_per_epoch(tmp_path: Path, tokenizer, name) -> None:
    path = _write(tmp_path / name, ROWS)
    task = DatasetTask(tokenizer, str(path), rewards=[_reward_file(tmp_path)], seed=1, epochs=2)
    samples = list(task.prompts(0))  # finite: two epochs
    assert len(samples) == 2 * len(ROWS)
    first, second = samples[: len(ROWS)], samples[len(ROWS) :]
    for epoch in (first, second):
        assert sorted(tokenizer.decode(s.prompt_ids) for s in epoch) == sorted(
            r["prompt"] for r in ROWS
        )
    assert [s.answer for s in first] != [s.answer for s in second]  # reshuffled per epoch
    assert len({s.prompt_id for s in samples}) == len(samples)
    assert first[0].metadata == {"level": str(len(first[0].answer))}  # other columns
    sample = first[0]
    right = [*tokenizer.encode(sample.answer), tokenizer.eos_token_id]
    assert task.reward(sample, _trajectory(right)) == 1.0
    assert task.reward(sample, _trajectory(tokenizer.encode("9"))) == 0.0
    assert task.metrics() == {"reward/exact": 0.5}


def test_dataset_order_is_seeded_and_replicas_share_it_without_overlap(
    tmp_path: Path, tokenizer
) -> None:
    path = _write(tmp_path / "rows.jsonl", ROWS)
    reward = [_reward_file(tmp_path)]

    def ids(seed: int, shard: int = 0, shards: int = 1) -> list[str]:
        task = DatasetTask(tokenizer, str(path), reward, seed=seed, shard=shard, shards=shards)
        return [s.prompt_id for s in islice(task.prompts(0), 3 * len(ROWS) // shards)]

    assert ids(1) == ids(1) and ids(1) != ids(2)
    shards = [ids(1, i, 2) for i in range(2)]
    assert not set(shards[0]) & set(shards[1])
    assert set(shards[0]) | set(shards[1]) == set(ids(1))  # endless without --epochs
    assert Counter(i.split("-")[0] for i in ids(1)) == {"e0": 10, "e1": 10, "e2": 10}


def test_chat_template_file_and_system_prompt(tmp_path: Path, tokenizer) -> None:
    template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    messages = [{"role": "user", "content": "12"}]
    ids = format_prompt(tokenizer, messages, template, system_prompt="3")
    assert tokenizer.decode(ids) == "3=12="
    plain = format_prompt(tokenizer, "1*2=", None, "4")  # no template: plain text, one per line
    assert plain == tokenizer.encode("4\n1*2=")
    assert format_prompt(tokenizer, [{"role": "user", "content": "1*2="}], None, None) == (
        tokenizer.encode("1*2=")
    )


def test_spec_makes_one_task_per_source(tmp_path: Path) -> None:
    config = TrainConfig(dataset=tmp_path / "d.jsonl", reward=("m:f", "x.py:g"))
    assert task_name(config) == "dataset"
    options = task_options(config, tmp_path, replica=1, replicas=3)
    assert (options["shard"], options["shards"]) == (1, 3)
    assert options["rewards"] == ("m:f", f"{Path('x.py').resolve()}:g")
    assert task_name(TrainConfig(env="reasoning-gym:gcd")) == "reasoning-gym"
    assert task_name(TrainConfig()) == "repeat" and task_options(TrainConfig(), tmp_path) == {}


def test_repeated_reward_flags_round_trip_through_the_toml(tmp_path: Path, recorded) -> None:
    path = _write(tmp_path / "rows.jsonl", ROWS)
    reward = _reward_file(tmp_path)
    argv = ["--dataset", str(path), "--reward", reward, "--reward", reward]
    assert cli.main([*argv, "--reward-weights", "1", "--reward-weights", "0.5"]) == 0
    config = recorded[0]
    assert config.reward == (reward, reward) and config.reward_weights == (1.0, 0.5)
    (tmp_path / "c.toml").write_text(to_toml(config))
    assert TrainConfig(**load_toml(tmp_path / "c.toml")) == config


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dataset", "{tmp}/absent.jsonl", "--reward", "{reward}"], "no such file"),
        (["--dataset", "{data}", "--reward", "{reward}", "--prompt-field", "question"],
         "no column 'question' (--prompt-field); its columns: prompt, answer, level"),
        (["--dataset", "{data}", "--reward", "{reward}", "--answer-field", "solution"],
         "no column 'solution'"),
        (["--dataset", "{empty}", "--reward", "{reward}"], "empty"),
        (["--dataset", "{data}"], "needs at least one --reward"),
        (["--dataset", "{data}", "--reward", "no_such_mod_q:f"], "cannot import no_such_mod_q"),
        (["--dataset", "{data}", "--reward", "{tmp}/score.py:absent"], "has no 'absent'"),
        (["--dataset", "{data}", "--reward", "{reward}", "--epochs", "1"],
         "needs 6400 prompts; 1 epoch(s) of 10 rows give 10"),
        (["--reward", "{reward}"], "give --dataset"),
        (["--env", "reasoning-gym:gcd", "--reward", "{reward}"], "--reward with --env"),
        (["--env", "gymnasium:CartPole"], "unknown library 'gymnasium'; available: reasoning-gym"),
        (["--env", "reasoning-gym:no_such_set"], "unknown dataset(s) no_such_set; available: "),
        (["--task", "tool", "--env", "reasoning-gym:gcd"], "give one task source"),
        (["--task", "nope"], "--task nope: choose from ['repeat', 'shapes', 'tool']"),
    ],
)  # fmt: skip
def test_bad_task_input_exits_2_before_the_run(
    tmp_path: Path, argv: list[str], message: str, recorded, capsys
) -> None:
    data = _write(tmp_path / "rows.jsonl", ROWS)
    (tmp_path / "empty.jsonl").write_text("")
    values = {"tmp": tmp_path, "data": data, "reward": _reward_file(tmp_path),
              "empty": tmp_path / "empty.jsonl"}  # fmt: skip
    assert cli.main([a.format(**values) for a in argv]) == 2
    captured = capsys.readouterr()
    out = " ".join((captured.out + captured.err).split())  # rich may wrap long lines
    assert message in out
    assert recorded == []


def test_a_resumed_dataset_stream_skips_consumed_rows_without_tokenizing(
    tmp_path: Path, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from train_app.prompts import PromptSource

    path = _write(tmp_path / "rows.jsonl", ROWS)
    task = DatasetTask(tokenizer, str(path), [_reward_file(tmp_path)], seed=1, epochs=1)
    first = [s.prompt_id for s in task.prompts(0)]
    consumed = first[:7]
    built: list[int] = []
    sample = task._sample
    monkeypatch.setattr(task, "_sample", lambda i, e: built.append(i) or sample(i, e))
    resumed = [s.prompt_id for s in PromptSource(task, 0, consumed=consumed)]
    assert resumed == first[7:]
    assert len(built) == len(ROWS) - 7  # the consumed rows were never built
