"""The synchronous torch part of a trainer step: proximal log-probs, then minibatch updates.

`PolicyUpdater` knows nothing about asyncio; `PPOTrainer` runs its methods in a dedicated
worker thread so the event loop stays responsive while it computes.
"""

from __future__ import annotations

import inspect
import logging
from collections import defaultdict
from collections.abc import Iterator

import torch

from ppo_trainer.batch import PackedBatch
from ppo_trainer.config import PPOConfig
from ppo_trainer.losses import (
    aggregate_loss,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    token_logprobs,
)
from ppo_trainer.schedule import make_scheduler

__all__ = ["PolicyUpdater", "export_weights"]

logger = logging.getLogger(__name__)

# Metrics averaged over response tokens across all micro-batches of a step.
_TOKEN_METRICS = (
    "clipfrac",
    "dual_clipfrac",
    "approx_kl",
    "is_weight_mean",
    "is_capped_frac",
    "ratio_mean",
    "entropy",
    "kl_ref",
)


class PolicyUpdater:
    """Owns the model, optimizer, LR scheduler and shuffling generator of a trainer.

    Works with any causal LM whose `forward(input_ids=, attention_mask=, **mm)` returns an
    object with `.logits` of shape [B, L, V] (transformers `AutoModelForCausalLM`, Qwen2-VL).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: PPOConfig,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        ref_model: torch.nn.Module | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.ref_model = ref_model
        params = [p for p in model.parameters() if p.requires_grad]
        self.params = params
        self.optimizer = optimizer or torch.optim.AdamW(
            params,
            lr=config.lr,
            betas=config.adam_betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        self.scheduler = make_scheduler(
            self.optimizer,
            schedule=config.lr_schedule,
            warmup_steps=config.warmup_steps,
            total_steps=config.total_steps,
            min_ratio=config.min_lr_ratio,
        )
        self.generator = torch.Generator().manual_seed(config.seed)
        self.device = next(model.parameters()).device
        if ref_model is not None:
            ref_model.requires_grad_(False)
        self._wants_token_types = _accepts(model, "mm_token_type_ids")

    # -- public -------------------------------------------------------------------------

    def step(self, batch: PackedBatch) -> dict[str, float]:
        """One trainer step on `batch`: `ppo_epochs` x `num_minibatches` optimizer steps."""
        cfg = self.config
        self.model.train()
        # With a single update per batch the current weights *are* the proximal policy, so
        # the extra no-grad forward is skipped and logp.detach() is used instead.
        recompute_prox = cfg.updates_per_step > 1
        use_ref = self.ref_model is not None and cfg.kl_coef != 0.0
        prox = self._logprobs(self.model, batch) if recompute_prox else None
        ref = self._logprobs(self.ref_model, batch) if use_ref and self.ref_model else None
        batch = batch.with_logprobs(prox_logp=prox, ref_logp=ref)

        sums: dict[str, float] = defaultdict(float)
        token_total = 0.0
        losses: list[float] = []
        grad_norms: list[float] = []
        is_weight_max = 0.0
        lr = self.optimizer.param_groups[0]["lr"]
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(batch.size, generator=self.generator)
            for rows in _chunks(order, cfg.num_minibatches):
                minibatch = batch.select(rows)
                n_tok = float(minibatch.response_mask.sum().item())
                n_seq = float(minibatch.size)
                mb_loss = 0.0
                for micro_rows in _chunks(torch.arange(minibatch.size), cfg.grad_accum):
                    micro = minibatch.select(micro_rows)
                    loss, metrics, tokens = self._micro_loss(micro, n_tok, n_seq)
                    loss.backward()
                    mb_loss += float(loss.item())
                    token_total += tokens
                    for key, value in metrics.items():
                        if key == "is_weight_max":
                            is_weight_max = max(is_weight_max, value)
                        else:
                            sums[key] += value * tokens
                max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else float("inf")
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                losses.append(mb_loss)
                grad_norms.append(float(grad_norm))
        self.scheduler.step()

        out = {f"ppo/{k}": sums[k] / max(token_total, 1.0) for k in _TOKEN_METRICS if k in sums}
        out["ppo/loss"] = sum(losses) / len(losses)
        out["ppo/grad_norm"] = sum(grad_norms) / len(grad_norms)
        out["ppo/is_weight_max"] = is_weight_max
        out["trainer/lr"] = float(lr)
        return out

    def export_weights(self) -> dict[str, torch.Tensor]:
        return export_weights(self.model)

    # -- internals ----------------------------------------------------------------------

    def _micro_loss(
        self, micro: PackedBatch, n_tok: float, n_seq: float
    ) -> tuple[torch.Tensor, dict[str, float], float]:
        cfg = self.config
        logits = self._forward(self.model, micro)[:, :-1]
        if cfg.temperature != 1.0:
            logits = logits / cfg.temperature
        targets = micro.input_ids[:, 1:].to(self.device)
        mask = micro.response_mask.to(self.device)
        logp = token_logprobs(logits, targets)
        prox = micro.prox_logp.to(self.device) if micro.prox_logp is not None else logp.detach()
        behav = micro.behav_logp.to(self.device) if cfg.use_behaviour_logprobs else None
        advantages = micro.advantages.to(self.device).unsqueeze(-1).expand_as(logp)
        agg = {"num_tokens": n_tok, "num_seqs": n_seq}
        loss, pg_metrics = policy_loss(
            logp,
            prox,
            advantages,
            mask,
            behav_logp=behav,
            clip_eps=cfg.clip_eps,
            clip_eps_high=cfg.clip_eps_high,
            dual_clip=cfg.dual_clip,
            is_cap=cfg.is_cap,
            loss_agg=cfg.loss_agg,
            **agg,
        )
        metrics = {k: float(v) for k, v in pg_metrics.items()}
        if cfg.entropy_coef != 0.0:
            entropy = entropy_from_logits(logits)
            loss = loss - cfg.entropy_coef * aggregate_loss(entropy, mask, cfg.loss_agg, **agg)
        else:
            with torch.no_grad():
                entropy = entropy_from_logits(logits.detach())
        metrics["entropy"] = float(_masked_mean(entropy.detach(), mask))
        if micro.ref_logp is not None:
            kl = kl_penalty(logp, micro.ref_logp.to(self.device), cfg.kl_estimator)
            loss = loss + cfg.kl_coef * aggregate_loss(kl, mask, cfg.loss_agg, **agg)
            metrics["kl_ref"] = float(_masked_mean(kl.detach(), mask))
        return loss, metrics, float(mask.sum().item())

    @torch.no_grad()
    def _logprobs(self, model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
        """Token log-probs of `batch` under `model` (no grad), [B, L-1] on the CPU."""
        out = torch.zeros_like(batch.behav_logp)
        micro_batches = self.config.num_minibatches * self.config.grad_accum
        micro_size = max(1, -(-batch.size // micro_batches))
        for start in range(0, batch.size, micro_size):
            rows = torch.arange(start, min(start + micro_size, batch.size))
            micro = batch.select(rows)
            logits = self._forward(model, micro)[:, :-1]
            targets = micro.input_ids[:, 1:].to(logits.device)
            logp = token_logprobs(logits, targets, self.config.temperature)
            out[rows, : logp.shape[1]] = logp.to("cpu", torch.float32)
        return out

    def _forward(self, model: torch.nn.Module, micro: PackedBatch) -> torch.Tensor:
        device = next(model.parameters()).device
        inputs = {k: v.to(device) for k, v in micro.model_inputs().items()}
        if len(inputs) > 2 and self._wants_token_types and "mm_token_type_ids" not in inputs:
            inputs["mm_token_type_ids"] = _mm_token_type_ids(model, inputs["input_ids"])
        return model(**inputs).logits


def export_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> detached CPU copy of every parameter and persistent buffer.

    Tied tensors appear once (under their first name, like `save_pretrained`), so a tied LM
    head is not sent twice; load with `load_state_dict(strict=False)` or vLLM `load_weights`.
    """
    weights: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        key = tensor.data_ptr()
        if key in seen and tensor.numel() > 0:
            continue
        seen.add(key)
        weights[name] = tensor.detach().to("cpu", copy=True)
    return weights


def _chunks(index: torch.Tensor, parts: int) -> Iterator[torch.Tensor]:
    """Split a 1-D index tensor into `parts` near-equal non-empty chunks."""
    for chunk in torch.tensor_split(index, min(parts, len(index))):
        if len(chunk):
            yield chunk


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def _accepts(model: torch.nn.Module, argument: str) -> bool:
    try:
        return argument in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _mm_token_type_ids(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Qwen2-VL family: 1 on image placeholder tokens, 2 on video ones, 0 elsewhere."""
    config = getattr(model, "config", None)
    types = torch.zeros_like(input_ids)
    for token_attr, value in (("image_token_id", 1), ("video_token_id", 2)):
        token_id = getattr(config, token_attr, None)
        if token_id is not None:
            types = torch.where(input_ids == token_id, torch.full_like(types, value), types)
    return types
