"""SIGINT and SIGTERM: outside the event loop they raise (`signals_raise`); on it the first
stops the run gracefully and the second exits at once (`Stopper`).

The first signal while training lets the trainer finish the step in progress (with its
weight push) and save a checkpoint at that step; then every actor stops and the run raises
`RunInterrupted` (exit 128 + signal: 130 for SIGINT, 143 for SIGTERM). Before training
starts (while Ray starts or the plan is made) it skips straight to stopping what has
started, with the same exit codes. A second signal exits at once: no waiting for the step,
the checkpoint or the engines' shutdown (a local cluster's processes are still ended, see
`cluster.stop_local_ray`); a third changes nothing. The handlers are the driver's own,
whatever disposition the process inherited; `ray.init` is kept from installing its SIGTERM
handlers (`sys.exit` mid-start, leaving the cluster's processes behind)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console

from train_app.driver.errors import RunInterrupted

__all__ = ["Stopper", "signals_raise"]


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Outside the event loop: SIGINT raises KeyboardInterrupt and SIGTERM `RunInterrupted`,
    even if the process inherited SIGINT ignored (a background job of a non-interactive
    shell). Restores the previous handlers afterwards. Main thread only (else a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        raise RunInterrupted(signum, "stopped before training started")

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


class Stopper:
    """SIGINT and SIGTERM while the driver's loop runs: the first stops the run gracefully
    (`graceful()` if training is under way, else the main task is cancelled so the actors are
    stopped); the second cancels whatever runs and exits at once (`hard`)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.signum: int | None = None
        self.hard = False
        self.outcome = ""  # what the stop saved, for RunInterrupted's message
        # Set by the session once training runs: asks the trainer to stop; True if it did.
        self.graceful: Callable[[], bool] | None = None
        self._main: asyncio.Task[Any] | None = None

    def install(self) -> None:
        """(Re)install the handlers on the running loop. Call again after `ray.init`."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._main = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)

    @contextlib.contextmanager
    def around_blocking_call(self) -> Iterator[Callable[[], bool]]:
        """Around a call that blocks the loop's thread (`ray.init`): a signal meanwhile is
        still handled as usual once the call returns (the loop is woken as before), and the
        yielded function says whether one came, so the call can give up early (no retry of
        a Ray start the user asked to stop)."""
        received: list[int] = []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda signum, frame: received.append(signum))
        try:
            yield lambda: bool(received)
        finally:
            self.install()

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            if self.graceful is not None and self.graceful():
                self.console.print(
                    f"[bold yellow]{name}:[/] finishing the current step, saving a checkpoint, "
                    "then stopping every actor and engine (again to exit at once)"
                )
                return
            self.console.print(
                f"[bold yellow]{name}:[/] stopping every actor and engine (again to exit at once)"
            )
        elif self.hard:
            return  # exiting at once already
        else:
            self.hard = True
            self.outcome = "exited at once, without a new checkpoint"
            self.console.print(f"[bold red]{name} again:[/] exiting at once")
        if self._main is not None:
            self._main.cancel()
