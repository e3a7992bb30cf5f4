"""Losses, KL estimators, entropy and aggregation against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from ppo_trainer import (
    aggregate_loss,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    token_logprobs,
    value_loss,
)


def _log(values: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor([values]))


def test_clipped_ppo_by_hand() -> None:
    # ratios r = [1.5, 0.5, 1.0, 1.1] against a zero proximal log-prob; eps = 0.2
    logp = _log([1.5, 0.5, 1.0, 1.1])
    prox = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, 2.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, m = policy_loss(logp, prox, adv, mask, clip_eps=0.2)
    # per token: max(-A r, -A clip(r, 0.8, 1.2))
    #   r=1.5, A=1:  max(-1.5, -1.2) = -1.2   (clipped)
    #   r=0.5, A=-1: max(0.5, 0.8)   =  0.8   (clipped)
    #   r=1.0, A=2:  max(-2, -2)     = -2.0
    #   r=1.1, A=-1: max(1.1, 1.1)   =  1.1
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.0 + 1.1) / 4, abs=1e-6)
    assert m["clipfrac"].item() == pytest.approx(0.5)
    expected_kl = sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.0, 1.1)) / 4
    assert m["approx_kl"].item() == pytest.approx(expected_kl, abs=1e-6)
    assert m["is_weight_mean"].item() == pytest.approx(1.0)
    assert m["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.0 + 1.1) / 4, abs=1e-6)


def test_clip_higher_uses_its_own_upper_bound() -> None:
    logp = _log([1.25, 1.5])
    adv = torch.tensor([[1.0, 1.0]])
    loss, m = policy_loss(
        logp, torch.zeros(1, 2), adv, torch.ones(1, 2), clip_eps=0.2, clip_eps_high=0.3
    )
    # upper bound 1.3: r=1.25 unclipped (-1.25); r=1.5 clipped to 1.3 (-1.3)
    assert loss.item() == pytest.approx((-1.25 - 1.3) / 2, abs=1e-6)
    assert m["clipfrac"].item() == pytest.approx(0.5)


def test_ratio_one_is_the_plain_policy_gradient() -> None:
    base = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.0]])
    logp = base.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, m = policy_loss(logp, base, adv, mask, clip_eps=0.2)
    loss.backward()
    # value: mean over valid tokens of -A (r = 1); gradient: that of -A * logp / N (REINFORCE)
    assert loss.item() == pytest.approx((-1 - 1 + 2 + 2 + 2) / 5)
    reinforce = base.clone().requires_grad_(True)
    (-(adv * reinforce * mask).sum() / mask.sum()).backward()
    torch.testing.assert_close(logp.grad, reinforce.grad)
    assert m["clipfrac"].item() == 0.0
    assert m["approx_kl"].item() == pytest.approx(0.0, abs=1e-7)


def test_clipped_tokens_have_no_gradient() -> None:
    logp = _log([1.5, 1.0]).requires_grad_(True)
    loss, _ = policy_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2))
    loss.backward()
    # d/dlogp of -A*r/N = -A*r/N for the unclipped token, 0 for the clipped one
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5]]))


def test_dual_clip_bounds_negative_advantages() -> None:
    logp = _log([5.0, 5.0, 0.5])
    adv = torch.tensor([[-1.0, 1.0, -1.0]])
    loss, m = policy_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), dual_clip=3.0)
    #   r=5, A=-1: max(5, 1.2) = 5, dual bound -c*A = 3 -> 3
    #   r=5, A=+1: max(-5, -1.2) = -1.2 (dual clip only applies to A < 0)
    #   r=0.5, A=-1: max(0.5, 0.8) = 0.8 < 3 -> 0.8
    assert loss.item() == pytest.approx((3.0 - 1.2 + 0.8) / 3, abs=1e-6)
    assert m["dual_clipfrac"].item() == pytest.approx(1 / 3)
    no_dual, _ = policy_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3))
    assert no_dual.item() == pytest.approx((5.0 - 1.2 + 0.8) / 3, abs=1e-6)


def test_decoupled_truncated_importance_weights() -> None:
    prox = torch.zeros(1, 4)
    # w = exp(prox - behav) = [1, 2, 4, 0.5]; cap 3 -> [1, 2, 3, 0.5]
    behav = -_log([1.0, 2.0, 4.0, 0.5])
    logp = _log([1.0, 1.0, 1.1, 0.9])
    adv = torch.tensor([[1.0, -1.0, 1.0, 2.0]])
    loss, m = policy_loss(
        logp, prox, adv, torch.ones(1, 4), behav_logp=behav, clip_eps=0.2, is_cap=3.0
    )
    # tokens: -1*1*1, +1*1*2, -1.1*1*3, -2*0.9*0.5
    assert loss.item() == pytest.approx((-1.0 + 2.0 - 3.3 - 0.9) / 4, abs=1e-6)
    assert m["is_weight_mean"].item() == pytest.approx((1 + 2 + 3 + 0.5) / 4, abs=1e-6)
    assert m["is_weight_max"].item() == pytest.approx(3.0)
    assert m["is_capped_frac"].item() == pytest.approx(0.25)


def test_importance_weights_are_detached() -> None:
    prox = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    behav = torch.tensor([[-1.5, -2.5]])
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = policy_loss(logp, prox, torch.ones(1, 2), torch.ones(1, 2), behav_logp=behav)
    loss.backward()
    assert prox.grad is None  # neither the ratio's denominator nor w carries gradient
    w = math.exp(0.5)
    torch.testing.assert_close(logp.grad, torch.tensor([[-w / 2, -w / 2]]))


def test_on_policy_samples_have_unit_importance_weight() -> None:
    logp = torch.tensor([[-0.7, -1.2, -3.0]])
    _, m = policy_loss(logp, logp, torch.ones(1, 3), torch.ones(1, 3), behav_logp=logp, is_cap=2.0)
    assert m["is_weight_mean"].item() == 1.0
    assert m["clipfrac"].item() == 0.0


def test_aggregation_modes_by_hand() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(7 / 3)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(3.5)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(2.75)
    with pytest.raises(ValueError):
        aggregate_loss(loss, mask, "nope")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batches_with_global_normalisers_add_up(mode: str) -> None:
    loss = torch.rand(4, 5, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float32
    )
    whole = aggregate_loss(loss, mask, mode)  # type: ignore[arg-type]
    n_tok, n_seq = float(mask.sum()), 4.0
    parts = sum(
        aggregate_loss(loss[i : i + 2], mask[i : i + 2], mode, num_tokens=n_tok, num_seqs=n_seq)  # type: ignore[arg-type]
        for i in (0, 2)
    )
    assert float(parts) == pytest.approx(float(whole), abs=1e-6)


def test_kl_estimators_by_hand() -> None:
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -2.0])
    # d = logp - ref = [1, 0]
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(
        kl_penalty(logp, ref, "k3"), torch.tensor([math.exp(-1) - 1 + 1, 0.0])
    )
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]


def test_entropy_by_hand() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]])
    # uniform over 4: log 4; p = [1/4, 3/4]: -(0.25 ln 0.25 + 0.75 ln 0.75)
    expected = torch.tensor([math.log(4), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))])
    torch.testing.assert_close(entropy_from_logits(logits), expected)


def test_token_logprobs_match_log_softmax_with_temperature() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 7, generator=g)
    targets = torch.randint(0, 7, (2, 3), generator=g)
    ref = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, targets, temperature=0.7), ref)


def test_clipped_value_loss_by_hand() -> None:
    values = torch.tensor([[1.0, 0.0, 0.55]])
    old = torch.tensor([[0.5, 0.5, 0.5]])
    returns = torch.tensor([[2.0, 0.6, 0.5]])
    loss, m = value_loss(values, old, returns, torch.ones(1, 3), clip_eps=0.2)
    # clipped values: [0.7, 0.3, 0.55]
    #   0.5*max((1-2)^2, (0.7-2)^2) = 0.845; 0.5*max(0.36, 0.09) = 0.18; 0.5*max(.0025,.0025)
    assert loss.item() == pytest.approx((0.845 + 0.18 + 0.00125) / 3, abs=1e-6)
    assert m["vf_clipfrac"].item() == pytest.approx(1 / 3)
