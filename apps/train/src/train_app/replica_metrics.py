"""Rollout metrics of N replicas as one set: totals, means and maxima, plus each replica's own.

Each rollout actor reports `Rollouter.metrics()` (named in `rollout_engine.metrics`), its
event loop's lag and `rollout/failed`. The run's figure for a name is:

- a sum for amounts of the whole run (`rollout/active_tasks`, `rollout/failed`, `tokens/s`,
  `rollout/resume_*`);
- a max for worst cases (`staleness/max`, `rollout/drain_interrupt_ms`, `event_loop/*`);
- the mean over replicas for ratios and per-replica levels (everything else:
  `rollout/idle_ratio`, `rollout/partial_ratio`, `rollout/pacing_lookahead`,
  `staleness/mean`).

With more than one replica, each replica's figures are also kept under
`rollout/replica{i}/<name>` (the `rollout/` prefix of a name is not repeated:
`rollout/replica1/idle_ratio`, `rollout/replica1/tokens/s`). A replica that did not answer
(None) is left out.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

__all__ = ["SUMMED", "aggregate_replica_metrics"]

SUMMED = frozenset(
    {
        "rollout/active_tasks",
        "rollout/failed",
        "rollout/filtered_groups",
        "rollout/generated_reward_sum",
        "rollout/generated_responses",
        "rollout/stale_retried",
        "tokens/s",
        # What a resumed run continued from its checkpoint's in-flight groups
        # (`train_app.inflight`): counts of the whole run.
        "rollout/resume_restored",
        "rollout/resume_dropped_stale",
        "rollout/resume_dropped_tokens",
    }
)
_MAXED = frozenset({"staleness/max", "rollout/drain_interrupt_ms"})


def _reduce(name: str, values: list[float]) -> float:
    if name in SUMMED:
        return float(sum(values))
    if name in _MAXED or name.startswith("event_loop/"):
        return float(max(values))
    return float(statistics.fmean(values))


def aggregate_replica_metrics(
    per_replica: Sequence[Mapping[str, float] | None],
) -> dict[str, float]:
    """One metrics dict for all replicas (see the module doc)."""
    answered = [(i, m) for i, m in enumerate(per_replica) if m is not None]
    names = sorted({name for _, m in answered for name in m})
    merged = {
        name: _reduce(name, [float(m[name]) for _, m in answered if name in m]) for name in names
    }
    if len(per_replica) > 1:
        for i, metrics in answered:
            for name, value in metrics.items():
                short = name.removeprefix("rollout/")
                merged[f"rollout/replica{i}/{short}"] = float(value)
    return merged
