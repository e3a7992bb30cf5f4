"""Advantage estimators against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from ppo_trainer import gae_advantages, grpo_advantages, masked_whiten, rloo_advantages


def test_grpo_mean_and_std() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0]])
    # group 0: mean 0.5, unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3)
    # group 1: mean 5, unbiased std = sqrt((9 + 1 + 1 + 9) / 3) = sqrt(20/3)
    s0, s1 = math.sqrt(1 / 3), math.sqrt(20 / 3)
    expected = torch.tensor(
        [[0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0], [-3 / s1, -1 / s1, 1 / s1, 3 / s1]]
    )
    got = grpo_advantages(rewards, norm_std=True, eps=0.0)
    torch.testing.assert_close(got, expected)


def test_grpo_mean_only() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0]])
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [-3.0, -1.0, 1.0, 3.0]])
    torch.testing.assert_close(grpo_advantages(rewards, norm_std=False), expected)


def test_grpo_equal_rewards_and_single_response_give_zero() -> None:
    assert torch.all(grpo_advantages(torch.tensor([[3.0, 3.0, 3.0]])) == 0)
    assert torch.all(grpo_advantages(torch.tensor([[5.0]])) == 0)


def test_rloo_leave_one_out() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 6.0, 0.0, 3.0]])
    # A_i = r_i - mean of the other three
    expected = torch.tensor(
        [
            [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3],
            [3 - 3.0, 6 - 2.0, 0 - 4.0, 3 - 3.0],
        ]
    )
    torch.testing.assert_close(rloo_advantages(rewards), expected)
    # identity: n / (n - 1) * (r - mean)
    torch.testing.assert_close(
        rloo_advantages(rewards), 4 / 3 * (rewards - rewards.mean(dim=1, keepdim=True))
    )
    assert torch.all(rloo_advantages(torch.tensor([[7.0]])) == 0)


def test_gae_by_hand() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    gamma, lam = 0.9, 0.8
    # t=2: delta = 1 - 0.7 = 0.3;                     A2 = 0.3
    # t=1: delta = 0.9*0.7 - 0.6 = 0.03;              A1 = 0.03 + 0.72*0.3 = 0.246
    # t=0: delta = 0.9*0.6 - 0.5 = 0.04;              A0 = 0.04 + 0.72*0.246 = 0.21712
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0]]))


def test_gae_stops_at_the_mask() -> None:
    rewards = torch.tensor([[0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.6, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # position 2 is padding: ignored; the episode ends after position 1.
    # t=1: delta = 1 - 0.6 = 0.4; A1 = 0.4.  t=0: delta = 0.9*0.6 - 0.5 = 0.04; A0 = 0.328
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.328, 0.4, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.828, 1.0, 0.0]]))


def test_gae_gamma_lam_one_is_reward_to_go_minus_value() -> None:
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[0.1, 0.2, 0.3]])
    adv, _ = gae_advantages(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[6.0 - 0.1, 5.0 - 0.2, 3.0 - 0.3]]))


def test_gae_passes_through_a_mask_hole_inside_the_response() -> None:
    """A masked token mid-response (a tool's output) does not end the episode: the recursion
    skips it, carrying A and V of the next generated token; its reward and value are ignored."""
    nan = float("nan")
    rewards = torch.tensor([[0.0, 0.0, 9.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, nan, 0.8, 0.7]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0]])
    gamma, lam = 0.9, 0.8  # gamma * lam = 0.72
    # valid tokens 0, 1, 3, 4 (position 2 deleted):
    # t=4: delta = 1 - 0.7 = 0.3;                 A4 = 0.3
    # t=3: delta = 0.9*0.7 - 0.8 = -0.17;         A3 = -0.17 + 0.72*0.3 = 0.046
    # t=2: masked: A2 = 0, carries (A', V') = (0.046, 0.8); its reward 9 is ignored
    # t=1: delta = 0.9*0.8 - 0.6 = 0.12;          A1 = 0.12 + 0.72*0.046 = 0.15312
    # t=0: delta = 0.9*0.6 - 0.5 = 0.04;          A0 = 0.04 + 0.72*0.15312 = 0.1502464
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    torch.testing.assert_close(adv, torch.tensor([[0.1502464, 0.15312, 0.0, 0.046, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[0.6502464, 0.75312, 0.0, 0.846, 1.0]]))
    # identical to GAE on the sequence with the masked token deleted
    keep = [0, 1, 3, 4]
    short_adv, short_ret = gae_advantages(
        rewards[:, keep], values[:, keep], torch.ones(1, 4), gamma=gamma, lam=lam
    )
    torch.testing.assert_close(adv[:, keep], short_adv)
    torch.testing.assert_close(ret[:, keep], short_ret)


def test_gae_with_several_holes_and_rows_matches_the_compressed_sequences() -> None:
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 9, generator=g), torch.randn(3, 9, generator=g)
    mask = torch.tensor(
        [[1, 0, 0, 1, 1, 0, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 0, 1, 0, 0, 0]],
        dtype=torch.float32,
    )
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.95, lam=0.9)
    for row in range(3):
        keep = mask[row].bool()
        n = int(keep.sum())
        a, r = gae_advantages(
            rewards[row, keep][None], values[row, keep][None], torch.ones(1, n), gamma=0.95, lam=0.9
        )
        torch.testing.assert_close(adv[row, keep], a[0])
        torch.testing.assert_close(ret[row, keep], r[0])
        assert torch.all(adv[row, ~keep] == 0) and torch.all(ret[row, ~keep] == 0)


def test_masked_whiten_by_hand() -> None:
    nan = float("nan")
    values = torch.tensor([[1.0, 2.0, nan], [3.0, 100.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    # valid: [1, 2, 3, 6]; mean 3; deviations [-2, -1, 0, 3]; unbiased var = 14 / 3
    std = math.sqrt(14 / 3 + 1e-8)
    expected = torch.tensor([[-2 / std, -1 / std, 0.0], [0.0, 0.0, 3 / std]])
    torch.testing.assert_close(masked_whiten(values, mask), expected)
    # fewer than two valid values: nothing to scale by, all zero
    assert torch.all(masked_whiten(torch.tensor([[5.0, 1.0]]), torch.tensor([[1.0, 0.0]])) == 0)


def test_shape_errors() -> None:
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(4))
    with pytest.raises(ValueError):
        gae_advantages(torch.zeros(1, 3), torch.zeros(1, 2), torch.zeros(1, 3))
