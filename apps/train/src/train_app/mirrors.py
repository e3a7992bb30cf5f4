"""Where else a run's metrics go: Weights & Biases (`--wandb-project`), beside metrics.jsonl
and TensorBoard, through `MetricsWriter`'s mirrors.

W&B is an optional extra of the app; `WANDB_MODE=offline` logs to `<run>/wandb/` without a
network (`wandb sync` uploads it later).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from train_app.config import TrainConfig
from train_app.outputs import MetricsMirror

logger = logging.getLogger(__name__)

__all__ = ["WANDB_MISSING", "WandbMirror", "open_mirrors", "wandb_config"]

WANDB_MISSING = (
    "--wandb-project needs the `wandb` extra: `uv sync --extra wandb` "
    "(or `pip install 'asyncrl-train[wandb]'`)"
)
# Key of the reward plot in the W&B run.
PLOT_KEY = "plot/reward"


def open_mirrors(
    config: TrainConfig, run_dir: Path, resume_step: int | None = None
) -> list[MetricsMirror]:
    """The mirrors `config` asks for (none without `--wandb-project`)."""
    if config.wandb_project is None:
        return []
    return [WandbMirror(config.wandb_project, Path(run_dir), wandb_config(config), resume_step)]


def wandb_config(config: TrainConfig) -> dict[str, Any]:
    """The run's configuration as W&B config values (paths as text)."""
    return {
        key: str(value) if isinstance(value, Path) else value
        for key, value in dataclasses.asdict(config).items()
    }


class WandbMirror:
    """One W&B run per run directory (a resume continues it: the same id, `resume="allow"`),
    written under `<run>/wandb/`. Logs the finite numeric metrics of each row at its step,
    the configuration, and the plot as an image."""

    def __init__(
        self,
        project: str,
        run_dir: Path,
        config: Mapping[str, Any],
        resume_step: int | None = None,
    ) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(WANDB_MISSING) from exc
        self._wandb = wandb
        self._last_step = resume_step or 0
        self.run = wandb.init(
            project=project,
            name=run_dir.name,
            id=re.sub(r"[^A-Za-z0-9_-]", "-", run_dir.name),
            dir=str(run_dir),
            config=dict(config),
            resume="allow",
            # The driver already writes its output to <run>/logs; W&B must not wrap stdout.
            settings=wandb.Settings(console="off"),
        )
        logger.info("W&B run %s (%s mode)", self.run.id, self.run.settings.mode)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        scalars = {
            key: value
            for key, value in metrics.items()
            if isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
        }
        # W&B's step only moves forward: a held-out evaluation's row, which arrives after
        # later steps' rows, goes to the latest step (its own is in `eval/step`).
        self._last_step = max(self._last_step, step)
        self.run.log(scalars, step=self._last_step)

    def add_plot(self, path: Path) -> None:
        if Path(path).exists():
            self.run.log({PLOT_KEY: self._wandb.Image(str(path))}, step=self._last_step)

    def close(self) -> None:
        self.run.finish()
