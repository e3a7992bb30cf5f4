"""A chaos-suite driver: `apps/train`'s run with FakeEngine replicas, in its own process.

`python fake_run.py '<TrainConfig fields as JSON, plus time_per_token_s>'` runs
`train_app.driver.run` with `train_app.testing.fake_engines` (the real Ray, queue, trainer and
driver; engines that start in milliseconds) and exits like `uv run apps/train`: 0, 1 with
"run failed: <cause>", or 128 + the signal after SIGINT / SIGTERM.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from train_app.config import TrainConfig
from train_app.driver import RunFailed, RunInterrupted, run
from train_app.testing import fake_engines


def main(argv: list[str]) -> int:
    fields = json.loads(argv[0])
    # Seconds per fake token: slow enough that a step takes a fraction of a second, so a
    # hit lands mid-run (a 10-step run is over in a few seconds otherwise).
    time_per_token_s = float(fields.pop("time_per_token_s", 0.01))
    for key in ("runs_dir", "resume"):
        if fields.get(key) is not None:
            fields[key] = Path(fields[key])
    console = Console()
    try:
        result = run(
            TrainConfig(**fields),
            console,
            adjust_plan=lambda p: fake_engines(p, time_per_token_s=time_per_token_s),
        )
    except RunFailed as exc:
        console.print(f"run failed: {exc}")
        return 1
    except RunInterrupted as exc:
        console.print(f"interrupted ({exc.signal_name}): {exc.detail}")
        return exc.exit_code
    console.print(f"outputs in {result.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
