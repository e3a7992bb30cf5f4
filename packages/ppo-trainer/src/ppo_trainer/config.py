"""`PPOConfig`: every hyperparameter of the trainer, in one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ADVANTAGE_MODES",
    "DEFAULT_MAX_STALENESS",
    "IS_LEVELS",
    "IS_MODES",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "AdvantageMode",
    "ISLevel",
    "ISMode",
    "KLEstimator",
    "LRSchedule",
    "LossAgg",
    "PPOConfig",
]

LossAgg = Literal[
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
]
AdvantageMode = Literal["grpo", "rloo", "gae"]
KLEstimator = Literal["k1", "k2", "k3", "abs"]
LRSchedule = Literal["constant", "linear", "cosine"]
ISLevel = Literal["token", "sequence"]
ISMode = Literal["truncate", "mask"]

# The staleness bound k of the whole stack (rollouter and app use the same value): two
# versions of lag keep the rollouter busy while the trainer steps, and the decoupled loss
# corrects that much off-policyness.
DEFAULT_MAX_STALENESS = 2

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)
ADVANTAGE_MODES: tuple[str, ...] = ("grpo", "rloo", "gae")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "abs")
IS_LEVELS: tuple[str, ...] = ("token", "sequence")
IS_MODES: tuple[str, ...] = ("truncate", "mask")


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
    """Upper clip range ("clip-higher", asymmetric clip): the ratio is clipped to
    [1 - clip_eps, 1 + clip_eps_high], so a token whose probability the update raises may
    rise further than one it lowers may fall (DAPO uses 0.28 with clip_eps 0.2). None:
    `clip_eps` (symmetric)."""
    clip_staleness_scale: float = 0.0
    """Tighter clip for stale tokens: each token's clip range (both ends) is divided by
    1 + clip_staleness_scale * s, s = the step's version minus the version that generated the
    token. 0: off (every token gets `clip_eps`); with 1, a token one version old gets half."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1: for A < 0 the loss is bounded by -c * A. None: off."""
    is_cap: float | None = 2.0
    """Cap of the truncated importance weight exp(prox_logp - behav_logp). None: no cap."""
    is_level: ISLevel = "token"
    """Importance weight per "token" or per "sequence" (the product of its tokens' ratios,
    applied to all of them)."""
    is_mode: ISMode = "truncate"
    """What happens to a weight beyond `is_cap`: "truncate" it to the cap, or "mask" the
    token (or sequence) out of the loss; "mask" also drops weights below 1 / is_cap."""
    use_behaviour_logprobs: bool = True
    """Decoupled PPO: weight each token by the (truncated) proximal/behaviour ratio."""
    temperature: float = 1.0
    """Sampling temperature of the engine; log-probs are of softmax(logits / temperature)."""
    loss_agg: LossAgg = "token-mean"
    """How per-token losses become one scalar (see `losses.aggregate_loss`): "token-mean",
    "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm" or "seq-mean-token-mean"."""
    loss_agg_horizon: int | None = None
    """The constant H of "seq-mean-token-sum-norm" (required there, unused otherwise): each
    sequence's token sum is divided by H, not by its length (Dr. GRPO); use the response
    length budget (the engine's max tokens)."""

    # --- regularisers -------------------------------------------------------------------
    kl_coef: float = 0.0
    """Weight of the KL penalty against the reference model (needs `ref_model`)."""
    kl_estimator: KLEstimator = "k3"
    """Per-token KL estimator: "k1", "k2", "k3" or "abs" (see `losses.kl_penalty`)."""
    kl_clamp: bool = False
    """k3 only: clamp the log-ratio to [-20, 20] and k3 to [-10, 10] (verl's "low_var_kl"),
    so one token whose reference log-prob is far off cannot dominate the penalty."""
    entropy_coef: float = 0.0
    """Entropy bonus weight: loss -= entropy_coef * entropy."""

    # --- advantages ---------------------------------------------------------------------
    advantage: AdvantageMode = "grpo"
    """Advantage estimator: "grpo" (group mean, optional std), "rloo" (leave-one-out group
    mean) or "gae" (a learned value head on the policy trunk and GAE(gamma, lam); see the
    README)."""
    norm_std: bool = True
    """GRPO only: divide by the group's standard deviation."""
    adv_eps: float = 1e-6
    """Added to the std before dividing."""
    gamma: float = 1.0
    """GAE only: discount per response token, in [0, 1]."""
    lam: float = 1.0
    """GAE only: lambda of GAE(gamma, lambda), in [0, 1] (1: Monte-Carlo return minus V)."""
    whiten_advantages: bool = True
    """GAE only: whiten the advantages over the response tokens of the whole step (masked
    mean 0, variance 1), as verl does."""
    vf_coef: float = 0.1
    """GAE only: weight of the value loss in the total loss (> 0). The value head sits on the
    policy trunk, so this also sets how much the value gradient moves the policy's weights;
    0.1 learned best on the repeat task (0.5 and 0.02 plateaued lower; see the README)."""
    value_clip: float | None = 0.2
    """GAE only: clip range of the value loss (V - V_old clipped to +-value_clip before the
    squared error is maximised with the unclipped one). None: unclipped squared error."""
    value_lr: float | None = None
    """GAE only: peak learning rate of the value head (its own AdamW param group, same
    schedule). None: `lr`."""

    # --- asynchrony ---------------------------------------------------------------------
    sync_every: int = 1
    """Push weights (and bump the policy version) every this many steps."""
    max_staleness: int = DEFAULT_MAX_STALENESS
    """Drop a group whose staleness (version - min token version) exceeds this (unless the
    trainer is given a `StalenessBound`, which then decides)."""
    initial_version: int = 0
    """Policy version of the weights the trainer starts with."""
    background_push: bool = True
    """Push weights in the background: the next batch is fetched and trained on while the
    rollouters load the new version. Pushes stay in version order (a push waits for the one
    before it), and `train()` returns only after the last one landed. Off: every step waits
    for its push."""

    # --- misc ---------------------------------------------------------------------------
    seed: int = 0
    """Seeds the minibatch shuffling generator (and, with `deterministic`, torch's)."""
    deterministic: bool = False
    """Repeatable steps: torch uses deterministic kernels where it has them
    (`torch.use_deterministic_algorithms`, warning where it has none) and its global RNG
    (dropout) is seeded with `seed` when the trainer is built. Process-wide; may be slower
    on a GPU. The data (which groups, in which order) must repeat too."""
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
        if self.clip_staleness_scale < 0:
            raise ValueError(f"clip_staleness_scale must be >= 0, got {self.clip_staleness_scale}")
        if self.clip_eps_high is not None and self.clip_eps_high < 0:
            raise ValueError(f"clip_eps_high must be >= 0 (or None), got {self.clip_eps_high}")
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
        self._check_modes_and_ranges()

    def _check_modes_and_ranges(self) -> None:
        """The string choices, and the ranges of the loss, KL and GAE options."""
        for name, allowed in (
            ("loss_agg", LOSS_AGG_MODES),
            ("advantage", ADVANTAGE_MODES),
            ("kl_estimator", KL_ESTIMATORS),
            ("is_level", IS_LEVELS),
            ("is_mode", IS_MODES),
            ("lr_schedule", ("constant", "linear", "cosine")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.loss_agg == "seq-mean-token-sum-norm" and self.loss_agg_horizon is None:
            raise ValueError(
                "loss_agg='seq-mean-token-sum-norm' needs loss_agg_horizon: the constant number "
                "of tokens every sequence's loss sum is divided by (e.g. the max response length)"
            )
        if self.loss_agg_horizon is not None and self.loss_agg_horizon < 1:
            raise ValueError(f"loss_agg_horizon must be >= 1, got {self.loss_agg_horizon}")
        if self.kl_clamp and self.kl_estimator != "k3":
            raise ValueError(
                f"kl_clamp applies to the k3 estimator only, got kl_estimator={self.kl_estimator!r}"
            )
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.vf_coef <= 0:
            raise ValueError(f"vf_coef must be > 0, got {self.vf_coef}")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ValueError(f"value_clip must be > 0 (or None: no clip), got {self.value_clip}")
        if self.value_lr is not None and self.value_lr <= 0:
            raise ValueError(f"value_lr must be > 0 (or None: lr), got {self.value_lr}")

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps taken per trainer step."""
        return self.ppo_epochs * self.num_minibatches
