"""SIGINT / SIGTERM handling of the driver, without Ray: which signal does what, and the exit
codes (the end-to-end behaviour is in test_train_e2e.py)."""

from __future__ import annotations

import asyncio
import io
import os
import signal
from pathlib import Path

import pytest
from rich.console import Console
from train_app import cli
from train_app import driver as run_module
from train_app.driver import RunInterrupted, Stopper, signals_raise


def test_first_signal_stops_gracefully_the_second_exits_at_once() -> None:
    graceful: list[int] = []

    async def main() -> tuple[bool, bool]:
        stopper = Stopper(Console(file=io.StringIO()))
        stopper.install()
        try:
            stopper.graceful = lambda: graceful.append(1) or True
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0.2)  # not cancelled: the trainer is asked to stop
            first = (stopper.signum, stopper.hard)
            os.kill(os.getpid(), signal.SIGINT)
            with pytest.raises(asyncio.CancelledError):
                await asyncio.sleep(5)
            return first == (signal.SIGTERM, False), stopper.hard
        finally:
            stopper.uninstall()

    assert asyncio.run(main()) == (True, True)
    assert graceful == [1]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_first_signal_before_training_cancels_the_run() -> None:
    async def main() -> int | None:
        stopper = Stopper(Console(file=io.StringIO()))
        stopper.install()
        try:
            os.kill(os.getpid(), signal.SIGINT)
            with pytest.raises(asyncio.CancelledError):
                await asyncio.sleep(5)
            assert not stopper.hard
            return stopper.signum
        finally:
            stopper.uninstall()

    assert asyncio.run(main()) == signal.SIGINT


def _signal_self(signum: int) -> None:
    os.kill(os.getpid(), signum)
    for _ in range(100):  # Python runs the handler between bytecodes
        pass


def test_signals_raise_even_if_sigint_was_inherited_ignored() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a background job
    try:
        with signals_raise(), pytest.raises(KeyboardInterrupt):
            _signal_self(signal.SIGINT)
        with signals_raise(), pytest.raises(RunInterrupted) as caught:
            _signal_self(signal.SIGTERM)
        assert caught.value.exit_code == 143
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # restored afterwards
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_cli_exit_code_of_an_interrupted_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], signum: int, code: int
) -> None:
    def interrupted(config: object, console: object) -> run_module.RunResult:
        raise RunInterrupted(signum, "checkpoint at step 7 saved")

    monkeypatch.setattr(run_module, "run", interrupted)
    assert cli.main(["--runs-dir", str(Path("/nonexistent"))]) == code
    out = capsys.readouterr().out
    assert signal.Signals(signum).name in out and "step 7" in out


def test_a_signal_during_a_blocking_call_is_seen_by_it_and_handled_after() -> None:
    """Ctrl-C while `ray.init` blocks the loop: the call can tell (and not retry), and the
    run is stopped once it returns, as if the signal had come then."""

    async def main() -> tuple[bool, bool, int | None]:
        stopper = Stopper(Console(file=io.StringIO()))
        stopper.install()
        try:
            with stopper.around_blocking_call() as signalled:
                before = signalled()
                _signal_self(signal.SIGINT)  # the loop cannot run meanwhile
                during = signalled()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.sleep(5)
            return before, during, stopper.signum
        finally:
            stopper.uninstall()

    assert asyncio.run(main()) == (False, True, signal.SIGINT)


def test_a_third_signal_changes_nothing() -> None:
    async def main() -> bool:
        stopper = Stopper(Console(file=io.StringIO()))
        stopper.install()
        try:
            for _ in range(2):
                os.kill(os.getpid(), signal.SIGINT)
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.sleep(5)
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(0.2)  # exiting at once already: not cancelled again
            return stopper.hard
        finally:
            stopper.uninstall()

    assert asyncio.run(main())


def test_cleanup_finishes_although_a_second_signal_cancels_the_task() -> None:
    """The cluster's processes are reaped to the end even when a second Ctrl-C cancels the
    driver's task meanwhile; the cancellation is cleared, not raised."""
    import asyncio

    from train_app.driver.aio import finish_despite_cancel

    async def main() -> tuple[int, list[str]]:
        done: list[str] = []

        async def reap() -> int:
            await asyncio.sleep(0.2)
            done.append("reaped")
            return 7

        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().call_later(0.05, task.cancel)
        return await finish_despite_cancel(reap()), done

    assert asyncio.run(main()) == (7, ["reaped"])
