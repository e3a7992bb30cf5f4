"""Advantage estimators, as plain functions on tensors.

Critic-free estimators (`grpo_advantages`, `rloo_advantages`) take one scalar reward per
response, grouped `[num_groups, group_size]`, and return one advantage per response (the
trainer broadcasts it over the response tokens). `gae_advantages` is the token-level estimator
for a value model.
"""

from __future__ import annotations

import torch

__all__ = ["gae_advantages", "grpo_advantages", "rloo_advantages"]


def grpo_advantages(
    rewards: torch.Tensor, *, norm_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised advantages (GRPO).

    For rewards r of shape `[G, n]` (G groups of n responses to the same prompt):

        A_gi = (r_gi - mean_g(r)) / (std_g(r) + eps)    if norm_std
        A_gi =  r_gi - mean_g(r)                        otherwise

    `std_g` is the unbiased sample standard deviation (divides by n - 1). A group of one
    response has no baseline and gets advantage 0.
    """
    _check_grouped(rewards)
    rewards = rewards.to(torch.float32)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    if norm_std:
        centred = centred / (rewards.std(dim=1, keepdim=True) + eps)
    return centred


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Leave-one-out advantages (RLOO).

    For rewards r of shape `[G, n]`, each response's baseline is the mean of the *other*
    n - 1 responses of its group:

        A_gi = r_gi - (sum_j r_gj - r_gi) / (n - 1)  =  n / (n - 1) * (r_gi - mean_g(r))

    A group of one response gets advantage 0.
    """
    _check_grouped(rewards)
    rewards = rewards.to(torch.float32)
    n = rewards.shape[1]
    if n < 2:
        return torch.zeros_like(rewards)
    others_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)
    return rewards - others_mean


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens; returns (advantages, returns).

    Shapes `[B, T]`; `mask` marks valid (response) tokens, padding after them. With
    m_{T} = 0 (the episode ends after the last valid token):

        delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t
        A_t     = (delta_t + gamma * lam * m_{t+1} * A_{t+1}) * m_t
        R_t     = A_t + V_t        (the value target; 0 where m_t = 0)

    Computed backwards in float32 without gradient (the values are treated as constants).
    """
    if not rewards.shape == values.shape == mask.shape or rewards.dim() != 2:
        raise ValueError("rewards, values and mask must all have shape [B, T]")
    with torch.no_grad():
        rewards = rewards.to(torch.float32)
        values = values.to(torch.float32)
        mask = mask.to(torch.float32)
        batch, length = rewards.shape
        advantages = torch.zeros_like(rewards)
        next_adv = torch.zeros(batch, dtype=torch.float32, device=rewards.device)
        next_value = torch.zeros_like(next_adv)
        next_mask = torch.zeros_like(next_adv)
        for t in reversed(range(length)):
            delta = rewards[:, t] + gamma * next_value * next_mask - values[:, t]
            adv = (delta + gamma * lam * next_mask * next_adv) * mask[:, t]
            advantages[:, t] = adv
            next_adv, next_value, next_mask = adv, values[:, t], mask[:, t]
        returns = (advantages + values) * mask
    return advantages, returns


def _check_grouped(rewards: torch.Tensor) -> None:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [num_groups, group_size], got {rewards.shape}")
