"""The driver's log capture: its records go to `logs/driver.log`, the terminal stays quiet
(warnings of this app only) unless `--verbose`. No log grows without end: driver.log rotates
itself, the actors' logs (appended to by their own processes) are capped by the driver's poll
loop (`cap_actor_logs`)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import logging.handlers
from collections.abc import Iterator
from pathlib import Path

from train_app.outputs import MAX_LOG_BYTES, cap_log

__all__ = ["ACTOR_LOG_CAP_EVERY_S", "DRIVER_LOG", "cap_actor_logs", "capture_driver_logs"]

DRIVER_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DRIVER_LOG = "driver.log"
# How often the driver checks the actors' logs against `MAX_LOG_BYTES`: a log grows by at
# most a minute of output past the cap, and the check (a stat per log) costs nothing.
ACTOR_LOG_CAP_EVERY_S = 60.0


def cap_actor_logs(log_dir: Path) -> list[Path]:
    """`cap_log` every actor log (`*.log` but driver.log, which rotates itself) in
    `log_dir`; returns those moved aside. Blocking: call it from a thread."""
    rotated = []
    for path in sorted(Path(log_dir).glob("*.log")):
        if path.name != DRIVER_LOG and cap_log(path, MAX_LOG_BYTES):
            rotated.append(path)
    return rotated


@contextlib.contextmanager
def capture_driver_logs(run_dir: Path, verbose: bool) -> Iterator[None]:
    """The driver's own log records (INFO and up) go to `logs/driver.log` (rotated to
    driver.log.1 past `MAX_LOG_BYTES`). The terminal keeps
    warnings of this app, but Ray's and transformers' loggers (which print through handlers
    of their own), Python warnings and transformers' progress bars go only to the file,
    unless `verbose`. Everything is restored on exit."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # driver.log.1 holds the previous MAX_LOG_BYTES: at most twice that on disk.
    handler = logging.handlers.RotatingFileHandler(
        logs / DRIVER_LOG, maxBytes=MAX_LOG_BYTES, backupCount=1
    )
    handler.setFormatter(logging.Formatter(DRIVER_LOG_FORMAT))
    root = logging.getLogger()
    saved_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    with contextlib.ExitStack() as restore:
        restore.callback(root.setLevel, saved_level)
        restore.callback(root.removeHandler, handler)
        restore.callback(handler.close)
        if not verbose:
            for stream in (h for h in root.handlers if type(h) is logging.StreamHandler):
                restore.callback(stream.setLevel, stream.level)
                stream.setLevel(logging.WARNING)
            for name in ("ray", "transformers", "py.warnings"):
                restore.enter_context(_to_file_only(logging.getLogger(name), handler))
            logging.captureWarnings(True)
            restore.callback(logging.captureWarnings, False)
            restore.enter_context(_no_transformers_progress_bars())
        yield


@contextlib.contextmanager
def _to_file_only(target: logging.Logger, handler: logging.Handler) -> Iterator[None]:
    """`target`'s records go to `handler`; its own terminal handlers show errors only.
    Ray and transformers attach those handlers at import, so they are imported here."""
    if target.name in ("ray", "transformers"):
        importlib.import_module(target.name)
    own = [(h, h.level) for h in target.handlers]
    propagate = target.propagate
    for own_handler, _ in own:
        own_handler.setLevel(logging.ERROR)
    target.addHandler(handler)
    target.propagate = False
    try:
        yield
    finally:
        target.removeHandler(handler)
        target.propagate = propagate
        for own_handler, level in own:
            own_handler.setLevel(level)


@contextlib.contextmanager
def _no_transformers_progress_bars() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
