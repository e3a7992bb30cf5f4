"""Side-by-side runs of one preset in several modes, their figures and a PNG.

The default set answers "what does async buy at this scale, and at what staleness":
sync (the same code with k = 0), async with eager and with fresh pacing at k = 2 and, where
the preset describes one, verl's colocated sync baseline on all the GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim_app.pipeline import SimConfig, SimResult, simulate

__all__ = ["DEFAULT_VARIANTS", "Variant", "plot", "run_variants", "speedups", "table_rows"]


@dataclass(frozen=True)
class Variant:
    label: str
    changes: dict[str, Any]


DEFAULT_VARIANTS = (
    Variant("sync (k=0)", {"mode": "sync"}),
    Variant("async k=2 eager", {"mode": "async", "max_staleness": 2, "pacing": "eager"}),
    Variant("async k=2 fresh", {"mode": "async", "max_staleness": 2, "pacing": "fresh"}),
    Variant("colocated sync", {"mode": "colocate"}),
)


def run_variants(
    config: SimConfig, variants: Sequence[Variant] = DEFAULT_VARIANTS
) -> list[tuple[Variant, SimResult]]:
    """Simulate each variant of `config` (colocate only when the preset describes it)."""
    out = []
    for variant in variants:
        if variant.changes.get("mode") == "colocate" and config.colocate_replicas is None:
            continue
        out.append((variant, simulate(config.with_(**variant.changes))))
    return out


def speedups(results: Sequence[tuple[Variant, SimResult]]) -> dict[str, float]:
    """Seconds per weight version of each baseline over each async variant's."""
    times = {v.label: r.version_time_s for v, r in results}
    out: dict[str, float] = {}
    for label, seconds in times.items():
        if not label.startswith("async"):
            continue
        key = label.replace(" ", "_").replace("=", "")
        for base in ("sync (k=0)", "colocated sync"):
            if base in times:
                suffix = "sync" if base.startswith("sync") else "colocated"
                out[f"speedup_{key}_vs_{suffix}"] = round(times[base] / seconds, 3)
    return out


def table_rows(results: Sequence[tuple[Variant, SimResult]]) -> list[dict[str, Any]]:
    rows = []
    for variant, result in results:
        s = result.summary()
        rows.append(
            {
                "variant": variant.label,
                "s / version": round(result.version_time_s, 2),
                "samples/s": round(s["samples_per_s"], 2),
                "tokens/s": round(s["tokens_per_s"]),
                "staleness mean": round(s["staleness_mean"], 2),
                "staleness hist": "/".join(str(n) for n in s["staleness_hist"]),
                "dropped": s["dropped"],
                "trainer idle": round(s["trainer_idle_ratio"], 3),
                "rollout idle": round(s["rollout_idle_ratio"], 3),
                "engine busy": round(s["engine_busy_ratio"], 3),
                "partial": round(s["partial_ratio"], 3),
                "cpu s": round(s["cpu_s"], 2),
            }
        )
    return rows


def plot(results: Sequence[tuple[Variant, SimResult]], path: str | Path, title: str) -> Path:
    """Four panels: seconds per version, staleness histogram, idle/busy ratios, and prompts
    trained against virtual time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    labels = [v.label for v, _ in results]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    ax = axes[0][0]
    ax.bar(labels, [r.version_time_s for _, r in results], color="tab:blue")
    ax.set_ylabel("seconds per weight version")
    ax.tick_params(axis="x", labelrotation=15)
    ax.set_title("time per version (lower is better)")
    ax = axes[0][1]
    width = 0.8 / max(1, len(results))
    for i, (variant, result) in enumerate(results):
        hist = result.staleness_hist
        total = sum(hist.values()) or 1
        xs = sorted(hist)
        offset = (i - (len(results) - 1) / 2) * width
        ax.bar([x + offset for x in xs], [hist[x] / total for x in xs], width, label=variant.label)
    ax.set_xticks(sorted({s for _, r in results for s in r.staleness_hist}))
    ax.set_xlabel("staleness at consumption (versions)")
    ax.set_ylabel("fraction of samples")
    ax.legend(fontsize=8)
    ax.set_title("staleness histogram")
    ax = axes[1][0]
    metrics = ("trainer_idle_ratio", "rollout_idle_ratio", "engine_busy_ratio")
    for j, name in enumerate(metrics):
        values = [r.summary()[name] for _, r in results]
        ax.bar([i + j * 0.27 for i in range(len(results))], values, 0.27, label=name)
    ax.set_xticks([i + 0.27 for i in range(len(results))], labels, rotation=15)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("idle and busy ratios")
    ax = axes[1][1]
    for variant, result in results:
        walls = [rec["trainer/wall_s"] for rec in result.records]
        prompts, total = [], 0
        for rec in result.records:
            total += rec["trainer/samples"]
            prompts.append(total / result.config.group_size)
        ax.plot(walls, prompts, label=variant.label)
    ax.set_xlabel("virtual seconds")
    ax.set_ylabel("prompts trained")
    ax.legend(fontsize=8)
    ax.set_title("progress")
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
