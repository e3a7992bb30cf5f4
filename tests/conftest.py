import sys
from pathlib import Path

# Root tests import their small helpers (e.g. the blocking-call checker) by module name.
sys.path.insert(0, str(Path(__file__).parent))
