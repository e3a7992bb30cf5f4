"""Failed groups: the give-up rule, and logging that does not flood.

- `RolloutFailed`: what `Rollouter.run()` raises after `max_consecutive_failures` groups failed
  in a row (a dead engine or a closed sink fails every group; without the limit the loop would
  admit and fail prompts forever).
- `FailureStreak`: counts consecutive failures; a delivered group resets it.
- `RepeatedFailureLog`: logs the first failure of each kind (error type + message) with its
  traceback, then only counts repeats of that kind and logs one summary line per kind every
  `summary_interval_s` and at the end of the run ("... repeated N times").
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["FailureStreak", "RepeatedFailureLog", "RolloutFailed"]


class RolloutFailed(RuntimeError):
    """`Rollouter.run()` gave up after `consecutive_failures` groups failed in a row.

    `__cause__` is the last group's error; the message names it too (type and text), so the
    cause survives being sent as text (e.g. `async_queue`'s `close(error=...)`, which a
    consumer re-raises as `ProducerFailed`).
    """

    def __init__(self, message: str, consecutive_failures: int = 0) -> None:
        super().__init__(message)
        self.consecutive_failures = consecutive_failures

    @classmethod
    def after(cls, count: int, last: BaseException) -> RolloutFailed:
        text = str(last) or repr(last)
        error = cls(
            f"{count} consecutive rollout groups failed; last error: {type(last).__name__}: {text}",
            consecutive_failures=count,
        )
        error.__cause__ = last
        return error


class FailureStreak:
    """Consecutive failed groups; `limit` of them in a row means give up."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_consecutive_failures must be >= 1, got {limit}")
        self.limit = limit
        self.count = 0
        self.last_error: BaseException | None = None

    def success(self) -> None:
        self.count = 0
        self.last_error = None

    def failure(self, error: BaseException) -> RolloutFailed | None:
        """Count one failure; returns the error to raise once the limit is reached."""
        self.count += 1
        self.last_error = error
        if self.count >= self.limit:
            return RolloutFailed.after(self.count, error)
        return None


@dataclass
class _Kind:
    level: int
    first_group: str
    repeats: int = 0  # since the last line logged for this kind
    total: int = 1
    last_logged_at: float = 0.0


class RepeatedFailureLog:
    """Logs each kind of failure (`(error_type, message)`) once with its traceback; repeats
    are counted and summarized every `summary_interval_s` per kind and at `flush()`.

    At most `max_kinds` kinds are remembered (messages that name a request are all distinct);
    the least recently seen kind is summarized and forgotten first.
    """

    def __init__(
        self,
        logger: logging.Logger,
        clock: Callable[[], float],
        summary_interval_s: float = 30.0,
        max_kinds: int = 128,
    ) -> None:
        self._logger = logger
        self._clock = clock
        self._interval = summary_interval_s
        self._max_kinds = max_kinds
        self._kinds: OrderedDict[tuple[str, str], _Kind] = OrderedDict()

    def log(
        self,
        level: int,
        group_id: str,
        error_type: str,
        message: str,
        exc_info: BaseException | None,
    ) -> None:
        key = (error_type, message)
        now = self._clock()
        kind = self._kinds.get(key)
        if kind is None:
            self._logger.log(
                level,
                "group %s failed (%s: %s); counted as a failed sample",
                group_id,
                error_type,
                message,
                exc_info=exc_info,
            )
            self._kinds[key] = _Kind(level=level, first_group=group_id, last_logged_at=now)
            while len(self._kinds) > self._max_kinds:
                old_key, old = self._kinds.popitem(last=False)
                self._summarize(old_key, old)
            return
        self._kinds.move_to_end(key)
        kind.repeats += 1
        kind.total += 1
        kind.level = level
        if now - kind.last_logged_at >= self._interval:
            self._summarize(key, kind)
            kind.last_logged_at = now

    def flush(self) -> None:
        """Log the pending repeat counts of every kind (at the end of a run)."""
        for key, kind in self._kinds.items():
            self._summarize(key, kind)

    def _summarize(self, key: tuple[str, str], kind: _Kind) -> None:
        if kind.repeats == 0:
            return
        self._logger.log(
            kind.level,
            "group failure %s: %s repeated %d more times (%d in all since group %s)",
            key[0],
            key[1],
            kind.repeats,
            kind.total,
            kind.first_group,
        )
        kind.repeats = 0
