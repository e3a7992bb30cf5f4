"""`uv run apps/sim`: simulate the async pipeline on a virtual clock.

    uv run apps/sim                                  # gpu-7b-64x64: sync vs async vs colocated
    uv run apps/sim --preset this-machine --steps 120
    uv run apps/sim --preset gpu-7b-64x64 --set max_staleness=4 --set lengths.max_tokens=28672
    uv run apps/sim --preset my.toml --variant async  # one run of the preset as written
    uv run apps/sim presets                          # the built-in presets
    uv run apps/sim calibrate runs/bench-e2e-XXXX --write-preset my-machine.toml
    uv run apps/sim study --scale small              # the README's grid at one scale

A table, then one JSON object as the last line of output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sim_app.compare import DEFAULT_VARIANTS, Variant, plot, run_variants, speedups, table_rows
from sim_app.presets import config_to_toml, list_presets, load_preset

DEFAULT_PRESET = "gpu-7b-64x64"


def _print_table(rows: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(row.get(c, "")) for c in columns))
    Console(width=max(120, Console().width)).print(table)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    preset = load_preset(args.preset, args.set)
    config = preset.config
    changes: dict[str, Any] = {}
    if args.steps:
        changes["steps"] = args.steps
    if args.seed is not None:
        changes["seed"] = args.seed
    config = config.with_(**changes)
    if args.variant == "as-written":
        variants: tuple[Variant, ...] = (Variant(config.mode, {}),)
    elif args.variant:
        variants = tuple(v for v in DEFAULT_VARIANTS if v.changes["mode"] == args.variant)
        variants = variants or (Variant(args.variant, {"mode": args.variant}),)
    else:
        variants = DEFAULT_VARIANTS
    results = run_variants(config, variants)
    _print_table(table_rows(results), f"{preset.name}: {preset.description}")
    figures: dict[str, Any] = {"preset": preset.name, "steps": config.steps, "seed": config.seed}
    figures["variants"] = {
        v.label: {k: (round(x, 4) if isinstance(x, float) else x) for k, x in r.summary().items()}
        for v, r in results
    }
    figures.update(speedups(results))
    if args.png:
        figures["plot"] = str(plot(results, args.png, f"{preset.name} ({config.steps} steps)"))
    return figures


def _calibrate(args: argparse.Namespace) -> dict[str, Any]:
    from sim_app.calibrate import calibrate, load_bench_dir

    report = calibrate(args.directory, loo=not args.no_loo)
    rows = [
        {
            "mode": p.mode,
            "seed": p.seed,
            "steps": p.steps,
            "measured wall s": round(p.measured_wall_s, 2),
            "predicted wall s": round(p.predicted_wall_s, 2),
            "rel error": round(p.rel_error, 4),
            "step s meas/pred": f"{p.measured_step_s:.3f} / {p.predicted_step_s:.3f}",
            "wait s meas/pred": f"{p.measured_wait_s:.3f} / {p.predicted_wait_s:.3f}",
            "staleness meas/pred": f"{p.measured_staleness:.2f} / {p.predicted_staleness:.2f}",
        }
        for p in report.predictions
    ]
    _print_table(rows, f"calibration on {args.directory}")
    figures = {**report.figures(), "fit": report.calibration.figures}
    if args.write_preset:
        runs = load_bench_dir(args.directory)
        measured: dict[str, Any] = {
            "source": str(args.directory),
            "steps": runs[0].steps,
            "seeds": sorted({r.seed for r in runs}),
        }
        for mode in ("sync", "async"):
            measured[f"{mode}_wall_s"] = [round(r.train_wall_s, 3) for r in runs if r.mode == mode]
        text = config_to_toml(
            report.calibration.base.with_(mode="async"),
            f"fitted to {args.directory}",
            measured,
        )
        Path(args.write_preset).write_text(text)
        figures["preset_written"] = str(args.write_preset)
    return figures


def _study(args: argparse.Namespace) -> dict[str, Any]:
    from sim_app.study import run_study

    rows, figures = run_study(args.scale, steps=args.steps, quick=args.quick)
    _print_table(rows, f"study at scale {args.scale}")
    return figures


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in ("run", "presets", "calibrate", "study") else "run"
    if argv and argv[0] == command:
        argv = argv[1:]
    parser = argparse.ArgumentParser(prog=f"apps/sim {command}", description=__doc__)
    if command == "run":
        parser.add_argument("--preset", default=DEFAULT_PRESET, help="name or .toml path")
        parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
        parser.add_argument("--steps", type=int, help="trainer steps (default: the preset's)")
        parser.add_argument("--seed", type=int)
        parser.add_argument(
            "--variant",
            help="only this mode (sync, async, colocate) or 'as-written'; default: the comparison",
        )
        parser.add_argument("--png", help="write the comparison PNG here")
    elif command == "calibrate":
        parser.add_argument("directory", help="a runs/bench-e2e-* directory")
        parser.add_argument("--write-preset", help="write the fitted preset (TOML) here")
        parser.add_argument("--no-loo", action="store_true", help="skip leave-one-seed-out")
    elif command == "study":
        parser.add_argument("--scale", choices=("small", "gpu"), default="small")
        parser.add_argument("--steps", type=int)
        parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if command == "presets":
        for name, description in list_presets().items():
            print(f"{name:16s} {description}")
        return 0
    figures = {"run": _run, "calibrate": _calibrate, "study": _study}[command](args)
    sys.stdout.flush()
    print(json.dumps({"sim": command, **figures}, default=str))
    return 0
