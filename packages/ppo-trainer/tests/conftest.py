"""ppo-trainer tests run on the CPU with few threads (the machine is shared)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Tests import their helpers (ppo_testkit) by module name; pytest runs with importlib mode.
sys.path.insert(0, str(Path(__file__).parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

torch.set_num_threads(1)
