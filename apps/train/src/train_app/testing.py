"""Test helpers of the app: the run with `rollout_engine.testing.FakeEngine` replicas.

Never used by the app itself (its engine is vLLM). Tests of scheduling and of faults
(replicas, restarts, the chaos suite) pass `fake_engines` as `run(..., adjust_plan=...)`: the
real Ray, queue, trainer and driver with engines that start in milliseconds and produce
random tokens.
"""

from __future__ import annotations

import dataclasses

from rollout_engine.testing import FakeEngineConfig

from train_app.plan import RunPlan

__all__ = ["fake_engines"]


def fake_engines(
    run_plan: RunPlan, time_per_token_s: float = 0.01, fixed_length: int | None = None
) -> RunPlan:
    """Every replica on a FakeEngine: its own seed, responses of ~4 tokens (exactly
    `fixed_length` when given) from a 20-token vocabulary, `time_per_token_s` of real
    asyncio time per token, and the plan's starting weight version (a resumed run's)."""
    eos = run_plan.replicas[0].rollout.sampling.stop_token_ids[0]
    replicas = tuple(
        dataclasses.replace(
            r,
            engine=FakeEngineConfig(
                seed=r.replica,
                vocab_size=20,
                eos_token_id=eos,
                median_length=4,
                fixed_length=fixed_length,
                time_per_token_s=time_per_token_s,
                initial_version=r.engine.initial_version,
            ),
        )
        for r in run_plan.replicas
    )
    return dataclasses.replace(run_plan, replicas=replicas)
