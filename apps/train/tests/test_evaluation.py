"""Held-out evaluation: when a replica evaluates, how the driver merges the replicas' records,
and where the rows go (metrics.jsonl with its rewind, the summary, the plot).

`ReplicaEvaluator`'s scheduling is tested against a stand-in rollouter (`_Rollouter`, a fake
whose `evaluate` returns a scripted `EvalResult` after a delay): what is tested is which
step's weights are evaluated and when, not generation. The rollouter's own `evaluate` is
tested on FakeEngine in packages/rollout-engine, and a whole run in test_eval_run.py.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
from rollout_engine import EvalResult, SamplingConfig, Timings, Trajectory
from train_app.evaluation import (
    EvalCollector,
    EvalPlan,
    ReplicaEvaluator,
    eval_metrics,
    eval_prompts,
    replica_record,
)
from train_app.outputs import MetricsWriter, is_eval_row, rewind_metrics, summarize_metrics


def _trajectory(reward: float) -> Trajectory:
    return Trajectory(
        response_id="g:0", group_id="g", prompt_token_ids=[1], response_ids=[2],
        behaviour_logprobs=[0.0], token_versions=[0], finish_reason="stop", reward=reward,
        timings=Timings(admitted_at=0.0),
    )  # fmt: skip


def _result(rewards: list[list[float] | None], version: int = 0) -> EvalResult:
    groups = tuple(None if g is None else tuple(_trajectory(r) for r in g) for g in rewards)
    errors = tuple("RuntimeError: x" if g is None else None for g in rewards)
    return EvalResult(groups, errors, version, 0.5)


def _plan(**overrides: object) -> EvalPlan:
    options: dict = {
        "task": "dataset", "task_options": {}, "prompt_seed": 999, "samples": 4, "shard": 0,
        "shards": 1, "n": 2, "sampling": SamplingConfig(temperature=1.0), "every": 3,
        "sync_every": 1,
    }  # fmt: skip
    return EvalPlan(**{**options, **overrides})


class _Rollouter:
    """Stand-in rollouter (a fake): `evaluate` records the version and returns a result."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.version = 0
        self.delay_s = delay_s
        self.evaluated: list[int] = []

    async def evaluate(self, prompts, sampling, *, n, reward_fn, max_concurrency) -> EvalResult:
        version = self.version
        self.evaluated.append(version)
        await asyncio.sleep(self.delay_s)
        return _result([[1.0, 0.0], [0.5, 0.5]], version)


async def test_a_replica_evaluates_at_the_start_every_n_steps_and_at_the_end() -> None:
    rollouter = _Rollouter()
    evaluator = ReplicaEvaluator(_plan(every=3), 0, rollouter, [], None)
    evaluator.first(0)
    for version in range(1, 8):
        await asyncio.sleep(0.01)
        rollouter.version = version
        evaluator.on_version(version)
    await evaluator.last(7)
    await evaluator.last(7)  # the last weights were just evaluated: nothing more
    reply = evaluator.results({})
    assert [r["step"] for r in reply["records"]] == [0, 3, 6, 7]
    assert rollouter.evaluated == [0, 3, 6, 7]
    # Kept until acknowledged, so a lost reply is sent again.
    assert evaluator.results({reply["source"]: 2})["records"][0]["step"] == 6
    assert evaluator.results({reply["source"]: 4})["records"] == []


async def test_steps_follow_sync_every_and_a_resume_waits_for_its_weights() -> None:
    rollouter = _Rollouter()
    plan = _plan(every=4, sync_every=2, base_step=10, base_version=5, resumed=True)
    evaluator = ReplicaEvaluator(plan, 0, rollouter, [], None)
    evaluator.first(5)  # the checkpoint's weights, pushed at start: step 10
    for version in range(5, 10):
        rollouter.version = version
        evaluator.on_version(version)
        await asyncio.sleep(0.01)
    await evaluator.last(18)
    assert [r["step"] for r in evaluator.results({})["records"]] == [10, 12, 16, 18]


