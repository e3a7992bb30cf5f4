"""PPOConfig validation and the LR schedules."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from ppo_trainer import PPOConfig, lr_multiplier


def test_config_is_frozen_and_validated() -> None:
    cfg = PPOConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0  # type: ignore[misc]
    assert cfg.updates_per_step == 1
    assert PPOConfig(ppo_epochs=2, num_minibatches=3).updates_per_step == 6
    for bad in (
        {"batch_size": 0},
        {"grad_accum": 0},
        {"dual_clip": 1.0},
        {"is_cap": 0.0},
        {"lr_schedule": "cosine"},  # needs total_steps
        {"loss_agg": "sum"},
        {"advantage": "ppo"},
        {"kl_estimator": "k4"},
        {"loss_agg": "seq-mean-token-sum-norm"},  # needs loss_agg_horizon
        {"loss_agg_horizon": 0},
        {"kl_clamp": True, "kl_estimator": "k1"},  # the clamp is for k3
        {"gamma": 1.5},
        {"lam": -0.1},
        {"vf_coef": 0.0},
        {"value_clip": 0.0},
        {"value_lr": -1.0},
        {"checkpoint_every": 2},  # needs checkpoint_dir
        {"max_staleness": -1},
        {"is_level": "word"},
        {"is_mode": "clip"},
    ):
        with pytest.raises(ValueError):
            PPOConfig(**bad)  # type: ignore[arg-type]
    # the new modes are accepted with what they need
    PPOConfig(loss_agg="seq-mean-token-sum-norm", loss_agg_horizon=8)
    PPOConfig(loss_agg="token-sum", kl_estimator="abs")
    PPOConfig(kl_clamp=True, kl_estimator="k3", advantage="gae", value_clip=None)
    PPOConfig(is_level="sequence", is_mode="mask")


def test_bad_values_get_a_clear_message() -> None:
    with pytest.raises(ValueError, match="needs loss_agg_horizon"):
        PPOConfig(loss_agg="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="k3 estimator only"):
        PPOConfig(kl_clamp=True, kl_estimator="abs")
    with pytest.raises(ValueError, match=r"advantage must be one of \('grpo', 'rloo', 'gae'\)"):
        PPOConfig(advantage="ppo")  # type: ignore[arg-type]


def test_every_field_is_documented() -> None:
    import inspect

    source = inspect.getsource(PPOConfig)
    for f in dataclasses.fields(PPOConfig):
        after = source.split(f"    {f.name}:", 1)[1].split("\n", 2)[1]
        assert after.strip().startswith('"""'), f"{f.name} has no docstring"


def test_warmup_then_constant() -> None:
    kw = {"schedule": "constant", "warmup_steps": 4, "total_steps": None}
    assert [lr_multiplier(s, **kw) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]  # type: ignore[arg-type]


def test_linear_and_cosine_decay() -> None:
    lin = {"schedule": "linear", "warmup_steps": 2, "total_steps": 6, "min_ratio": 0.0}
    assert [lr_multiplier(s, **lin) for s in range(7)] == pytest.approx(  # type: ignore[arg-type]
        [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    )
    cos = {"schedule": "cosine", "warmup_steps": 0, "total_steps": 4, "min_ratio": 0.1}
    got = [lr_multiplier(s, **cos) for s in range(5)]  # type: ignore[arg-type]
    want = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(5)]
    assert got == pytest.approx(want)


def test_scheduler_round_trips_its_state() -> None:
    from ppo_trainer.schedule import make_scheduler

    def make() -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = make_scheduler(opt, schedule="linear", warmup_steps=1, total_steps=5)
        return opt, sched

    opt, sched = make()
    for _ in range(3):
        opt.step()
        sched.step()
    opt2, sched2 = make()
    # as in a checkpoint: the current lr lives in the optimizer, the position in the scheduler
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    for _ in range(2):
        sched.step()
        sched2.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0)
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
