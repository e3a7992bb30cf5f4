"""Benchmark runner: a readable table, then one JSON object as the last line of output."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import logging
import shlex
import sys

from rich.console import Console
from rich.table import Table

from bench_app.report import BenchReport

# name -> (module, one-line description). Modules are imported only when run, so listing
# benchmarks never imports vLLM or torch.
BENCHES: dict[str, tuple[str, str]] = {
    "queue": ("bench_app.queue_bench", "queue actor vs ray.util.queue.Queue: items/s, latency"),
    "vision": (
        "bench_app.vision_bench",
        "event-loop lag: inline qwen-vl-utils vs VisionPreprocessor",
    ),
    "drain": ("bench_app.drain_bench", "resume-to-dispatch latency vs wait-for-all drain"),
    "rollout": ("bench_app.rollout_bench", "tokens/s: Rollouter+VLLMEngine vs AsyncLLM direct"),
    "trainer": ("bench_app.trainer_bench", "tokens/s: PPOTrainer vs a minimal torch loop"),
    "e2e": ("bench_app.e2e_bench", "time to reward 0.7: async vs its sync mode, 5 seeds"),
    "study": ("bench_app.study_bench", "time to 0.7 over k x pacing x correction, 3 seeds each"),
    "scale": (
        "bench_app.scale_bench",
        "cost vs model size (0.1M..0.5B) and response length: push, trainer, memory",
    ),
    "resume": (
        "bench_app.resume_bench",
        "resume state at 1M prompts: checkpoint bytes, resume latency, memory growth",
    ),
    "sim": (
        "bench_app.sim_bench",
        "simulator: calibration error vs e2e, 10k steps CPU time, 64:64 GPUs at 7B",
    ),
}


def _print_report(name: str, report: BenchReport, console: Console) -> None:
    table = Table(title=report.title)
    columns: list[str] = []
    for row in report.rows:
        for key in row:
            if key not in columns:
                columns.append(key)
    for column in columns:
        table.add_column(column)
    for row in report.rows:
        table.add_row(*(_fmt(row.get(c, "")) for c in columns))
    console.print(table)
    for note in report.notes:
        console.print(f"- {note}")


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return str(value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="apps/bench", description=__doc__)
    parser.add_argument("name", nargs="?", help="benchmark to run")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (smoke test)")
    parser.add_argument(
        "--seeds", type=int, help="e2e, study: seeds 0..N-1 (default: e2e 5, study 3; --quick 1)"
    )
    parser.add_argument(
        "--steps", type=int, help="e2e, study: trainer steps per run (default 160; --quick 6)"
    )
    parser.add_argument(
        "--app-args",
        default="",
        help="e2e: extra `apps/train` options for every run, e.g. '--pacing eager'",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        help="e2e: also measure training steps/s with a held-out evaluation every N steps "
        "against the same async run without (one more run per seed)",
    )
    parser.add_argument(
        "--settings",
        default="",
        help="study: comma-separated settings to run (default: the whole grid); "
        "scale: the model sizes to run, e.g. '100M,0.5B'",
    )
    parser.add_argument(
        "--calibration",
        help="sim: a runs/bench-e2e-* directory to calibrate on (default: the newest one "
        "under runs/, else the built-in constants measured on this machine)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list or not args.name:
        for name, (_, description) in BENCHES.items():
            print(f"{name:10s} {description}")
        return 0 if args.list else 2
    if args.name not in BENCHES:
        print(
            f"unknown benchmark {args.name!r}; choose from: {', '.join(BENCHES)}", file=sys.stderr
        )
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    module = importlib.import_module(BENCHES[args.name][0])
    options = {
        "seeds": args.seeds,
        "steps": args.steps,
        "app_args": shlex.split(args.app_args),
        "calibration": args.calibration,
        "grid": [name for name in args.settings.split(",") if name],
        "eval_every": args.eval_every,
    }
    options = {k: v for k, v in options.items() if v}
    accepted = inspect.signature(module.run).parameters
    refused = sorted(set(options) - set(accepted))
    if refused:
        flags = ", ".join("--" + k.replace("_", "-") for k in refused)
        print(f"benchmark {args.name!r} takes no {flags}", file=sys.stderr)
        return 2
    report: BenchReport = module.run(quick=args.quick, **options)
    console = Console(stderr=False)
    _print_report(args.name, report, console)
    sys.stdout.flush()
    print(json.dumps({"bench": args.name, **report.figures}, default=str))
    return 0
