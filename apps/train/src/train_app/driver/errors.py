"""The driver's exceptions and how an actor's error is told in one line. Imports nothing
else of the driver, so every other module may import it."""

from __future__ import annotations

import signal

__all__ = [
    "RunFailed",
    "RunInterrupted",
    "TrainerRankFailed",
    "actor_died",
    "brief",
    "first_line",
]

# Characters of an error's first line shown on the terminal (a Ray error can be a page long).
FIRST_LINE_CHARS = 200


class RunFailed(RuntimeError):
    """An actor of the run failed; the message carries the cause."""


class TrainerRankFailed(RuntimeError):
    """One rank of a trainer of several failed (the message names it); `__cause__` is why."""


class RunInterrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM stopped the run; `exit_code` is 128 + the signal number.

    `detail` says what was saved (the checkpoint step) or that the exit was immediate."""

    def __init__(self, signum: int, detail: str = "") -> None:
        super().__init__(signum, detail)
        self.signum = signum
        self.detail = detail

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    def __str__(self) -> str:
        return f"{self.signal_name}: {self.detail}" if self.detail else self.signal_name


def actor_died(exc: BaseException | None) -> bool:
    from ray.exceptions import ActorDiedError

    return isinstance(exc, ActorDiedError)


def brief(exc: BaseException) -> str:
    """One line of an actor's error: the exception a Ray task raised (not Ray's traceback)."""
    from ray.exceptions import RayTaskError

    if isinstance(exc, RayTaskError) and exc.cause is not None:
        exc = exc.cause
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:FIRST_LINE_CHARS]
