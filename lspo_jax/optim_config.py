"""The optimizers' sections of a run's config: ``optim`` (the RL update's) and ``scaffold.sft`` (the adapter's), both
AdamW with a warm-up, a decay and clipping (``AdamWConfig``); ``rl.optim`` builds them."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from lspo_jax.options import FieldError, LRSchedule, PolicyTraining, check, check_fields, choices


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
    """AdamW with linear warm-up, a decay after it, and global-norm clipping.

    ``lr_t = lr * min(1, (t + 1) / warmup_steps)`` for update t = 0, 1, ... (the first update already moves;
    ``warmup_steps = 0``: no warm-up). After the warm-up ``schedule`` holds ``lr`` (``constant``) or decays it to
    ``min_lr_ratio * lr`` at update ``decay_steps``, then holds that: with the progress
    ``p = min(1, (t - W) / max(1, D - W))`` (W = warmup_steps, D = decay_steps, m = min_lr_ratio), ``cosine`` is
    ``lr * (m + (1 - m) (1 + cos(pi p)) / 2)`` and ``linear`` is ``lr * (1 - (1 - m) p)``. ``decay_steps: null`` is the
    optimizer's lifetime in updates, filled in by the run's config (``TrainConfig``) and recorded in its config.yaml:
    for ``optim`` the run's updates (``steps x optim.mini_batches x optim.epochs``), for ``scaffold.sft``
    ``scaffold.sft_steps`` (a fresh adapter's optimizer lives for one step's SFT; give a persistent adapter's its own).
    ``max_grad_norm = None`` disables clipping. Weight decay is decoupled (``p -= lr_t * weight_decay * p``) and applies
    to every parameter of the subtree.
    """

    SECTION: ClassVar[str] = ""  # the dotted section a subclass is read at, which its option errors name

    lr: float = 1e-3
    warmup_steps: int = 0
    """Linear warm-up over this many updates, `lr * min(1, (t + 1) / warmup_steps)` (0: none), before `optim.schedule`.
    """
    schedule: LRSchedule = "constant"
    """The rate after the warm-up: `constant`, or decayed to `min_lr_ratio * lr` at `decay_steps` by `cosine` (`m + (1 -
    m) (1 + cos(pi p)) / 2`) or `linear` (`1 - (1 - m) p`), `p = min(1, (t - warmup) / (decay_steps - warmup))`."""
    min_lr_ratio: float = 0.0
    """The decayed rate's floor as a share of `optim.lr`, in [0, 1]."""
    decay_steps: int | None = None
    """The update at which the decay reaches its floor (null: the run's updates, `steps x optim.mini_batches x
    optim.epochs`)."""
    weight_decay: float = 0.01
    """Decoupled weight decay, `p -= lr_t * weight_decay * p`, on every parameter."""
    max_grad_norm: float | None = 1.0
    """Clip the gradient's global norm to this (null: no clipping)."""
    b1: float = 0.9
    """AdamW's first-moment decay."""
    b2: float = 0.999
    """AdamW's second-moment decay."""
    eps: float = 1e-8
    """AdamW's epsilon in the denominator."""

    def __post_init__(self) -> None:
        if self.SECTION:
            check(self, self.SECTION)
        decay_ok = self.decay_steps is None or (isinstance(self.decay_steps, int) and self.decay_steps >= 1)
        checks = {
            "lr": (self.lr > 0, "must be positive"),
            "warmup_steps": (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0, "must be an int >= 0"),
            "schedule": (self.schedule in choices(LRSchedule), f"must be one of {choices(LRSchedule)}"),
            "min_lr_ratio": (0 <= self.min_lr_ratio <= 1, "must be in [0, 1]"),
            "decay_steps": (decay_ok, "must be a positive int or null (the optimizer's lifetime)"),
            "weight_decay": (self.weight_decay >= 0, "must be >= 0"),
            "max_grad_norm": (self.max_grad_norm is None or self.max_grad_norm > 0, "must be positive or null"),
            "b1": (0 <= self.b1 < 1, "must be in [0, 1)"),
            "b2": (0 <= self.b2 < 1, "must be in [0, 1)"),
            "eps": (self.eps > 0, "must be positive"),
        }
        check_fields(self, checks)

    def lasting(self, updates: int) -> AdamWConfig:
        """This config with a null ``decay_steps`` set to ``updates``, the optimizer's lifetime; a constant schedule,
        which reads no horizon, comes back as it is (the default programs keep their config)."""
        if self.decay_steps is not None or self.schedule == "constant":
            return self
        return dataclasses.replace(self, decay_steps=max(1, updates))


@dataclasses.dataclass(frozen=True)
class RLOptimConfig(AdamWConfig):
    """The RL update's optimizer: AdamW lr 1e-6 on the base (the paper's DAPO recipe).

    ``train``: what the update trains. ``full`` (default): the base's weights. ``lora``: a persistent policy adapter
    (its rank, alpha and targets in ``model.policy_lora``) beside a frozen base, which gets neither gradient nor
    optimizer state; the policy is base + adapter (``optim.py``); give it an adapter's rate (``lr`` about 10x to 100x
    a full update's: a rank-r update moves fewer weights further).

    ``mini_batches`` and ``epochs``: PPO-style updates per RL step, ``epochs`` passes over the step's rows in
    ``mini_batches`` shuffled mini-batches (default 1 and 1: the paper's one update). Each update's token-mean is
    over its own mini-batch's tokens (verl's convention); old log-probs stay those of the sampling policy, so from
    the second update on the clip acts on on-policy rows too. The warm-up counts updates, not steps.
    """

    SECTION: ClassVar[str] = "optim"

    lr: float = 1e-6
    """The base model's AdamW learning rate (the paper's DAPO recipe: 1e-6)."""
    mini_batches: int = 1
    """PPO-style: each epoch updates over the step's rows in this many shuffled mini-batches (the paper: 1)."""
    epochs: int = 1
    """PPO-style: passes over the step's rows per RL step (the paper: 1)."""
    train: PolicyTraining = "full"
    """What the RL update trains: the base (`full`), or a persistent policy adapter of shape `model.policy_lora` beside
    a frozen base (`lora`; give `optim.lr` an adapter's rate)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for field in ("mini_batches", "epochs"):
            if getattr(self, field) < 1:
                raise FieldError(type(self).__name__, field, "must be positive", getattr(self, field))


@dataclasses.dataclass(frozen=True)
class SFTOptimConfig(AdamWConfig):
    """The adapter's optimizer: AdamW lr 2.5e-5, re-initialised with every fresh adapter."""

    SECTION: ClassVar[str] = "scaffold.sft"

    lr: float = 2.5e-5
    """The adapter's AdamW learning rate (2.5e-5)."""
