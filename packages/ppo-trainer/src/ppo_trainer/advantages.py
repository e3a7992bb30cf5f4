"""Advantage estimators, as plain functions on tensors.

Critic-free estimators (`grpo_advantages`, `rloo_advantages`) take one scalar reward per
response, grouped `[num_groups, group_size]`, and return one advantage per response (the
trainer broadcasts it over the response tokens). `gae_advantages` is the token-level estimator
for a value model; `masked_whiten` normalises its output over the valid tokens of a batch.
"""

from __future__ import annotations

import torch

__all__ = ["gae_advantages", "grpo_advantages", "masked_whiten", "rloo_advantages"]


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

    Shapes `[B, T]`; `mask` is 1 on the tokens the policy generated and 0 elsewhere: padding
    after the response *and* masked tokens inside it (e.g. a tool's output in a multi-turn
    episode). A mask hole does not end the episode: GAE runs over the valid tokens only, as if
    the masked positions were deleted from the sequence. Backwards, carrying (A', V') from the
    next valid token (both 0 after the last one: the episode ends there):

        valid t:   delta_t = r_t + gamma * V' - V_t
                   A_t     = delta_t + gamma * lam * A'        then A' = A_t, V' = V_t
        masked t:  A_t = 0; (A', V') pass through unchanged, and r_t is ignored
                   (put rewards on generated tokens, e.g. the last one)
        R_t = A_t + V_t on valid tokens, 0 on masked ones (the value target)

    gamma and lam discount per *generated* token; masked tokens cost no discount step (as in
    verl's `compute_gae_advantage_return`). Computed backwards in float32 without gradient
    (the values are treated as constants).
    """
    if not rewards.shape == values.shape == mask.shape or rewards.dim() != 2:
        raise ValueError("rewards, values and mask must all have shape [B, T]")
    with torch.no_grad():
        valid = mask.bool()
        zeros = torch.zeros(rewards.shape, dtype=torch.float32, device=rewards.device)
        rewards = torch.where(valid, rewards.to(torch.float32), zeros)
        values = torch.where(valid, values.to(torch.float32), zeros)
        batch, length = rewards.shape
        advantages = torch.zeros_like(rewards)
        next_adv = torch.zeros(batch, dtype=torch.float32, device=rewards.device)
        next_value = torch.zeros_like(next_adv)
        for t in reversed(range(length)):
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            adv = delta + gamma * lam * next_adv
            here = valid[:, t]
            advantages[:, t] = torch.where(here, adv, 0.0)
            next_adv = torch.where(here, adv, next_adv)
            next_value = torch.where(here, values[:, t], next_value)
        returns = torch.where(valid, advantages + values, zeros)
    return advantages, returns


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the positions where `mask` is 1; 0 elsewhere.

    mean and var are taken over the valid positions of the whole tensor (every sequence of the
    batch together); var is the unbiased sample variance (divides by n - 1), as verl's
    `masked_whiten`. With fewer than 2 valid positions the result is only centred (all 0).
    NaN/inf at masked positions are ignored.
    """
    with torch.no_grad():
        valid = mask.bool()
        x = torch.where(valid, values.to(torch.float32), 0.0)
        n = valid.sum()
        if int(n) < 2:
            return torch.zeros_like(x)
        mean = x.sum() / n
        centred = torch.where(valid, x - mean, 0.0)
        var = centred.square().sum() / (n - 1)
        return centred * torch.rsqrt(var + eps)


def _check_grouped(rewards: torch.Tensor) -> None:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [num_groups, group_size], got {rewards.shape}")
