"""PPO losses, KL penalties, entropy and loss aggregation, as plain functions on tensors.

Conventions: per-token tensors have shape `[B, T]` (B sequences, T response positions) and
`mask` is 1 on tokens that count, 0 on padding. Log-probs are of the sampled tokens.

Masked positions are *selected away* (`torch.where`), never multiplied by 0: a NaN or inf at
a padded position (garbage log-probs of pad tokens, an advantage of an empty row) cannot reach
a loss, a metric or a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppo_trainer.config import IS_LEVELS, IS_MODES, ISLevel, ISMode, KLEstimator, LossAgg

__all__ = [
    "KL_CLAMP",
    "KL_LOG_RATIO_CLAMP",
    "LOG_RATIO_CLAMP",
    "ImportanceWeights",
    "aggregate_loss",
    "entropy_from_logits",
    "importance_weights",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "token_logprobs",
    "value_loss",
]

LOG_RATIO_CLAMP = 20.0
"""`policy_loss` clamps every log-ratio to [-20, 20] before `exp` (as verl does)."""
KL_LOG_RATIO_CLAMP = 20.0
"""`kl_penalty(clamp=True)` clamps the k3 log-ratio to [-20, 20] before `exp`."""
KL_CLAMP = 10.0
"""`kl_penalty(clamp=True)` clamps k3 to [-10, 10]; so does the `approx_kl` metric."""


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum of `values` where `mask` is non-zero (others selected away, even NaN/inf)."""
    return torch.where(mask.bool(), values, torch.zeros_like(values)).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(values where mask) / max(sum(mask), 1); NaN/inf at masked positions are ignored."""
    count = mask.bool().sum().to(values.dtype if values.is_floating_point() else torch.float32)
    return masked_sum(values, mask) / count.clamp(min=1.0)


def aggregate_loss(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAgg = "token-mean",
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    horizon: float | None = None,
) -> torch.Tensor:
    """Reduce per-token losses `l[b, t]` (valid where `m[b, t] = 1`) to a scalar.

    - token-mean:              sum_{b,t} l*m / N_tok        (every token weighs the same)
    - token-sum:               sum_{b,t} l*m                (no normalisation at all)
    - seq-mean-token-sum:      sum_b (sum_t l*m) / N_seq    (longer sequences weigh more)
    - seq-mean-token-sum-norm: sum_b (sum_t l*m / H) / N_seq  (verl's / Dr. GRPO's: a constant
      horizon H = `horizon`, e.g. the max response length, replaces each sequence's length, so
      no length bias and no per-batch normaliser)
    - seq-mean-token-mean:     sum_b (sum_t l*m / sum_t m) / N_seq   (every sequence the same)

    N_tok = sum(m) and N_seq = B unless `num_tokens` / `num_seqs` are given: with gradient
    accumulation pass the whole minibatch's counts so the micro-batch losses add up to exactly
    the minibatch loss. Masked positions are selected away (NaN/inf there do not matter).
    """
    valid = mask.bool()
    masked = torch.where(valid, token_loss, torch.zeros_like(token_loss))
    if mode == "token-mean":
        if num_tokens is None:
            return masked.sum() / valid.sum().clamp(min=1).to(masked.dtype)
        return masked.sum() / max(float(num_tokens), 1.0)
    if mode == "token-sum":
        return masked.sum()
    seqs = float(token_loss.shape[0]) if num_seqs is None else float(num_seqs)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        if horizon is None or horizon <= 0:
            raise ValueError("seq-mean-token-sum-norm needs a constant horizon > 0")
        return masked.sum() / float(horizon) / max(seqs, 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=-1) / valid.sum(dim=-1).clamp(min=1).to(masked.dtype)
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
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    estimator: KLEstimator = "k3",
    *,
    clamp: bool = False,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi.

    With d = logp - ref_logp:

    - k1  = d                         (unbiased, can be negative)
    - k2  = d^2 / 2                   (biased, low variance, >= 0)
    - k3  = exp(-d) - 1 + d           (unbiased, >= 0; Schulman's estimator)
    - abs = |d|                       (biased, >= 0)

    `clamp` (k3 only): d is clamped to [-20, 20] before `exp` and k3 to [-10, 10], as verl's
    "low_var_kl" does; a token with d = -25 then costs 10 instead of ~7e10.
    """
    diff = logp - ref_logp
    if clamp and estimator != "k3":
        raise ValueError(f"clamp applies to the k3 estimator only, not {estimator!r}")
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "abs":
        return diff.abs()
    if estimator == "k3":
        if clamp:
            diff = diff.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
            return (torch.expm1(-diff) + diff).clamp(-KL_CLAMP, KL_CLAMP)
        return torch.expm1(-diff) + diff
    raise ValueError(f"unknown KL estimator {estimator!r}")


