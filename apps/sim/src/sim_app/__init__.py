"""The async RL pipeline on a virtual clock: the real Rollouter, admission, pacing and queue
core, with a modelled engine and trainer (see `sim_app.pipeline`)."""

from sim_app.engine import SimEngine
from sim_app.models import Contention, DecodeModel, LengthModel, TrainerModel
from sim_app.pipeline import SimConfig, SimResult, simulate

__all__ = [
    "Contention",
    "DecodeModel",
    "LengthModel",
    "SimConfig",
    "SimEngine",
    "SimResult",
    "TrainerModel",
    "simulate",
]
