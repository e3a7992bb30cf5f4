"""Makes a silent stall visible: admission waiting on the staleness budget for a long time
with no new weight version usually means nothing consumes what the rollouter delivers (it
runs without a trainer, or the consumer stopped calling `on_weights`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["StallWatch", "loop_time"]

logger = logging.getLogger(__name__)

# A wait shorter than this counts as already over: an event loop fires a timer that is due
# within its clock resolution at once, so a budget wait for the last few microseconds would
# return without the clock moving (on a virtual clock, forever).
CLOCK_SLACK_S = 0.01


def loop_time() -> float:
    """The running loop's time (virtual under a test loop clock); monotonic off the loop."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


@dataclass(slots=True)
class StallWatch:
    """One warning per stall, `after_s` seconds (of `now`, by default the event loop's
    clock) after the last version change; a new version re-arms it."""

    after_s: float
    now: Callable[[], float] = field(default=loop_time)
    _changed_at: float = 0.0
    _warned: bool = False

    def start(self) -> None:
        self._changed_at = self.now()
        self._warned = False

    def version_changed(self) -> None:
        self.start()

    def seconds_left(self) -> float | None:
        """How long a budget wait may last before it is a stall; None once warned."""
        if self._warned:
            return None
        left = self.after_s - (self.now() - self._changed_at)
        return 0.0 if left < CLOCK_SLACK_S else left

    def warn_if_stalled(self, describe: Callable[[], str]) -> bool:
        """Warn (once) if `after_s` has passed since the last version; `describe()` gives
        the rollouter's state for the message. True when it warned."""
        waited = self.now() - self._changed_at
        if self._warned or waited + CLOCK_SLACK_S < self.after_s:
            return False
        self._warned = True
        logger.warning(
            "admission has waited %.0f s on the staleness budget with no new weight version "
            "(%s): nothing has called on_weights()/update_weights(). Without a trainer "
            "(batch generation, evaluation) set RolloutConfig(generation_only=True); "
            "otherwise check that the consumer advances the version",
            waited,
            describe(),
        )
        return True
