import sys
from pathlib import Path

import pytest

# Root tests import their small helpers (e.g. the blocking-call checker) by module name.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _default_sigchld() -> None:
    """Every test starts with SIGCHLD's default disposition: a Ray driver started with the
    raylet-subreaper flag (the app's local cluster) ignores SIGCHLD in its process, and then
    every `subprocess` exit status reads 0, which would hide a run's real exit code."""
    import signal

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
