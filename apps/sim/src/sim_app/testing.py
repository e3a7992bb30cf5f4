"""Small configurations for tests and property checks of the simulator."""

from __future__ import annotations

import random

from sim_app.models import DecodeModel, LengthModel, TrainerModel
from sim_app.pipeline import SimConfig

__all__ = ["SMALL", "random_config"]

SMALL = SimConfig(
    steps=30,
    batch_size=4,
    group_size=4,
    max_concurrency=4,
    decode=DecodeModel(iteration_s=0.01, per_seq_s=0.001, pause_s=0.01, load_s=0.02),
    trainer=TrainerModel(step_s=0.05, per_token_s=1e-4, push_s=0.01, jitter=0.3),
    lengths=LengthModel(median=6, sigma=0.8, max_tokens=16, cap_fraction=0.1),
)


def random_config(seed: int) -> SimConfig:
    """A random small configuration for property tests (seeded)."""
    rng = random.Random(seed)
    replicas = rng.choice([1, 1, 2])
    return SimConfig(
        mode=rng.choice(["async", "async", "async", "sync"]),
        seed=seed,
        steps=rng.randint(6, 14),
        batch_size=replicas * rng.randint(1, 4),
        group_size=rng.randint(1, 4),
        max_concurrency=rng.randint(1, 6),
        max_staleness=rng.randint(0, 3),
        pacing=rng.choice(["eager", "fresh"]),
        partial_rollout=rng.random() < 0.7,
        pause_mode=rng.choice(["keep", "abort"]),
        sync_every=rng.choice([1, 1, 2]),
        replicas=replicas,
        failure_rate=rng.choice([0.0, 0.05, 0.2]),
        decode=DecodeModel(
            iteration_s=rng.uniform(0.002, 0.02),
            per_seq_s=rng.uniform(0, 0.002),
            prefill_s=rng.uniform(0, 0.01),
            pause_s=rng.uniform(0, 0.02),
            load_s=rng.uniform(0, 0.05),
            resume_s=rng.uniform(0, 0.01),
            max_num_seqs=rng.choice([4, 8, 64]),
        ),
        trainer=TrainerModel(
            step_s=rng.uniform(0.005, 0.3),
            per_token_s=rng.uniform(0, 1e-3),
            push_s=rng.uniform(0, 0.05),
            background_push=rng.random() < 0.7,
            jitter=rng.uniform(0, 0.8),
        ),
        lengths=LengthModel(
            median=rng.uniform(2, 12),
            sigma=rng.uniform(0.1, 1.5),
            max_tokens=rng.choice([8, 16, 32]),
            cap_fraction=rng.choice([0.0, 0.1, 0.3]),
        ),
    )
