"""L2RR's section of a run's config, ``l2rr``, and its sizing from the run's (composed by ``job.config``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from lspo_jax import options
from lspo_jax.options import positive_int, require

# The scores' normalisation, the target loss, and how a prompt's loss is averaged.
Normalisation = Literal["std", "max_abs", "none"]
TargetLoss = Literal["nll_token_mean", "nll_example_mean"]
PromptLossNorm = Literal["prompt", "batch"]


@dataclasses.dataclass(frozen=True)
class L2RRConfig:
    """L2RR's settings (see the package's docstring for the method); ``enabled: false`` samples uniformly.

    ``a``: EG step scale, ``eta = a / sqrt(horizon)`` (``horizon`` None: ``a / sqrt(t)`` at the t-th update).
    ``rho_min``: the smallest budget fraction. ``g_min``: the fewest rollouts a drawn prompt gets (>= 2: one
    rollout has no variance). ``p_e``: the waste decay. ``waste_weight``: the penalty's weight beside the
    target signal. ``normalise``, ``target_loss``, ``prompt_loss_norm``: as in ``draws``' docstring.
    ``alloc_power``: the exponent of ``w`` in the allocation (3/2). ``explore``: the uniform share of the
    draw distribution. ``max_draw_rounds``: draw rounds per step. ``score_micro_batches`` and
    ``target_micro_batches``: chunks of prompts (rows) for the jvp and the target gradient; null (the default)
    sizes each chunk to the tokens of one micro-batch of the padded update (``score_micro_batches`` and
    ``target_micro_batches`` below), so their memory follows ``loss.micro_batches`` at any row length. ``top_k``:
    the top-weighted prompts reported by ``metrics``. ``target``: the held-out target set (a data file or a
    benchmark name, as in ``eval.benchmarks``; ``toy:target`` for the demo task), its first
    ``target_limit`` examples with worked solutions. ``lookahead`` (the method's own): ``g_tgt`` is taken at the
    base after the step's update (t + 1) and each ``g_i`` at the base that sampled; false takes both before the
    update. The look-ahead holds a second copy of the base during the update.
    """

    enabled: bool = False
    """Draw prompts with L2RR; false samples uniformly."""
    target: str | None = None
    """The held-out target set: a data file or a benchmark name as in `eval.benchmarks` (`toy:target` for the demo
    task); needed when enabled."""
    target_limit: int | None = 64
    """The target set's first this many examples with worked solutions (null: all)."""
    a: float = 1.0
    """The EG step scale: `eta = a / sqrt(horizon)`."""
    horizon: int | None = None
    """The horizon of the EG step size (null: `a / sqrt(t)` at the t-th update)."""
    rho_min: float = 0.25
    """The smallest budget fraction."""
    g_min: int = 2
    """The fewest rollouts a drawn prompt gets (at least 2: one rollout has no variance)."""
    p_e: float = 0.5
    """The waste decay."""
    waste_weight: float = 1.0
    """The waste penalty's weight beside the target signal."""
    normalise: Normalisation = "std"
    """How the prompts' scores are divided by their spread over the batch: population `std`, `max_abs` (signals in [-1,
    1]) or `none`."""
    target_loss: TargetLoss = "nll_token_mean"
    """The target set's NLL: one token-mean over all its tokens, or the mean over examples of each one's token-mean."""
    prompt_loss_norm: PromptLossNorm = "prompt"
    """A prompt's policy loss as a token-mean over its own response tokens (`prompt`) or over the batch's (`batch`)."""
    alloc_power: float = 1.5
    """The exponent of `w` in the rollout allocation (3/2)."""
    explore: float = 0.0
    """The uniform share of the draw distribution."""
    max_draw_rounds: int = 4
    """Draw rounds per step; groups without a signal are dropped and more drawn."""
    lookahead: bool = True
    """Take the target gradient at the base after the step's update (t + 1), holding a second copy of the base; false
    takes both gradients before it."""
    score_micro_batches: int | None = None
    """Chunks of prompts for the scores' jvp (null: sized to one micro-batch of the padded update's tokens)."""
    target_micro_batches: int | None = None
    """Chunks of target rows for the target gradient (null: sized to one micro-batch of the padded update's tokens)."""
    top_k: int = 5
    """The top-weighted prompts reported in the metrics."""

    def __post_init__(self) -> None:
        options.check(self, "l2rr")
        null_or_positive = lambda value: value is None or positive_int(value)
        checks = {
            "a": (self.a > 0, "must be positive"),
            "horizon": (null_or_positive(self.horizon), "must be None or a positive int"),
            "rho_min": (0 < self.rho_min <= 1, "must be in (0, 1]"),
            "g_min": (isinstance(self.g_min, int) and self.g_min >= 2, "must be an int >= 2"),
            "p_e": (0 <= self.p_e <= 1, "must be in [0, 1]"),
            "waste_weight": (self.waste_weight >= 0, "must be >= 0"),
            "alloc_power": (self.alloc_power >= 0, "must be >= 0"),
            "explore": (0 <= self.explore < 1, "must be in [0, 1)"),
            "max_draw_rounds": (positive_int(self.max_draw_rounds), "must be a positive int"),
            "score_micro_batches": (null_or_positive(self.score_micro_batches), "must be null or a positive int"),
            "target_micro_batches": (null_or_positive(self.target_micro_batches), "must be null or a positive int"),
            "top_k": (isinstance(self.top_k, int) and self.top_k >= 0, "must be an int >= 0"),
            "target_limit": (null_or_positive(self.target_limit), "must be None or > 0"),
        }
        options.check_fields(self, checks)

    def step_size(self, updates_done: int) -> float:
        """``eta = a / sqrt(T)``: T the horizon, or the number of this update (1, 2, ...) without one."""
        return self.a / math.sqrt(self.horizon if self.horizon is not None else updates_done + 1)


def check_run(run: Any) -> None:
    """The checks of ``run.l2rr`` against the run's other sections (a ``ConfigError`` naming the key)."""
    l2rr, rollout = run.l2rr, run.rollout
    require(l2rr.g_min <= rollout.group_size, "l2rr.g_min", f"must not exceed rollout.group_size {rollout.group_size}",
            l2rr.g_min)  # fmt: skip
    require(not l2rr.enabled or bool(l2rr.target), "l2rr.target", "must name the target set")
    require(not (rollout.dynamic_sampling and l2rr.enabled), "rollout.dynamic_sampling",
            "and l2rr.enabled both draw the step's rounds; L2RR already drops groups without a signal "
            "(l2rr.max_draw_rounds): turn one off")  # fmt: skip
    require(not (rollout.max_staleness and l2rr.enabled), "rollout.max_staleness",
            f"{rollout.max_staleness} and l2rr.enabled: L2RR draws a step's prompts from what the update before it "
            "taught its sampler; turn one off")  # fmt: skip


def score_micro_batches(run: Any) -> int:
    """``run.l2rr.score_micro_batches``, or (null) the fewest chunks of whole groups that split the step's prompts
    evenly with no chunk holding more rows than a micro-batch of the padded update (the rows are as long)."""
    prompts, group, rows = run.rollout.prompts_per_step, run.rollout.group_size, run.update_rows_per_micro()
    fits = lambda m: prompts % m == 0 and (prompts // m) * group <= max(rows, group)
    return run.l2rr.score_micro_batches or next(m for m in range(1, prompts + 1) if fits(m))


def target_micro_batches(run: Any, target_rows: int) -> int:
    """``l2rr.target_micro_batches``, or (null) as many as keep each chunk of the ``target_rows`` rows of
    ``max_prompt_tokens + max_solution_tokens`` slots within a micro-batch of the padded update's tokens."""
    data = run.data
    slots = run.update_rows_per_micro() * (data.max_prompt_tokens + run.rollout.max_new_tokens)
    per_micro = max(1, slots // (data.max_prompt_tokens + data.max_solution_tokens))
    return run.l2rr.target_micro_batches or -(-max(1, target_rows) // per_micro)