# Over 60 lines on purpose: the loss reads top to bottom like the formula in its docstring
# (clip, dual clip, importance weight, aggregate); split up, the numerics would be harder to check.
def policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    behav_logp: torch.Tensor | None = None,
    clip_eps: float | torch.Tensor = 0.2,
    clip_eps_high: float | torch.Tensor | None = None,
    dual_clip: float | None = None,
    is_cap: float | None = None,
    is_level: ISLevel = "token",
    is_mode: ISMode = "truncate",
    loss_agg: LossAgg = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    horizon: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped (decoupled) PPO policy loss; returns (scalar loss, detached metrics).

    Per token, with log r = clamp(logp - prox_logp, -20, 20), r = exp(log r), e_lo =
    clip_eps and e_hi = clip_eps_high (default: clip_eps; either may be a per-token tensor):

        l = max(-A * r, -A * clip(r, 1 - e_lo, 1 + e_hi))    (= -min(r*A, clip(r)*A))
        l = min(l, -c * A)          where A < 0, if dual_clip = c (bounds huge ratios)
        l = l * w                   w: the importance weight, see `importance_weights`

    `prox_logp` is the proximal policy (the trainer's current weights before this step's
    updates, recomputed without gradient); `behav_logp` is the engine's (behaviour) policy.
    Without `behav_logp` w = 1 (plain PPO with `prox_logp` as the old policy). The tokens
    are summed into one loss by `aggregate_loss` (`loss_agg`). The clamps keep `exp` finite;
    masked positions are selected away before anything is computed on them, so NaN/inf there
    reach neither the loss nor the gradient. Metrics: see `_policy_metrics`.
    """
    if is_level not in IS_LEVELS:
        raise ValueError(f"unknown is_level {is_level!r}; choose from {IS_LEVELS}")
    if is_mode not in IS_MODES:
        raise ValueError(f"unknown is_mode {is_mode!r}; choose from {IS_MODES}")
    valid = mask.bool()
    zeros = torch.zeros_like(logp)
    advantages = torch.where(valid, advantages.to(logp.dtype), zeros)
    log_ratio = torch.where(valid, logp - prox_logp.detach(), zeros)
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    token_loss, is_clipped, dual_active = _clipped_token_loss(
        ratio, advantages, clip_eps, eps_high, dual_clip
    )
    weights = importance_weights(
        prox_logp, behav_logp, valid, is_cap=is_cap, is_level=is_level, is_mode=is_mode
    )
    token_loss = token_loss * weights.weight
    loss = aggregate_loss(
        token_loss, mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon
    )
    return loss, _policy_metrics(log_ratio, is_clipped, dual_active, weights, mask)


def _clipped_token_loss(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float | torch.Tensor,
    eps_high: float | torch.Tensor,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate (and dual clip); returns it with where each clip was active."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    token_loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    dual_active = torch.zeros_like(is_clipped)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_active = (advantages < 0) & (bound < token_loss)
        token_loss = torch.where(advantages < 0, torch.minimum(token_loss, bound), token_loss)
    return token_loss, is_clipped, dual_active


@dataclass(frozen=True)
class ImportanceWeights:
    """Detached per-token importance weights, with where they were truncated or masked."""

    weight: torch.Tensor
    capped: torch.Tensor
    masked: torch.Tensor


def importance_weights(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor | None,
    valid: torch.Tensor,
    *,
    is_cap: float | None = None,
    is_level: ISLevel = "token",
    is_mode: ISMode = "truncate",
) -> ImportanceWeights:
    """w = exp(clamp(prox_logp - behav_logp, -20, 20)), corrected for the behaviour policy.

    `is_level="sequence"` uses one weight per sequence, the product of its tokens' ratios
    (log w = sum over the response of prox_logp - behav_logp, clamped the same way), on every
    token of it. With `is_cap`, `is_mode="truncate"` caps w at is_cap; `is_mode="mask"` drops
    (weight 0) the tokens, or sequences, whose weight lies outside [1 / is_cap, is_cap]: a
    sample the behaviour policy made far too likely or unlikely then teaches nothing rather
    than something biased. Without `behav_logp`, w = 1.
    """
    zeros = torch.zeros_like(prox_logp)
    if behav_logp is None:
        weight = torch.ones_like(prox_logp)
    else:
        log_w = torch.where(valid, prox_logp.detach() - behav_logp.detach(), zeros)
        if is_level == "sequence":
            log_w = log_w.sum(dim=-1, keepdim=True).expand_as(log_w)
        weight = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    capped = torch.zeros_like(valid)
    masked = torch.zeros_like(valid)
    if is_cap is not None and is_mode == "truncate":
        capped = valid & (weight > is_cap)
        weight = weight.clamp(max=is_cap)
    elif is_cap is not None:
        masked = valid & ((weight > is_cap) | (weight < 1.0 / is_cap))
        weight = torch.where(masked, zeros, weight)
    return ImportanceWeights(weight.detach(), capped, masked)


def _policy_metrics(
    log_ratio: torch.Tensor,
    is_clipped: torch.Tensor,
    dual_active: torch.Tensor,
    weights: ImportanceWeights,
    mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Masked means over tokens: `clipfrac` (the clipped branch is active, i.e. -A*clip(r) >
    -A*r), `dual_clipfrac`, `approx_kl` = mean(clamp((r - 1) - log r, max=10)) (the k3
    estimate of KL(prox || current), clamped per token like `kl_clamp`), `ppo_kl` =
    mean(-log r) (the k1 estimate, verl's `ppo_kl`), `is_weight_mean`, `is_weight_max`
    (after truncation or masking), `is_capped_frac` (truncated), `is_masked_frac` (masked),
    `ratio_mean`."""
    valid = mask.bool()
    weight = weights.weight
    with torch.no_grad():
        log_ratio = log_ratio.detach()
        k3 = (torch.expm1(log_ratio) - log_ratio).clamp(max=KL_CLAMP)
        dtype = log_ratio.dtype
        # One masked reduction for all eight means: eight `masked_mean`s are a fixed cost
        # per micro-batch that shows on small models.
        per_token = {
            "clipfrac": is_clipped,
            "dual_clipfrac": dual_active,
            "approx_kl": k3,
            "ppo_kl": -log_ratio,
            "is_weight_mean": weight,
            "is_capped_frac": weights.capped,
            "is_masked_frac": weights.masked,
            "ratio_mean": torch.exp(log_ratio),
        }
        stacked = torch.stack([t.to(dtype) for t in per_token.values()])
        count = valid.sum().to(dtype).clamp(min=1.0)
        means = torch.where(valid, stacked, 0.0).flatten(1).sum(dim=1) / count
        metrics = dict(zip(per_token, means.unbind(), strict=True))
        metrics["is_weight_max"] = weight[valid].max() if valid.any() else weight.new_tensor(0.0)
        return metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float | None = 0.2,
    loss_agg: LossAgg = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    horizon: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss; returns (scalar loss, detached metrics).

        V_clip = V_old + clip(V - V_old, -clip_eps, clip_eps)
        l      = 0.5 * max((V - R)^2, (V_clip - R)^2)      (clip_eps None: 0.5 * (V - R)^2)

    `old_values` are the value head's outputs before this step's updates and `returns` the
    GAE targets R = A + V_old (both detached). Metrics: `vf_clipfrac`, the fraction of tokens
    where the clipped term is the larger one, and `value_mean`, the mean of V.
    """
    valid = mask.bool()
    zeros = torch.zeros_like(values)
    old_values = torch.where(valid, old_values.detach().to(values.dtype), zeros)
    returns = torch.where(valid, returns.detach().to(values.dtype), zeros)
    values_in = torch.where(valid, values, zeros)
    unclipped_sq = (values_in - returns).square()
    if clip_eps is None:
        token_loss = 0.5 * unclipped_sq
        is_clipped = torch.zeros_like(valid)
    else:
        clipped_values = old_values + torch.clamp(values_in - old_values, -clip_eps, clip_eps)
        clipped_sq = (clipped_values - returns).square()
        token_loss = 0.5 * torch.maximum(unclipped_sq, clipped_sq)
        is_clipped = clipped_sq > unclipped_sq
    loss = aggregate_loss(
        token_loss, mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon
    )
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": masked_mean(is_clipped.float(), mask),
            "value_mean": masked_mean(values.detach(), mask),
        }
    return loss, metrics
