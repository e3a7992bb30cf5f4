"""`StallWatch` on a hand-driven clock: one warning per stall, and a wait that is due within
the clock's slack counts as over (an event loop fires such a timer at once without moving
its clock, so a rollouter waiting for the last microseconds would spin)."""

from __future__ import annotations

import logging

import pytest
from rollout_engine.stall_watch import CLOCK_SLACK_S, StallWatch


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_warns_once_per_stall_and_a_new_version_rearms(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    watch = StallWatch(after_s=120.0, now=clock)
    watch.start()
    clock.t = 60.0
    assert watch.seconds_left() == pytest.approx(60.0)
    assert not watch.warn_if_stalled(lambda: "state")
    clock.t = 120.0
    with caplog.at_level(logging.WARNING):
        assert watch.warn_if_stalled(lambda: "state")
    assert "generation_only" in caplog.text
    assert watch.seconds_left() is None
    assert not watch.warn_if_stalled(lambda: "state")  # once
    watch.version_changed()
    assert watch.seconds_left() == pytest.approx(120.0)


def test_a_wait_due_within_the_slack_is_over_and_warns() -> None:
    clock = Clock()
    watch = StallWatch(after_s=120.0, now=clock)
    watch.start()
    clock.t = 120.0 - CLOCK_SLACK_S / 10  # a few ms short: a timer the loop fires at once
    assert watch.seconds_left() == 0.0
    assert watch.warn_if_stalled(lambda: "state")
