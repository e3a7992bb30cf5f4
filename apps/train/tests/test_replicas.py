"""N rollout replicas through real Ray, the real queue and trainer actors, with FakeEngine.

The engines are `rollout_engine.testing.FakeEngine` (random tokens, no model) so that these
runs take seconds: what is tested is the scheduling across replicas (the batch split, the
admission budget, the metrics merge), which does not depend on what the tokens are. The
trainer is the real `PPOTrainer` on the tiny Qwen2 model. Before the batch split handed out
the remainder, batch 16 over 3 replicas stalled: at step 0 with k = 0 and at step 30 with
k = 2 (replicas admitted 15 groups per version; the trainer consumed 16).

Cost: one local Ray cluster for the module (~5-10 s idle, 33 s measured at load 10), then
each run starts four actor processes (imports of torch and transformers; no vLLM) and trains
a few seconds: 76-112 s per run measured with the 2 cores shared by a load of 10, so the
2-replica case is marked slow (CI runs it).
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
from train_app.plan import RunPlan
from train_app.testing import fake_engines


def _fake_engines(run_plan: RunPlan) -> RunPlan:
    """Every replica on a FakeEngine (short responses, a real asyncio clock)."""
    return fake_engines(run_plan, time_per_token_s=0.001)


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


# Whole runs through Ray (FakeEngine replicas, the real trainer): 120-160 s each measured
# on 2 shared cores at load ~22 (plus ~40 s for the module's Ray start).
@pytest.mark.slow
@pytest.mark.parametrize(
    ("replicas", "k", "steps"),
    [(3, 0, 6), (3, 2, 34), (2, 1, 8)],
    ids=["3-replicas-k0", "3-replicas-k2-past-step-30", "2-replicas-k1"],
)
def test_replicas_feed_every_batch(
    ray_cluster: None, tmp_path: Path, replicas: int, k: int, steps: int
) -> None:
    config = TrainConfig(
        runs_dir=tmp_path, name=f"r{replicas}k{k}", steps=steps, batch_size=16, group_size=2,
        max_staleness=k, rollout_replicas=replicas, max_tokens=6, checkpoint_every=0,
        progress=False, lr_schedule="constant",
    )  # fmt: skip
    result = run(config, Console(file=io.StringIO()), adjust_plan=_fake_engines)
    records = _records(result.run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(r["staleness/max"] <= k for r in records)
    meta = read_checkpoint_meta(result.run_dir / "checkpoints" / "latest")
    assert len(meta.consumed_group_ids) == len(set(meta.consumed_prompt_ids)) == 16 * steps
    last = records[-1]
    per_replica = [last[f"rollout/replica{i}/tokens/s"] for i in range(replicas)]
    assert all(v > 0 for v in per_replica)  # every replica generated
    idle = [last[f"rollout/replica{i}/idle_ratio"] for i in range(replicas)]
    assert last["rollout/idle_ratio"] == pytest.approx(sum(idle) / replicas)
    assert f"rollout/replica{replicas}/tokens/s" not in last
    assert result.summary["startup"]["engine_s"] >= 0
