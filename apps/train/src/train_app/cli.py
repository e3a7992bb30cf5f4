"""`uv run apps/train`: command line of the fully-async GRPO run (cyclopts)."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated

import cyclopts
from cyclopts import Parameter
from rich.console import Console
from rich.markup import escape

from train_app.config import TrainConfig, check_config_file, check_resume_dir
from train_app.tasks.spec import check_task_inputs

__all__ = ["app", "main"]

app = cyclopts.App(
    name="apps/train",
    help="Fully-async GRPO post-training: vLLM generates while torch trains (see README).",
    version_flags=[],
    result_action="return_value",
)


@app.default
def train(
    *,
    config: Annotated[TrainConfig, Parameter(name="*")] = TrainConfig(),  # noqa: B008
) -> int:
    """Train a model with fully-async GRPO and write runs/NAME/ (metrics, plot, checkpoints).

    Options can also come from a TOML file (`--config FILE`, keys = option names with
    underscores); flags on the command line override it. `--resume RUN_DIR` reuses that run's
    config.toml the same way, continues from its last checkpoint and rewinds its metrics to it.

    Ctrl-C or SIGTERM: the trainer finishes the step in progress and saves a checkpoint there,
    then every actor and engine stops (exit 130 / 143). A second Ctrl-C exits at once.
    """
    from train_app.driver import RunFailed, RunInterrupted, run

    console = Console()
    try:
        config.validate()
        check_task_inputs(config)  # reads the dataset, imports the rewards: before Ray
    except ValueError as exc:
        return _bad_configuration(exc)
    try:
        result = run(config, console)
    except RunFailed as exc:
        console.print(f"[bold red]run failed:[/] {exc}")
        return 1
    except RunInterrupted as exc:  # SIGINT -> 130, SIGTERM -> 143
        console.print(
            f"[bold yellow]interrupted ({exc.signal_name}):[/] {exc.detail}; "
            "every actor and engine was stopped"
        )
        return exc.exit_code
    except KeyboardInterrupt:
        console.print("[bold yellow]interrupted:[/] stopped before training started")
        return 130
    console.print(f"outputs in {result.run_dir}")
    return 0


@app.meta.default
def launcher(
    *tokens: Annotated[str, Parameter(show=False, allow_leading_hyphen=True)],
    config_file: Annotated[Path | None, Parameter(name="--config")] = None,
) -> int:
    """Reads `--config FILE` (or the config of `--resume RUN_DIR`) before the other flags.

    Parameters
    ----------
    config_file
        A TOML file of options (keys as in runs/NAME/config.toml); flags override it.
    """
    files = []
    resume = _resume_dir(tokens)
    try:  # before cyclopts reads them, which would end in a traceback
        if resume is not None:
            check_resume_dir(resume)
        if config_file is not None:
            check_config_file(config_file)
    except ValueError as exc:
        return _bad_configuration(exc)
    if resume is not None:
        files.append(cyclopts.config.Toml(resume / "config.toml", must_exist=True))
    if config_file is not None:
        files.append(cyclopts.config.Toml(config_file, must_exist=True))
    app.config = files
    return app(tokens)


def _bad_configuration(exc: ValueError) -> int:
    """One line on stderr and exit 2, as cyclopts does for a flag it cannot parse."""
    Console(stderr=True).print(
        # No emoji codes: a value such as `nope:x:` must not print as `nope❌`.
        f"[bold red]bad configuration:[/] {escape(str(exc))}",
        soft_wrap=True,
        emoji=False,
    )
    return 2


def _resume_dir(tokens: tuple[str, ...]) -> Path | None:
    for i, token in enumerate(tokens):
        if token == "--resume" and i + 1 < len(tokens):
            return Path(tokens[i + 1])
        if token.startswith("--resume="):
            return Path(token.split("=", 1)[1])
    return None


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C works even if this process inherited SIGINT ignored (a background job of a
        # non-interactive shell); the run installs its own handlers later.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    result = app.meta(sys.argv[1:] if argv is None else argv)
    return result if isinstance(result, int) else 0
