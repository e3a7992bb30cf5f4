"""Losses, KL estimators, entropy and aggregation against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from ppo_trainer import (
    aggregate_loss,
    entropy_from_logits,
    kl_penalty,
    masked_mean,
    policy_loss,
    token_logprobs,
    value_loss,
)

NAN, INF = float("nan"), float("inf")


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
    # k1 beside k3: ppo_kl = mean(-log r)
    expected_k1 = -(math.log(1.5) + math.log(0.5) + 0.0 + math.log(1.1)) / 4
    assert m["ppo_kl"].item() == pytest.approx(expected_k1, abs=1e-6)


def test_log_ratio_is_clamped_before_exp() -> None:
    """A log-ratio of 25 is treated as 20: exp stays finite, approx_kl is bounded by 10."""
    logp = torch.tensor([[25.0, 25.0, 0.0]], requires_grad=True)
    prox = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    loss, m = policy_loss(logp, prox, adv, torch.ones(1, 3), clip_eps=0.2)
    # A=+1: max(-e^20, -1.2) = -1.2; A=-1: max(e^20, 0.8) = e^20; r=1: -1
    assert loss.item() == pytest.approx((-1.2 + math.exp(20) - 1.0) / 3, rel=1e-5)
    # per-token k3 = (e^20 - 1) - 20 ~ 4.9e8, clamped to 10; the r=1 token gives 0
    assert m["approx_kl"].item() == pytest.approx((10 + 10 + 0) / 3)
    assert m["ppo_kl"].item() == pytest.approx((-20 - 20 + 0) / 3)
    loss.backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] == 0  # outside the clamp: no gradient
    # the importance weight's log is clamped too: exp(-(-100)) would be e^100 -> inf in fp32
    _, m = policy_loss(
        torch.zeros(1, 1),
        torch.zeros(1, 1),
        torch.ones(1, 1),
        torch.ones(1, 1),
        behav_logp=torch.tensor([[-100.0]]),
    )
    assert m["is_weight_mean"].item() == pytest.approx(math.exp(20), rel=1e-5)


def test_nan_and_inf_at_padded_positions_cannot_poison_the_loss() -> None:
    base = torch.tensor([[-1.0, -0.5, NAN], [-2.0, INF, -INF]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    logp = base.clone().requires_grad_(True)
    prox = torch.tensor([[-1.0, -0.5, INF], [-2.0, NAN, 3.0]])
    behav = torch.tensor([[-1.0, -0.5, -INF], [-2.0, NAN, NAN]])
    adv = torch.tensor([[2.0, 1.0, NAN], [-1.0, INF, NAN]])
    for mode in ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean"):
        loss, m = policy_loss(logp, prox, adv, mask, behav_logp=behav, loss_agg=mode)  # type: ignore[arg-type]
        assert torch.isfinite(loss), mode
        assert all(torch.isfinite(v) for v in m.values()), (mode, m)
    loss, m = policy_loss(logp, prox, adv, mask, behav_logp=behav)
    # r = 1 and w = 1 on the 3 valid tokens: -mean(A) = -(2 + 1 - 1) / 3
    assert loss.item() == pytest.approx(-2 / 3)
    assert m["approx_kl"].item() == 0.0 and m["ppo_kl"].item() == 0.0
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[-2 / 3, -1 / 3, 0.0], [1 / 3, 0, 0]]))
    # the reductions themselves
    garbage = torch.tensor([[1.0, 2.0, NAN], [4.0, INF, -INF]])
    assert masked_mean(garbage, mask).item() == pytest.approx(7 / 3)
    assert aggregate_loss(garbage, mask, "seq-mean-token-mean").item() == pytest.approx(2.75)
    assert aggregate_loss(garbage, mask, "seq-mean-token-sum-norm", horizon=4).item() == (
        pytest.approx(0.875)
    )
    vl, vm = value_loss(garbage, garbage, torch.zeros(2, 3), mask)
    # unclipped values (V = V_old): 0.5 * V^2 over [1, 2, 4] -> (0.5 + 2 + 8) / 3
    assert vl.item() == pytest.approx(10.5 / 3)
    assert vm["value_mean"].item() == pytest.approx(7 / 3)


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


def test_masked_importance_weights_drop_extreme_tokens() -> None:
    prox = torch.zeros(1, 4)
    # w = [1, 2, 4, 0.25]; cap 3 masks 4 (> 3) and 0.25 (< 1/3) instead of truncating
    behav = -_log([1.0, 2.0, 4.0, 0.25])
    logp = _log([1.0, 1.0, 1.1, 0.9])
    adv = torch.tensor([[1.0, -1.0, 1.0, 2.0]])
    loss, m = policy_loss(
        logp, prox, adv, torch.ones(1, 4), behav_logp=behav, is_cap=3.0, is_mode="mask"
    )
    # tokens: -1*1*1, +1*1*2, masked, masked; token-mean still divides by all 4 tokens
    assert loss.item() == pytest.approx((-1.0 + 2.0) / 4, abs=1e-6)
    assert m["is_masked_frac"].item() == pytest.approx(0.5)
    assert m["is_capped_frac"].item() == 0.0
    assert m["is_weight_max"].item() == pytest.approx(2.0)


def test_sequence_level_importance_weight_is_the_product_over_the_response() -> None:
    prox = torch.zeros(2, 3)
    # row 0: token ratios 2, 1.5, (padding) -> sequence weight 3 on both response tokens
    # row 1: token ratios 0.5, 0.5, 0.5 -> 0.125, truncation only caps from above
    behav = -torch.log(torch.tensor([[2.0, 1.5, 7.0], [0.5, 0.5, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    logp = torch.zeros(2, 3)
    adv = torch.ones(2, 3)
    loss, m = policy_loss(logp, prox, adv, mask, behav_logp=behav, is_cap=5.0, is_level="sequence")
    assert loss.item() == pytest.approx(-(3 + 3 + 3 * 0.125) / 5, abs=1e-6)
    assert m["is_weight_max"].item() == pytest.approx(3.0, abs=1e-6)
    capped, _ = policy_loss(
        logp, prox, adv, mask, behav_logp=behav, is_cap=2.0, is_level="sequence"
    )
    assert capped.item() == pytest.approx(-(2 + 2 + 3 * 0.125) / 5, abs=1e-6)
    masked, mm = policy_loss(
        logp,
        prox,
        adv,
        mask,
        behav_logp=behav,
        is_cap=2.0,
        is_level="sequence",
        is_mode="mask",
    )
    # both sequences fall outside [1/2, 2]: nothing is left
    assert masked.item() == 0.0
    assert mm["is_masked_frac"].item() == pytest.approx(1.0)


def test_unknown_importance_options_are_rejected() -> None:
    ones = torch.ones(1, 2)
    with pytest.raises(ValueError, match="is_level"):
        policy_loss(ones, ones, ones, ones, behav_logp=ones, is_level="word")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is_mode"):
        policy_loss(ones, ones, ones, ones, behav_logp=ones, is_mode="clip")  # type: ignore[arg-type]


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
    # token-sum: 1 + 2 + 4, no normaliser
    assert aggregate_loss(loss, mask, "token-sum").item() == pytest.approx(7.0)
    # seq-mean-token-sum-norm, horizon H = 4: sequence sums [3, 4] / H, mean over 2 sequences
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", horizon=4).item() == (
        pytest.approx((3 / 4 + 4 / 4) / 2)
    )
    with pytest.raises(ValueError, match="horizon"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError):
        aggregate_loss(loss, mask, "nope")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "mode",
    [
        "token-mean",
        "token-sum",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "seq-mean-token-mean",
    ],
)
def test_micro_batches_with_global_normalisers_add_up(mode: str) -> None:
    loss = torch.rand(4, 5, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float32
    )
    whole = aggregate_loss(loss, mask, mode, horizon=5)  # type: ignore[arg-type]
    n_tok, n_seq = float(mask.sum()), 4.0
    parts = sum(
        aggregate_loss(
            loss[i : i + 2],
            mask[i : i + 2, :],
            mode,  # type: ignore[arg-type]
            num_tokens=n_tok,
            num_seqs=n_seq,
            horizon=5,
        )
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
    torch.testing.assert_close(kl_penalty(logp, ref, "abs"), torch.tensor([1.0, 0.0]))
    # abs of a negative difference: d = -2 -> 2
    assert kl_penalty(torch.tensor([-3.0]), torch.tensor([-1.0]), "abs").item() == 2.0
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]


def test_k3_clamp() -> None:
    # d = logp - ref = [-25, 25, 1, -2]
    logp = torch.tensor([-25.0, 25.0, 1.0, -2.0])
    ref = torch.zeros(4)
    # d = -25 -> -20: e^20 - 1 - 20 ~ 4.9e8 -> 10;  d = 25 -> 20: e^-20 - 1 + 20 ~ 19 -> 10
    # inside the range nothing changes: d = 1: e^-1 - 1 + 1;  d = -2: e^2 - 1 - 2
    expected = torch.tensor([10.0, 10.0, math.exp(-1), math.exp(2) - 3])
    torch.testing.assert_close(kl_penalty(logp, ref, "k3", clamp=True), expected)
    unclamped = kl_penalty(logp, ref, "k3")
    assert unclamped[0].item() == pytest.approx(math.exp(25) - 26, rel=1e-5)
    with pytest.raises(ValueError, match="k3"):
        kl_penalty(logp, ref, "k1", clamp=True)


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
    assert m["value_mean"].item() == pytest.approx((1.0 + 0.0 + 0.55) / 3)
    # no clip: 0.5 * [(1-2)^2, (0-0.6)^2, (0.55-0.5)^2]
    loss, m = value_loss(values, old, returns, torch.ones(1, 3), clip_eps=None)
    assert loss.item() == pytest.approx((0.5 + 0.18 + 0.00125) / 3, abs=1e-6)
    assert m["vf_clipfrac"].item() == 0.0


def test_value_loss_gradient_by_hand() -> None:
    # clip 0.2 around V_old = 0.5; R = 2: V = 0.6 is inside (grad = V - R = -1.4);
    # V = 1.0 is outside, but the unclipped term (1 - 2)^2 = 1 < (0.7 - 2)^2 = 1.69, so the
    # clipped term wins and has no gradient w.r.t. V
    values = torch.tensor([[0.6, 1.0]], requires_grad=True)
    old, returns = torch.full((1, 2), 0.5), torch.full((1, 2), 2.0)
    loss, _ = value_loss(values, old, returns, torch.ones(1, 2), clip_eps=0.2)
    loss.backward()
    assert values.grad is not None
    torch.testing.assert_close(values.grad, torch.tensor([[-1.4 / 2, 0.0]]))


def test_importance_weights_on_their_own_mask_outside_the_cap_and_skip_padding() -> None:
    # w = prox / behav = [3, 0.2, 1, (padding with a NaN behaviour log-prob)], cap 2
    from ppo_trainer.losses import importance_weights

    prox = torch.zeros(1, 4)
    behav = torch.tensor([[-math.log(3.0), -math.log(0.2), 0.0, NAN]])
    valid = torch.tensor([[True, True, True, False]])
    masked = importance_weights(prox, behav, valid, is_cap=2.0, is_mode="mask")
    # padding gets exp(0) = 1, not the NaN: it is selected away before `exp`
    assert masked.weight.tolist() == [[0.0, 0.0, 1.0, 1.0]]
    assert masked.masked.tolist() == [[True, True, False, False]]
    assert not masked.capped.any()
    truncated = importance_weights(prox, behav, valid, is_cap=2.0)
    assert truncated.weight[0].tolist() == pytest.approx([2.0, 0.2, 1.0, 1.0])
    assert truncated.capped.tolist() == [[True, False, False, False]]
    assert importance_weights(prox, None, valid).weight.tolist() == [[1.0] * 4]


def test_per_token_clip_ranges() -> None:
    # ratio 1.15 with A = 1 on both tokens: inside a 0.2 clip, outside a 0.1 one
    logp = _log([1.15, 1.15])
    prox, adv, mask = torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2)
    scalar, scalar_metrics = policy_loss(logp, prox, adv, mask, clip_eps=0.2)
    same, same_metrics = policy_loss(logp, prox, adv, mask, clip_eps=torch.full((1, 2), 0.2))
    assert same.item() == pytest.approx(scalar.item())
    assert same_metrics["clipfrac"].item() == scalar_metrics["clipfrac"].item() == 0.0
    eps = torch.tensor([[0.2, 0.1]])  # the second token is one version stale, scale 1
    loss, metrics = policy_loss(logp, prox, adv, mask, clip_eps=eps, clip_eps_high=eps)
    assert metrics["clipfrac"].item() == pytest.approx(0.5)
    assert loss.item() == pytest.approx(-(1.15 + 1.1) / 2)


def test_policy_metrics_are_each_a_masked_mean() -> None:
    """The metrics, reduced together in one pass, equal each one's own masked mean (NaN at
    masked positions ignored), and an all-masked batch gives zeros, not NaN."""
    torch.manual_seed(0)
    logp = torch.randn(3, 7) * 0.3
    prox, behav = logp + torch.randn(3, 7) * 0.3, logp + torch.randn(3, 7) * 0.3
    adv = torch.randn(3, 7)
    mask = (torch.rand(3, 7) > 0.3).float()
    logp = torch.where(mask.bool(), logp, NAN)
    _, m = policy_loss(logp, prox, adv, mask, behav_logp=behav, is_cap=1.2, dual_clip=3.0)
    log_ratio = (logp - prox).clamp(-20, 20)
    ratio = log_ratio.exp()
    weight = (prox - behav).exp()
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(0.8, 1.2)
    expected = {
        "clipfrac": (clipped > unclipped).float(),
        "approx_kl": (torch.expm1(log_ratio) - log_ratio).clamp(max=10.0),
        "ppo_kl": -log_ratio,
        "is_weight_mean": weight.clamp(max=1.2),
        "is_capped_frac": (weight > 1.2).float(),
        "ratio_mean": ratio,
    }
    for name, per_token in expected.items():
        assert m[name].item() == pytest.approx(masked_mean(per_token, mask).item(), abs=1e-6), name
    assert m["is_masked_frac"].item() == 0.0
    assert 0.0 < m["clipfrac"].item() < 1.0 and 0.0 < m["is_capped_frac"].item() < 1.0
    _, empty = policy_loss(logp, prox, adv, torch.zeros(3, 7), behav_logp=behav, is_cap=1.2)
    assert all(v.item() == 0.0 for v in empty.values()), empty
