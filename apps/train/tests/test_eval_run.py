"""Evaluation while training, through the whole app: real Ray, the real queue, trainer and
driver, with `rollout_engine.testing.FakeEngine` replicas (random tokens, no model) through
the app's test hook `train_app.testing.fake_engines`: what is tested is when evaluations
run and where their rows go, and that held-out prompts never reach training, none of which
depends on what the tokens are. The held-out set is the repeat example's JSONL file, scored
by its reward file; training is the built-in `repeat` task.

Cost: one local Ray cluster for the module, then a run of four actor processes (torch and
transformers imports; no vLLM) and a few seconds of training.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from ppo_trainer import read_checkpoint_meta
from rich.console import Console
from train_app.config import TrainConfig
from train_app.driver import run
from train_app.outputs import is_eval_row
from train_app.plan import RunPlan
from train_app.testing import fake_engines

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "repeat-jsonl"


def _fake_engines(run_plan: RunPlan) -> RunPlan:
    return fake_engines(run_plan, time_per_token_s=0.001)


# Measured on 2 shared cores at load ~20: 141 s (1 replica) and 160 s (2 replicas) per run,
# plus 44 s for the module's Ray start.
@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2], ids=["1-replica", "2-replicas"])
def test_eval_rows_at_the_start_every_n_steps_and_at_the_end(
    ray_cluster: None, tmp_path: Path, replicas: int
) -> None:
    config = TrainConfig(
        runs_dir=tmp_path, name=f"eval{replicas}", steps=7, batch_size=4, group_size=2,
        max_tokens=6, checkpoint_every=0, progress=False, lr_schedule="constant",
        rollout_replicas=replicas, reward=(f"{EXAMPLE / 'reward.py'}:repeat_reward",),
        eval_dataset=EXAMPLE / "repeat.jsonl", eval_every=3, eval_samples=10, eval_n=2,
        eval_temperature=1.0,
    )  # fmt: skip
    result = run(config, Console(file=io.StringIO()), adjust_plan=_fake_engines)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").open()]
    steps = [r["step"] for r in rows if not is_eval_row(r)]
    evals = {r["step"]: r for r in rows if is_eval_row(r)}
    assert steps == list(range(1, 8))
    # The start (the initial weights), every 3 steps, and the end (step 7).
    assert sorted(evals) == [0, 3, 6, 7]
    for step, row in evals.items():
        assert row["eval/samples"] == 10 and row["eval/failed"] == 0, row
        assert 0.0 <= row["eval/reward/mean"] <= 1.0 and 0.0 <= row["eval/pass@2"] <= 1.0
        assert row["eval/step"] == step and row["eval/version"] >= step
    assert not any(k.startswith("eval/") for r in rows if not is_eval_row(r) for k in r)

    # Held-out prompts never reach training: nothing of them was consumed, and every
    # admitted group is accounted for by training (the ledger holds no evaluation).
    meta = read_checkpoint_meta(result.run_dir / "checkpoints" / "latest")
    consumed = set(meta.consumed_prompt_ids)
    assert len(consumed) == 4 * 7
    assert not any(p.startswith(("eval/", "e0-r")) for p in consumed), sorted(consumed)[:5]
    groups = result.summary["groups"]
    assert groups["balanced"], groups
    assert groups["trainer"]["trained"] == 28

    summary = result.summary
    assert summary["eval_steps"] == "0..7"
    assert summary["eval_reward_last"] == evals[7]["eval/reward/mean"]
    assert "eval_pass@2_last" in summary
