"""`PPOConfig`: every hyperparameter of the trainer, in one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["AdvantageMode", "KLEstimator", "LRSchedule", "LossAgg", "PPOConfig"]

LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
AdvantageMode = Literal["grpo", "rloo"]
KLEstimator = Literal["k1", "k2", "k3"]
LRSchedule = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True, slots=True)
class PPOConfig:
    """Hyperparameters of `PPOTrainer` (all plain values, validated on construction).

    One *step* consumes `batch_size` groups (each group = all responses of one prompt), then
    runs `ppo_epochs` passes over them, each split into `num_minibatches` optimizer steps;
    each minibatch is processed in `grad_accum` micro-batches whose gradients add up to
    exactly the minibatch gradient (the loss normaliser is the minibatch's, not the
    micro-batch's).
    """

    # --- optimisation -------------------------------------------------------------------
    lr: float = 1e-6
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2)."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient L2 norm to this before each optimizer step (None: no clip)."""
    lr_schedule: LRSchedule = "constant"
    """LR multiplier after warmup: constant 1, linear decay to `min_lr_ratio`, or cosine."""
    warmup_steps: int = 0
    """Linear warmup to `lr` over this many trainer steps (see `schedule.lr_multiplier`)."""
    total_steps: int | None = None
    """Trainer steps to run; `train()` returns after this many. Linear/cosine need it."""
    min_lr_ratio: float = 0.0
    """Floor of the decaying schedules, as a fraction of `lr`."""

    # --- batching -----------------------------------------------------------------------
    batch_size: int = 8
    """Groups (prompts) consumed per trainer step."""
    ppo_epochs: int = 1
    """Passes over each step's batch."""
    num_minibatches: int = 1
    """Optimizer steps per epoch; sequences are shuffled into this many minibatches."""
    grad_accum: int = 1
    """Micro-batches per minibatch (bounds activation memory; same gradient)."""

    # --- policy loss --------------------------------------------------------------------
    clip_eps: float = 0.2
    """PPO clip range: ratio clipped to [1 - clip_eps, 1 + clip_eps_high]."""
    clip_eps_high: float | None = None
    """Upper clip range ("clip-higher"); None uses `clip_eps`."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1: for A < 0 the loss is bounded by -c * A. None: off."""
    is_cap: float | None = 2.0
    """Cap of the truncated importance weight exp(prox_logp - behav_logp). None: no cap."""
    use_behaviour_logprobs: bool = True
    """Decoupled PPO: weight each token by the (truncated) proximal/behaviour ratio."""
    temperature: float = 1.0
    """Sampling temperature of the engine; log-probs are of softmax(logits / temperature)."""
    loss_agg: LossAgg = "token-mean"
    """How per-token losses become one scalar (see `losses.aggregate_loss`)."""

    # --- regularisers -------------------------------------------------------------------
    kl_coef: float = 0.0
    """Weight of the KL penalty against the reference model (needs `ref_model`)."""
    kl_estimator: KLEstimator = "k3"
    """Per-token KL estimator (see `losses.kl_penalty`)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight: loss -= entropy_coef * entropy."""

    # --- advantages ---------------------------------------------------------------------
    advantage: AdvantageMode = "grpo"
    """Group baseline: "grpo" (mean, optional std) or "rloo" (leave-one-out mean)."""
    norm_std: bool = True
    """GRPO only: divide by the group's standard deviation."""
    adv_eps: float = 1e-6
    """Added to the std before dividing."""

    # --- asynchrony ---------------------------------------------------------------------
    sync_every: int = 1
    """Push weights (and bump the policy version) every this many steps."""
    max_staleness: int = 4
    """Drop a group whose staleness (version - min token version) exceeds this."""
    initial_version: int = 0
    """Policy version of the weights the trainer starts with."""
    background_push: bool = True
    """Push weights in the background: the next batch is fetched and trained on while the
    rollouters load the new version. Pushes stay in version order (a push waits for the one
    before it), and `train()` returns only after the last one landed. Off: every step waits
    for its push."""

    # --- misc ---------------------------------------------------------------------------
    seed: int = 0
    """Seeds the minibatch shuffling generator."""
    checkpoint_dir: str | None = None
    """Where `train()` writes periodic checkpoints (with `checkpoint_every`)."""
    checkpoint_every: int = 0
    """Save `checkpoint_dir/step_NNNNNN` every this many steps and point
    `checkpoint_dir/latest` at it (0: never; needs `checkpoint_dir`)."""
    keep_checkpoints: int = 2
    """Periodic checkpoints kept (older `step_*` directories are deleted; 0 keeps all)."""

    def __post_init__(self) -> None:
        positive = {
            "batch_size": self.batch_size,
            "ppo_epochs": self.ppo_epochs,
            "num_minibatches": self.num_minibatches,
            "grad_accum": self.grad_accum,
            "sync_every": self.sync_every,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.clip_eps < 1:
            raise ValueError(f"clip_eps must be in [0, 1), got {self.clip_eps}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.is_cap is not None and self.is_cap <= 0:
            raise ValueError(f"is_cap must be > 0, got {self.is_cap}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.lr_schedule != "constant" and self.total_steps is None:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} needs total_steps")
        if self.keep_checkpoints < 0:
            raise ValueError(f"keep_checkpoints must be >= 0, got {self.keep_checkpoints}")
        if self.checkpoint_every > 0 and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every > 0 needs checkpoint_dir")
        for name, allowed in (
            ("loss_agg", ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")),
            ("advantage", ("grpo", "rloo")),
            ("kl_estimator", ("k1", "k2", "k3")),
            ("lr_schedule", ("constant", "linear", "cosine")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps taken per trainer step."""
        return self.ppo_epochs * self.num_minibatches
