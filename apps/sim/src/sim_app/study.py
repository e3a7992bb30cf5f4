"""The README's study: k x pacing x partial rollout x rollout:train split, at two scales.

- `small`: this machine's calibrated preset (`this-machine`): one engine and one trainer on 2
  cores. The split is the share of compute given to generation at a fixed total: 50 % is the
  machine as measured; 33 % makes decoding 1.5x slower and training 1.33x faster, etc.
  "50 %, isolated" removes the measured async slowdown (two cores that do not interfere).
- `gpu`: `gpu-7b-64x64` with 128 GPUs split 48:80, 64:64 or 80:48 (rollout replicas = rollout
  GPUs; the trainer's cost scales with 64 / train GPUs).

Every cell is one simulated run (seed 0); sync (k = 0) at each split is the reference.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

from sim_app.models import Contention
from sim_app.pipeline import SimConfig, simulate
from sim_app.presets import load_preset

__all__ = ["GRID", "markdown", "run_study", "split_config"]

GRID = {
    "max_staleness": (1, 2, 4),
    "pacing": ("eager", "fresh"),
    "partial_rollout": (True, False),
}
# Small scale: the rollout share of the machine; "iso" is 50 % with the measured async
# slowdown (contention on 2 cores) removed: what async would buy on isolated cores.
SPLITS: dict[str, tuple[Any, ...]] = {"small": (0.33, 0.5, 0.67, "iso"), "gpu": (48, 64, 80)}
PRESETS = {"small": "this-machine", "gpu": "gpu-7b-64x64"}
STEPS = {"small": 120, "gpu": 200}
QUICK_STEPS = {"small": 40, "gpu": 40}


def split_config(scale: str, config: SimConfig, split: Any) -> SimConfig:
    """`config` with the given rollout share (small: a fraction; gpu: rollout GPUs of 128)."""
    if scale == "small":
        if split == "iso":
            return config.with_(contention=Contention())
        share = float(split)
        return config.with_(
            decode=config.decode.scaled(0.5 / share),
            trainer=config.trainer.scaled((1 - share) / 0.5),
        )
    rollout = int(split)
    train = 128 - rollout
    return config.with_(
        replicas=rollout,
        simulate_replicas=min(config.simulate_replicas or rollout, rollout),
        trainer=replace(
            config.trainer.scaled(64 / train),
            overhead_s=config.trainer.overhead_s,
            export_s=config.trainer.export_s,
        ),
    )


def _cell(result: Any, reference: float) -> dict[str, Any]:
    s = result.summary()
    delivered = result.consumed_groups + s["dropped"]
    return {
        "s / version": round(result.version_time_s, 3),
        "speedup": round(reference / result.version_time_s, 3),
        "staleness": round(s["staleness_mean"], 2),
        "dropped": f"{100 * s['dropped'] / delivered:.1f}%" if delivered else "0%",
        "trainer idle": round(s["trainer_idle_ratio"], 3),
        "rollout idle": round(s["rollout_idle_ratio"], 3),
        "partial": round(s["partial_ratio"], 3),
    }


def run_study(
    scale: str, steps: int | None = None, quick: bool = False
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    base = load_preset(PRESETS[scale]).config
    steps = steps or (QUICK_STEPS if quick else STEPS)[scale]
    base = base.with_(steps=steps, seed=0)
    rows: list[dict[str, Any]] = []
    for split in SPLITS[scale]:
        config = split_config(scale, base, split)
        sync = simulate(config.with_(mode="sync"))
        reference = sync.version_time_s
        if scale == "gpu":
            label = f"{split}:{128 - int(split)}"
        else:
            label = "50%, isolated" if split == "iso" else f"{round(split * 100)}%"
        rows.append({"split": label, "setting": "sync (k=0)", **_cell(sync, reference)})
        for k, pacing, partial in itertools.product(*GRID.values()):
            if k == 1 and pacing == "fresh":
                continue  # fresh pacing is eager at k = 1 (lookahead >= 1)
            result = simulate(
                config.with_(mode="async", max_staleness=k, pacing=pacing, partial_rollout=partial)
            )
            setting = f"k={k} {pacing}{'' if partial else ', no partial'}"
            rows.append({"split": label, "setting": setting, **_cell(result, reference)})
    return rows, {"scale": scale, "steps": steps, "rows": rows}


def markdown(rows: list[dict[str, Any]]) -> str:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
