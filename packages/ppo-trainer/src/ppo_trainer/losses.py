"""PPO losses, KL penalties, entropy and loss aggregation, as plain functions on tensors.

Conventions: per-token tensors have shape `[B, T]` (B sequences, T response positions) and
`mask` is 1 on tokens that count, 0 on padding. Log-probs are of the sampled tokens.
"""

from __future__ import annotations

import torch

from ppo_trainer.config import KLEstimator, LossAgg

__all__ = [
    "aggregate_loss",
    "entropy_from_logits",
    "kl_penalty",
    "masked_mean",
    "policy_loss",
    "token_logprobs",
    "value_loss",
]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(values * mask) / max(sum(mask), 1)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def aggregate_loss(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAgg = "token-mean",
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce per-token losses `l[b, t]` (valid where `m[b, t] = 1`) to a scalar.

    - token-mean:           sum_{b,t} l*m / N_tok           (every token weighs the same)
    - seq-mean-token-sum:   sum_b (sum_t l*m) / N_seq       (longer sequences weigh more)
    - seq-mean-token-mean:  sum_b (sum_t l*m / sum_t m) / N_seq   (every sequence the same)

    N_tok = sum(m) and N_seq = B unless `num_tokens` / `num_seqs` are given: with gradient
    accumulation pass the whole minibatch's counts so the micro-batch losses add up to exactly
    the minibatch loss.
    """
    mask = mask.to(token_loss.dtype)
    masked = token_loss * mask
    if mode == "token-mean":
        if num_tokens is None:
            return masked.sum() / mask.sum().clamp(min=1.0)
        return masked.sum() / max(float(num_tokens), 1.0)
    seqs = float(token_loss.shape[0]) if num_seqs is None else float(num_seqs)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(seqs, 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
        return per_seq.sum() / max(seqs, 1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature)[target], in float32, shape of `targets`.

    Computed as z[target] - logsumexp(z) so the full log-softmax is never materialised.
    """
    logits = logits.to(torch.float32)
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(z) per position: H = logsumexp(z) - sum_v softmax(z)_v * z_v."""
    logits = logits.to(torch.float32)
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def kl_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator = "k3"
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi.

    With d = logp - ref_logp:

    - k1 = d                         (unbiased, can be negative)
    - k2 = d^2 / 2                   (biased, low variance, >= 0)
    - k3 = exp(-d) - 1 + d           (unbiased, >= 0; Schulman's estimator)
    """
    diff = logp - ref_logp
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "k3":
        return torch.expm1(-diff) + diff
    raise ValueError(f"unknown KL estimator {estimator!r}")


def policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    behav_logp: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    is_cap: float | None = None,
    loss_agg: LossAgg = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped (decoupled) PPO policy loss; returns (scalar loss, detached metrics).

    Per token, with r = exp(logp - prox_logp) and e_lo = clip_eps, e_hi = clip_eps_high:

        l = max(-A * r, -A * clip(r, 1 - e_lo, 1 + e_hi))    (= -min(r*A, clip(r)*A))
        l = min(l, -c * A)          where A < 0, if dual_clip = c (bounds huge ratios)
        l = l * w,   w = min(exp(prox_logp - behav_logp), is_cap)   (detached)

    `prox_logp` is the proximal policy (the trainer's current weights before this step's
    updates, recomputed without gradient); `behav_logp` is the engine's (behaviour) policy.
    Without `behav_logp` w = 1 (plain PPO with `prox_logp` as the old policy).

    Metrics (masked means over tokens): `clipfrac` (the clipped branch is active,
    i.e. -A*clip(r) > -A*r), `dual_clipfrac`, `approx_kl` = mean((r - 1) - log r)
    (the k3 estimate of KL(prox || current)), `is_weight_mean`, `is_weight_max`,
    `is_capped_frac`, `ratio_mean`.
    """
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    advantages = advantages.to(logp.dtype)
    log_ratio = logp - prox_logp.detach()
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_high)
    token_loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped

    dual_active = torch.zeros_like(is_clipped)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_active = (advantages < 0) & (bound < token_loss)
        token_loss = torch.where(advantages < 0, torch.minimum(token_loss, bound), token_loss)

    if behav_logp is None:
        weight = torch.ones_like(logp)
    else:
        weight = torch.exp(prox_logp.detach() - behav_logp.detach())
    capped = torch.zeros_like(is_clipped)
    if is_cap is not None:
        capped = weight > is_cap
        weight = weight.clamp(max=is_cap)
    weight = weight.detach()
    token_loss = token_loss * weight

    loss = aggregate_loss(token_loss, mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
    with torch.no_grad():
        valid = mask.to(torch.bool)
        metrics = {
            "clipfrac": masked_mean(is_clipped.float(), mask),
            "dual_clipfrac": masked_mean(dual_active.float(), mask),
            "approx_kl": masked_mean(ratio.detach() - 1.0 - log_ratio.detach(), mask),
            "is_weight_mean": masked_mean(weight, mask),
            "is_weight_max": weight[valid].max() if valid.any() else weight.new_tensor(0.0),
            "is_capped_frac": masked_mean(capped.float(), mask),
            "ratio_mean": masked_mean(ratio.detach(), mask),
        }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    loss_agg: LossAgg = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss; returns (scalar loss, detached metrics).

        V_clip = V_old + clip(V - V_old, -clip_eps, clip_eps)
        l      = 0.5 * max((V - R)^2, (V_clip - R)^2)

    Metric `vf_clipfrac`: fraction of tokens where the clipped term is the larger one.
    """
    old_values = old_values.detach()
    returns = returns.detach()
    clipped_values = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    unclipped_sq = (values - returns).square()
    clipped_sq = (clipped_values - returns).square()
    token_loss = 0.5 * torch.maximum(unclipped_sq, clipped_sq)
    loss = aggregate_loss(token_loss, mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
    with torch.no_grad():
        metrics = {"vf_clipfrac": masked_mean((clipped_sq > unclipped_sq).float(), mask)}
    return loss, metrics