async def test_a_slow_evaluation_skips_the_steps_it_overlaps() -> None:
    rollouter = _Rollouter(delay_s=0.2)
    evaluator = ReplicaEvaluator(_plan(every=1), 0, rollouter, [], None)
    evaluator.first(0)
    for version in range(1, 5):
        rollouter.version = version
        evaluator.on_version(version)  # all while step 0's evaluation runs
    await evaluator.last(4)
    assert [r["step"] for r in evaluator.results({})["records"]] == [0, 4]


def test_records_merge_into_one_row_per_step() -> None:
    a = replica_record(20, 0, _result([[1.0, 0.0], None], version=20))
    b = replica_record(20, 1, _result([[0.5, 0.5], [1.0, 1.0]], version=21))
    collector = EvalCollector(replicas=2, n=2)
    assert collector.take([{"source": "x", "records": [{**a, "seq": 1}]}]) == []
    (row,) = collector.take([{"source": "y", "records": [{**b, "seq": 1}]}])
    step, metrics = row
    assert step == 20 and collector.acked == {"x": 1, "y": 1}
    assert metrics["eval/reward/mean"] == pytest.approx(4.0 / 6)
    assert metrics["eval/pass@2"] == pytest.approx(2 / 3)  # 3 scored prompts, 2 pass
    assert (metrics["eval/samples"], metrics["eval/failed"], metrics["eval/version"]) == (3, 1, 20)
    assert collector.add([a]) == []  # a repeat of a written step
    collector.add([replica_record(40, 0, _result([[0.0]]))])
    ((step, partial),) = collector.flush()  # replica 1 never reported step 40
    assert step == 40 and partial["eval/samples"] == 1
    assert math.isnan(eval_metrics([replica_record(0, 0, _result([None]))], 1)["eval/pass@1"])


def test_eval_prompts_take_a_shard_of_the_first_samples() -> None:
    from rollout_engine.testing import make_prompts

    picked = eval_prompts(_plan(samples=5, shard=1, shards=2), iter(make_prompts(100)))
    assert [p.prompt_id for p in picked] == ["eval/p1", "eval/p3"]
    assert len(eval_prompts(_plan(samples=50), iter(make_prompts(3)))) == 3


def test_eval_rows_in_metrics_jsonl_survive_a_rewind(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.log_eval({"eval/reward/mean": 0.1, "eval/pass@1": 0.0, "eval/step": 0.0}, 0)
    for step in range(1, 5):
        writer.log({"reward/mean": step / 10}, step)
        if step % 2 == 0:
            writer.log_eval({"eval/reward/mean": step / 5, "eval/pass@1": 0.5}, step)
    assert writer.rows == 4 and writer.last_row["step"] == 4
    writer.close()
    summary = summarize_metrics(tmp_path / "metrics.jsonl")
    assert summary["steps"] == 4 and summary["eval_reward_first"] == 0.1
    assert summary["eval_reward_last"] == 0.8 and summary["eval_pass@1_last"] == 0.5
    assert summary["eval_steps"] == "0..4"

    kept = rewind_metrics(tmp_path / "metrics.jsonl", 2)
    assert [(r["step"], is_eval_row(r)) for r in kept] == [
        (0, True), (1, False), (2, False), (2, True),
    ]  # fmt: skip
    resumed = MetricsWriter(tmp_path, tensorboard=False, resume_step=2)
    assert resumed.rows == 2 and resumed.last_row["step"] == 2  # step rows only
    resumed.close()


# Measured: 6 s (matplotlib's import, on 2 shared cores).
@pytest.mark.slow
def test_the_plot_draws_the_eval_rows(tmp_path: Path) -> None:
    from train_app.outputs import plot_metrics

    rows = [{"step": 0, "eval/reward/mean": 0.1, "eval/pass@2": 0.0}]
    rows += [{"step": s, "reward/mean": s / 10} for s in range(1, 4)]
    rows += [{"step": 3, "eval/reward/mean": 0.6, "eval/pass@2": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "reward.png")
    assert png.stat().st_size > 0
