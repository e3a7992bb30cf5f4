"""Rollout metrics of several replicas, merged (pure function, no Ray)."""

from __future__ import annotations

import pytest
from train_app.replica_metrics import aggregate_replica_metrics


def test_sums_means_and_maxima_with_per_replica_figures() -> None:
    merged = aggregate_replica_metrics(
        [
            {"rollout/idle_ratio": 0.2, "tokens/s": 100.0, "staleness/max": 1.0,
             "rollout/active_tasks": 3.0, "event_loop/lag_ms_p99": 4.0, "rollout/failed": 1.0},
            {"rollout/idle_ratio": 0.4, "tokens/s": 50.0, "staleness/max": 2.0,
             "rollout/active_tasks": 1.0, "event_loop/lag_ms_p99": 9.0, "rollout/failed": 0.0},
        ]
    )  # fmt: skip
    assert merged["rollout/idle_ratio"] == pytest.approx(0.3)
    assert merged["tokens/s"] == 150.0
    assert merged["rollout/active_tasks"] == 4.0
    assert merged["rollout/failed"] == 1.0
    assert merged["staleness/max"] == 2.0
    assert merged["event_loop/lag_ms_p99"] == 9.0
    assert merged["rollout/replica0/idle_ratio"] == 0.2
    assert merged["rollout/replica1/tokens/s"] == 50.0
    assert merged["rollout/replica1/event_loop/lag_ms_p99"] == 9.0


def test_one_replica_is_unchanged() -> None:
    metrics = {"rollout/idle_ratio": 0.25, "tokens/s": 10.0}
    assert aggregate_replica_metrics([metrics]) == metrics


def test_a_silent_replica_is_left_out() -> None:
    merged = aggregate_replica_metrics([{"tokens/s": 10.0}, None, {"tokens/s": 5.0}])
    assert merged["tokens/s"] == 15.0
    assert "rollout/replica1/tokens/s" not in merged
    assert merged["rollout/replica2/tokens/s"] == 5.0
