"""The sections of a run's config that say what one step does: sample (``rollout``), score (``reward``), learn
(``loss``) and rescue its cliffs (``scaffold``). Frozen dataclasses, each checking its own fields; the checks that
read two sections are ``TrainConfig``'s."""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

from lspo_jax import options
from lspo_jax.optim_config import SFTOptimConfig
from lspo_jax.options import (
    AdapterLifetime,
    Correction,
    Estimator,
    FieldError,
    KLEstimator,
    KLPlacement,
    MixSchedule,
    Placement,
    RolloutEngine,
    SFTTokenWeight,
    Splice,
    Supervise,
    require,
    require_bound,
)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Sampling per step: ``prompts_per_step`` x ``group_size`` rollouts (the paper: 32 x 16, 8192 tokens).

    ``engine`` picks what samples the training rollouts (the step's rows and the scaffold's re-rolls):
    ``jax`` (our sampler) or ``vllm`` (one ``vllm_sampler.VLLMSampler`` per process, fed the current params
    before each call; ``vllm_kv_cache_gib`` is its CPU KV-cache space in whole GiB). Validation samples with
    the engine too when its context holds the call, else with our sampler; ``old_logp`` is always the
    trainer's own forward pass.
    ``compact_every`` (our sampler only): every this many decode steps the rows still running move into a
    smaller batch bucket when they fit one (``sampler.generate``); 0 never, which saves compiled programs where
    those dominate (a tiny model on a CPU).
    ``dynamic_sampling``: DAPO's dynamic sampling (``rl.rounds.DynamicSamplingPrompts``): groups whose rollouts all
    pass or all fail are dropped and more prompts sampled, at most ``max_draw_rounds`` sampling rounds a step
    (the first included); off as in the LSPO paper's runs.
    ``max_staleness``: 0 samples each step's rollouts from the base it updates; 1 samples the next step's rollouts
    in a thread while this step's update runs, from the base before it (one update old; ``rl.staleness``), so their
    update needs the decoupled objective: ``loss.tis_cap`` is required with it. The JAX engine and the default
    prompt order only (a source that samples its own rounds or learns from the update needs the update first).
    ``placement``: ``colocated`` samples on the devices that learn; ``split`` (with ``max_staleness: 1``) gives the
    last ``sampler_devices`` devices (null: half) to the sampling of each step's rollouts, on a mesh of their own,
    and the rest to the learner's mesh (``mesh`` sizes apply to it); the learner pushes the base to them after each
    update, device to device. Validation and the scaffold's re-rolls sample on the learner's devices.
    ``max_logprob_gap``: each step records ``rollout/logprob_gap``, the mean ``|sampler - trainer|`` log-prob of the
    tokens the base sampled; a run stops (a rollout error, after a checkpoint) once it is above this bound for
    ``max_logprob_gap_steps`` steps in a row (0: never), an engine that no longer samples the policy being trained
    (a weight sync that did not land). Null takes the bound of the engine and ``model.compute_dtype``
    (``LOGPROB_GAP_BOUNDS``).
    """

    # (engine, compute dtype) -> the default max_logprob_gap, nats a token. Measured: the JAX sampler against the
    # trainer on the tests' tiny Qwen2 (2 layers), 4 steps: float32 1.2e-7 to 1.7e-7 (one float32 rounding of
    # log-probs near 0), bfloat16 7e-4 to 1.2e-3. A deep model's bfloat16 gap grows with its depth and its logits'
    # size (bfloat16 keeps 8 bits: a logit of 20 rounds by up to 0.08), so its bound is set a decade above the tiny
    # model's; float32 keeps four decades of room. vLLM runs other kernels (its attention, fused sampling): its
    # float32 gap on a tiny Qwen2 is about 3e-5 (tests/test_vllm.py), and in bfloat16 a gap of a few 1e-2 is what
    # trainers report between vLLM and their own forward. An engine left with the weights of one update before
    # moves the gap by what that update moved the log-probs: detected when the updates are larger than the rounding.
    LOGPROB_GAP_BOUNDS: ClassVar[dict[tuple[str, str], float]] = {
        ("jax", "float32"): 1e-3, ("jax", "bfloat16"): 0.05, ("vllm", "float32"): 2e-3, ("vllm", "bfloat16"): 0.1,
    }  # fmt: skip

    prompts_per_step: int = 32
    """Prompts sampled per step (the paper: 32)."""
    group_size: int = 16
    """Rollouts per prompt, the group its advantages are normalised over (the paper: 16; more than 1)."""
    max_new_tokens: int = 8192
    """The longest response sampled, in tokens (the paper: 8192); the overlong penalty is measured against it."""
    temperature: float = 1.0
    """The sampling temperature of the training rollouts."""
    top_p: float = 1.0
    """The rollouts' nucleus: sample from the smallest set of tokens holding this much probability (1: no cut)."""
    top_k: int = 0
    """Sample from the k most likely tokens only (0: no cut)."""
    engine: RolloutEngine = "jax"
    """What samples the training rollouts and the scaffold's re-rolls: our JAX sampler or one vLLM engine per process
    (validation too, when the engine's context holds the call)."""
    vllm_kv_cache_gib: int = 1
    """The vLLM engine's CPU KV-cache space, in whole GiB."""
    compact_every: int = 16  # sampler.DEFAULT_COMPACT_EVERY
    """Our sampler moves the rows still running into a smaller batch bucket every this many decode steps (0: never)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups that all pass or all fail are dropped and more prompts sampled (off in the
    paper's runs)."""
    max_draw_rounds: int = 4
    """With dynamic sampling, the most sampling rounds a step, the first included."""
    max_staleness: int = 0
    """`0`: each step samples its rollouts from the base it updates. `1`: the next step's rollouts are sampled in a
    thread while this step's update runs, from the base before it (one update old; `lspo_jax.rl.staleness`), with the
    key an on-policy run gives them; the step right after a scheduled checkpoint samples its own, so a resumed run
    continues as if never stopped. Their update is decoupled PPO: `old_logp` the proximal base recomputed at the
    update's start, times `min(pi_proximal / pi_sampler, loss.tis_cap)`, so `loss.tis_cap` is required. JAX engine, one
    process, and the default prompt order only (not with `rollout.dynamic_sampling` or `l2rr.enabled`). Records
    `rollout/staleness`, `rollout/prefetch_s`, `rollout/overlap_s`, `rollout/overlap_share` and `rollout/push_s` (the
    seconds the copy of the base the rows were sampled from took to land)."""
    placement: Placement = "colocated"
    """Where rollouts sampled ahead are drawn. `colocated`: on the learner's devices, from a copy of the base beside it.
    `split` (needs `max_staleness: 1`): on the last `sampler_devices` devices, a mesh of their own (rows over every one,
    whole layers on each), the base pushed there device to device before each step's rollouts; the learner's mesh (the
    `mesh` sizes) spans the rest. The first step and the step after a scheduled checkpoint sample there too, on-policy.
    Validation and the scaffold's re-rolls (which need the adapter) sample on the learner's devices. A stop cuts the
    rollouts in flight short and redraws them: the resumed run samples that step on-policy. Not with `mesh.enabled:
    false`."""
    sampler_devices: int | None = None
    """With `placement: split`, the devices that sample (the last ones of `jax.devices()`); null: half, rounded down. At
    least one for each side; null with `colocated`."""
    max_logprob_gap: float | None = None
    """The bound on `rollout/logprob_gap`, the mean `|sampler - trainer|` log-prob of the sampled tokens, above which
    steps count towards a stop (null: the engine's and dtype's bound, `RolloutConfig.LOGPROB_GAP_BOUNDS`: JAX 1e-3 in
    float32 and 0.05 in bfloat16, vLLM 2e-3 and 0.1)."""
    max_logprob_gap_steps: int = 2
    """The run stops once the log-prob gap is above its bound for this many steps in a row (0: never): a checkpoint,
    then a rollout error and exit status 4 ([runs](runs.md#exit-codes))."""

    def logprob_gap_bound(self, compute_dtype: str) -> float | None:
        """The ``rollout/logprob_gap`` above which a step counts towards the stop; None: never stops."""
        if not self.max_logprob_gap_steps:
            return None
        if self.max_logprob_gap is not None:
            return self.max_logprob_gap
        return self.LOGPROB_GAP_BOUNDS[(self.engine, compute_dtype)]

    def __post_init__(self) -> None:
        options.check(self, "rollout")
        require(self.max_logprob_gap is None or self.max_logprob_gap > 0, "rollout.max_logprob_gap",
                "must be positive (nats a token) or null (the engine's and dtype's bound)",
                self.max_logprob_gap)  # fmt: skip
        require_bound(self, "rollout", "max_logprob_gap_steps", inclusive=True, why="0 never stops")
        require_bound(self, "rollout", "prompts_per_step")
        require(
            self.group_size > 1,
            "rollout.group_size",
            "must be > 1: advantages are normalised per group",
            self.group_size,
        )
        require_bound(self, "rollout", "max_new_tokens", "temperature")
        require(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]", self.top_p)
        require_bound(self, "rollout", "top_k", inclusive=True, why="0 disables it")
        require(
            self.vllm_kv_cache_gib > 0,
            "rollout.vllm_kv_cache_gib",
            "must be a positive number of GiB",
            self.vllm_kv_cache_gib,
        )
        require_bound(self, "rollout", "compact_every", inclusive=True, why="0 never compacts")
        require_bound(self, "rollout", "max_draw_rounds", low=1, inclusive=True, why="the first round included")
        require(self.max_staleness in (0, 1), "rollout.max_staleness", "must be 0 or 1", self.max_staleness)
        require_bound(self, "rollout", "sampler_devices", low=1, inclusive=True, null=True, why="half the devices")
        require(self.sampler_devices is None or self.placement == "split", "rollout.sampler_devices",
                "gives devices to the sampler with rollout.placement split only; set it to null or the placement "
                "to split", self.sampler_devices)  # fmt: skip
        # Split at 0, one side would always wait for the other: the devices apart are there to overlap.
        require(
            self.placement != "split" or self.max_staleness >= 1,
            "rollout.placement",
            "split samples the next step's rollouts while this step learns; set rollout.max_staleness: 1",
        )


BUILTIN_REWARD = "math_verify"  # ``reward.functions``' name of the built-in verifier


@dataclasses.dataclass(frozen=True)
class RewardFunctionConfig:
    """One entry of ``reward.functions``: ``fn`` is ``math_verify`` (the built-in verifier: 1.0 when the response's
    last ``\\boxed{}`` answer equals the row's gold answer), an importable ``package.module:function``, or a file's
    ``path/to/file.py:function`` (relative to the working directory). ``weight`` multiplies its score in the shaped
    reward; ``name`` (default: the function's own) names its mean in the records, ``reward/<name>``;
    ``correctness: true`` makes it the run's correctness signal (see ``RewardConfig``). The function is imported when
    the config is read, so a bad path is refused before anything loads."""

    fn: str
    weight: float = 1.0
    name: str | None = None
    correctness: bool = False

    def __post_init__(self) -> None:
        if self.name is None:
            object.__setattr__(self, "name", self.fn.rpartition(":")[2] or self.fn)
        if not self.name or not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise FieldError("RewardFunctionConfig", "name", "must be letters, digits, '_', '.' or '-'", self.name)
        if self.fn != BUILTIN_REWARD:
            try:
                options.load_function(self.fn)
            except options.PluginImportError as err:
                raise FieldError("RewardFunctionConfig", "fn", str(err), self.fn) from None


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """How rollouts are scored: math-verify in ``workers`` processes with a hard per-item timeout, the reward
    functions, and DAPO's overlong shaping.

    ``functions`` (empty: the built-in verifier alone, weight 1) lists the reward functions; each rollout's shaped
    reward, from which advantages are computed, is ``sum_i weight_i * f_i(response) + overlong penalty``. A function
    is called as TRL calls its reward functions, ``fn(completions, **columns) -> list[float]``: ``completions`` the
    response texts, and one list per row field, aligned with them: ``answer`` (the gold), ``problem``, ``solution``
    (None where the row has none), ``id``, and every other column of the data file. It is called one completion at a
    time in the verifier's worker processes (``workers``; 0: in this process), with ``timeout_s`` a call: a call that
    raises, hangs past the timeout or returns no finite number scores 0 for that rollout, is counted in
    ``reward/<name>_failed`` and said once; the run goes on. None scores 0 and is not a failure (TRL's "does not
    apply").

    **Which rollouts are successes** (cliffs, the scaffold's verified re-rolls, dynamic sampling, the first-mistake
    judge's failed rows, the records' ``accuracy_mean``): a binary correctness signal, never the shaped sum. It is the
    built-in verifier's 0/1 unless one function says ``correctness: true``, whose score >= 0.5 then counts as correct.
    The verifier runs for it even when ``functions`` leaves it out of the reward. Validation's pass@k scores the
    benchmarks with the built-in verifier.
    """

    overlong_buffer: int = 1024
    """DAPO's overlong shaping: the penalty starts this many tokens before `rollout.max_new_tokens`."""
    overlong_factor: float = 1.0
    """The overlong penalty at `rollout.max_new_tokens`, falling linearly from 0 over the buffer (0: no shaping)."""
    require_think_close: bool = False
    """Grade only the text after the last `</think>`; a response without one scores 0."""
    workers: int = 2
    """math-verify's worker processes (0: scored in-process)."""
    timeout_s: float = 5.0
    """The hard timeout of one verification, in seconds."""
    functions: tuple[RewardFunctionConfig, ...] = ()
    """The terms of the shaped reward, each `{fn, weight, name, correctness}`: `sum weight * fn(completions, **columns)`
    plus the overlong penalty (empty: the built-in verifier alone, weight 1); see
    [methods](methods.md#rewards-your-own-functions-beside-the-verifier)."""

    def __post_init__(self) -> None:
        names = [f.name for f in self.functions]
        twice = sorted({name for name in names if names.count(name) > 1})
        require(not twice, "reward.functions", f"two functions are named {twice[0] if twice else ''}; give each its "
                "own name")  # fmt: skip
        judges = [f.name for f in self.functions if f.correctness]
        require(len(judges) <= 1, "reward.functions", f"at most one function may be the correctness signal, got "
                f"{judges}")  # fmt: skip
        require_bound(self, "reward", "overlong_buffer", "timeout_s")
        require_bound(self, "reward", "workers", inclusive=True, why="0 scores in-process")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The clipped surrogate: clip-higher ``eps_low``/``eps_high``, optional dual clip ``clip_c``; ``advantage`` is
    the group baseline (``losses.group_advantages``'s estimator: ``std``, ``mean_only`` or ``loo``).

    GRPO's usual additions, off by default as in DAPO. ``kl_coef`` > 0 penalises the KL divergence from a frozen
    reference policy: ``kl_reference`` (null: the base the run loaded from ``model.path``; or a Hugging Face
    directory of the same architecture), whose log-probs of the rows are computed beside the old ones, in the same
    pass and at the rollout temperature. ``kl_in: loss`` adds ``kl_coef`` times the token-mean of ``kl_estimator``
    (``k3``: ``r - 1 - log r``, ``k1``: ``-log r``, ``k2``: ``(log r)^2 / 2``, ``log r = logp_ref - logp``;
    ``losses.KL_ESTIMATORS``) to the loss, differentiated (verl's use_kl_loss, TRL's beta); ``kl_in: reward``
    subtracts ``kl_coef`` times each row's summed k1 from its shaped reward before the advantages, detached (verl's
    use_kl_in_reward; ``kl_estimator`` is not read). The record's ``kl_ref`` is the penalty's token-mean. The
    reference's params stay on the devices, in bfloat16 when ``model.compute_dtype`` is (the forward casts to it
    anyway), else in the base's dtype. ``entropy_coef`` > 0 subtracts that times the token-mean entropy of the
    sampling distribution (``softmax(logits / temperature)``) over the response tokens from the loss,
    differentiated (an entropy bonus).
    """

    advantage: Estimator = "std"
    """The group baseline: `std` ((r - mean) / std, GRPO), `mean_only` (r - mean) or `loo` (leave-one-out, RLOO)."""
    eps_low: float = 0.2
    """The clipped surrogate's lower clip: the ratio's floor is `1 - eps_low`."""
    eps_high: float = 0.28
    """The upper clip, `1 + eps_high` (clip-higher: at least `loss.eps_low`)."""
    clip_c: float | None = None
    """Dual clip: a negative-advantage token's loss is at most `clip_c * abs(A)` (more than 1; null: off)."""
    micro_batches: int = 1
    """The update's rows are split into this many micro-batches whose gradients are accumulated, to bound memory."""
    chunk_size: int | None = None
    """Run the LM head over this many positions at a time, so the `[rows, length, vocab]` logits are never whole (null:
    at once)."""
    # The update, the log-prob passes and the SFT step run over token buffers (packing.pack_rows) that hold the
    # rows' real tokens only, several sequences to a buffer row; false runs the padded [B * K, P + R] rows.
    packing: bool = True
    """Run the update, log-prob passes and SFT over packed buffers of the rows' real tokens; false runs the padded rows.
    """
    tis_cap: float | None = None
    """Truncated importance sampling against the sampling engine's numerics: each token's loss times `min(exp(old_logp -
    sampler_logp), tis_cap)` (null: off)."""
    kl_coef: float = 0.0
    """The KL penalty to a frozen reference policy (`loss.kl_reference`), times this (0: off, as in DAPO). Records
    `kl_ref`, the penalty's token-mean."""
    kl_estimator: KLEstimator = "k3"
    """With `loss.kl_in: loss`, Schulman's estimator of KL(pi_theta || pi_ref) per token, `log r = logp_ref - logp`:
    `k3` `r - 1 - log r`, `k1` `-log r`, `k2` `(log r)^2 / 2`."""
    kl_in: KLPlacement = "loss"
    """`loss`: `kl_coef` times the estimator's token-mean added to the loss, differentiated (verl's use_kl_loss, TRL's
    beta); `reward`: `kl_coef` times each row's summed k1 subtracted from its reward before the advantages, detached
    (verl's use_kl_in_reward)."""
    kl_reference: str | None = None
    """The KL penalty's reference: a Hugging Face directory of the policy's architecture (null: the base the run loaded
    from `model.path`, a resumed run's too). Held on the devices, in bfloat16 when the model computes in it."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss minus this times the token-mean entropy of the sampling distribution over the response
    tokens, differentiated (0: off)."""

    def __post_init__(self) -> None:
        options.check(self, "loss")
        require_bound(self, "loss", "kl_coef", inclusive=True, why="0: no KL penalty")
        require_bound(self, "loss", "entropy_coef", inclusive=True, why="0: no entropy bonus")
        require(self.kl_reference is None or bool(self.kl_reference.strip()), "loss.kl_reference",
                "must be a Hugging Face directory or null (the base the run loaded)", self.kl_reference)  # fmt: skip
        require(self.kl_reference is None or self.kl_coef > 0, "loss.kl_reference", "names the KL penalty's "
                "reference, which is off (loss.kl_coef: 0); set loss.kl_coef or leave it null")  # fmt: skip
        require_bound(self, "loss", "chunk_size", "tis_cap", null=True)
        require(0 <= self.eps_low < 1, "loss.eps_low", "must be in [0, 1)", self.eps_low)
        require_bound(self, "loss", "eps_high", inclusive=True)
        # Clip-higher widens the upper side (DAPO: 0.2 / 0.28); a narrower one is a swapped pair.
        pair = f"eps_high {self.eps_high} < eps_low {self.eps_low}"
        require(self.eps_high >= self.eps_low, "loss.eps_high", f"must be >= loss.eps_low (clip-higher), got {pair}")
        require_bound(self, "loss", "clip_c", low=1, null=True)
        require_bound(self, "loss", "micro_batches")

    @property
    def kl_loss_coef(self) -> float:
        """The KL term's coefficient in the policy loss: ``kl_coef`` with ``kl_in: loss``, else 0."""
        return self.kl_coef if self.kl_in == "loss" else 0.0

    @property
    def kl_reward_coef(self) -> float:
        """The KL penalty's coefficient on the rewards: ``kl_coef`` with ``kl_in: reward``, else 0."""
        return self.kl_coef if self.kl_in == "reward" else 0.0


# The supervisions that read ``scaffold.warmup_tokens``: SFT then DAPO, and SFT then LSPO.
WARMED = ("sft_warmup", "adapter")


@dataclasses.dataclass(frozen=True)
class ScaffoldConfig:
    """LSPO's scaffold; ``enabled: false`` gives the DAPO baseline arm. The defaults are the paper's method.

    ``splice``: ``partial`` | ``group`` | ``keep_failed`` (``scaffold.SPLICE_VARIANTS``). Spliced rows' ``correction``:
    ``token`` (per-token ratio over the adapter-on log-prob), ``sequence`` (ratio over the base's own old log-prob
    times the detached row weight ``min(prod_t pi_theta_old / pi_mu, is_cap)``), ``floor`` (the per-token ratio
    clipped from below at ``ratio_floor``), ``shaped`` (LUFFY's ``pi / (pi + shaping_gamma)`` in place of the
    ratio), ``guide`` (Guide-GRPO's ``rho / (rho + gamma)``, gamma the ``guide_percentile`` quantile of the spliced
    tokens' ratios), ``none`` (treated as on-policy); see ``corrections.importance_weights``. ``reroll_n`` re-rolls
    per cliff (null: group_size), sampled at ``reroll_temperature`` (null: the rollout's) with the adapter at
    ``reroll_scale``; the denominators follow both. ``reroll_scale: 0`` is the compute-matched control: no adapter
    is fitted and each cliff is re-rolled by the base itself, so its rescued rows are extra samples (on-policy at
    the rollout's temperature) and what LSPO gains over it is the adapter's, not that of drawing more.
    ``grad_share`` logs the ratio of the spliced rows' gradient norm to the update's, at the cost of one more
    gradient pass a scaffolded step. ``cliff_max_successes``: groups with at most this many passing rows are
    cliffs. ``adapter``: ``fresh`` (reset every step: A random, B zero, a new SFT state; the paper) or
    ``persistent`` (kept and fitted further across steps with its own SFT state, reset every ``reset_every``
    steps when set; checkpointed with the run). ``supervise: base`` is the direct-supervision control: the
    cliffs' worked solutions train the base itself, the same rows and ``sft_steps`` as the adapter would get, with
    the SFT loss and a fresh AdamW state at the RL optimizer's rate (``optim.lr``, no warm-up), and nothing is
    re-rolled or spliced; it breaks the routing rule on purpose (interleaved SFT, as in ReLIFT).

    Two more arms of the field supervise the base with the worked solutions, nothing re-rolled and no adapter.
    ``supervise: mixed`` is CHORD's mixed objective: the base's one update of a step minimises
    ``L_RL + mu_t * L_SFT`` (``losses.mixed_loss``), L_SFT the token-mean NLL of the step's cliffs' solutions
    (``scaffold.mix_token_weight: p1mp`` weighs each token by its detached ``p (1 - p)``, CHORD-phi), ``mu_t``
    ``mix_mu`` decayed by ``mix_schedule`` (``cosine``: ``mix_mu * (1 + cos(pi t / steps)) / 2`` at the step that
    follows t done, over the ``steps`` of the config in force; ``constant``); a step without cliffs adds nothing.
    ``supervise: sft_warmup`` is SFT then RL: before its first step the base is fine-tuned on the training set's
    solutions for ``warmup_tokens`` solution tokens (``rl.warmup``; required by this arm), then every step is DAPO's;
    it needs the scaffold on (``enabled: false`` with it is refused, not run as plain DAPO). ``warmup_tokens`` with
    ``supervise: adapter`` is SFT then LSPO: the same warm-up, then every step scaffolded (refused by ``base`` and
    ``mixed``, which supervise the base through the run already).
    To match the direct control's budget, set ``warmup_tokens`` to the sum of its records' ``scaffold/sft_tokens``
    over a run (or their mean per step times ``steps``).
    """

    enabled: bool = True
    """Run LSPO's scaffold; false is the DAPO baseline arm."""
    supervise: Supervise = "adapter"
    """What the worked solutions train: the `adapter`, which re-rolls the cliffs (LSPO); the `base` itself, `sft_steps`
    SFT steps on the cliffs' solutions before the RL update (the direct-supervision control, recording
    `scaffold/sft_tokens`); the base through `mixed`, CHORD's objective L_RL + mu_t * L_SFT of the cliffs' solutions in
    the RL update itself; or the base once before RL, `sft_warmup` (SFT then DAPO, `warmup_tokens`). Nothing is
    re-rolled in the last three."""
    sft_steps: int = 4
    """SFT steps on the cliffs' worked solutions per scaffolded step."""
    sft: SFTOptimConfig = dataclasses.field(
        default_factory=SFTOptimConfig,
        # The adapter's optimizer: what the keys of ``AdamWConfig`` (whose docstrings say them for ``optim``) mean
        # here (its own ``lr`` says itself).
        metadata={"meanings": {
            "warmup_steps": (
                "Linear warm-up of the adapter's rate over this many SFT steps (0: none), before "
                "`scaffold.sft.schedule`."
            ),
            "schedule": (
                "The adapter's rate after its warm-up: `constant`, `cosine` or `linear` (as "
                "`optim.schedule`)."
            ),
            "min_lr_ratio": "The adapter's decayed rate's floor as a share of `scaffold.sft.lr`, in [0, 1].",
            "decay_steps": (
                "The SFT step at which the adapter's decay reaches its floor (null: `scaffold.sft_steps`, "
                "a fresh adapter's optimizer's lifetime)."
            ),
            "weight_decay": "Decoupled weight decay of the adapter's parameters.",
            "max_grad_norm": "Clip the adapter's gradient global norm to this (null: no clipping).",
            "b1": "The adapter's AdamW first-moment decay.",
            "b2": "The adapter's AdamW second-moment decay.",
            "eps": "The adapter's AdamW epsilon.",
        }},
    )  # fmt: skip
    splice: Splice = "partial"
    """How a cliff's verified re-rolls enter its group: replace failed rows up to a share (`partial`, the paper's), the
    whole `group`, or append them (`keep_failed`)."""
    correction: Correction = "token"
    """The correction of spliced rows for being sampled with the adapter on (`corrections.importance_weights`; `none`:
    treated as on-policy)."""
    is_cap: float = 1.0
    """With `correction: sequence`, the cap of the detached row weight `min(prod_t pi_theta_old / pi_mu, is_cap)`."""
    ratio_floor: float = 0.2
    """With `correction: floor`, the per-token ratio is clipped from below here (in (0, 1])."""
    shaping_gamma: float = 0.1
    """With `correction: shaped`, LUFFY's `pi / (pi + shaping_gamma)` takes the ratio's place."""
    guide_percentile: float = 0.9
    """With `correction: guide`, the quantile of the spliced tokens' ratios pi_theta / pi_mu taken as Guide-GRPO's gamma
    in rho / (rho + gamma)."""
    mix_mu: float = 0.1
    """With `supervise: mixed`, the weight mu of the SFT term at the first step (CHORD's 0.1); `mix_schedule` takes it
    on from there. The step records `scaffold/mix_mu`, `scaffold/mix_sft_loss` and `scaffold/mix_sft_tokens`."""
    mix_schedule: MixSchedule = "cosine"
    """With `supervise: mixed`, mu over the run: `cosine`, mix_mu * (1 + cos(pi t / steps)) / 2 at the step after t done
    (0 at the end), or `constant`."""
    mix_token_weight: SFTTokenWeight = "none"
    """With `supervise: mixed`, the SFT tokens' weights: `none` (the token-mean NLL) or `p1mp`, each token's NLL times
    its detached p (1 - p) (CHORD-phi)."""
    warmup_tokens: int | None = None
    """The solution tokens of an SFT warm-up of the base before the first step: required by `supervise: sft_warmup` (SFT
    then DAPO), optional with `adapter` (SFT then LSPO), refused by `base` and `mixed`; to match the direct control, the
    sum of its records' `scaffold/sft_tokens` over a run (or their mean per step times `steps`)."""
    grad_share: bool = False
    """Log the spliced rows' share of the update's gradient norm, at one more gradient pass a scaffolded step."""
    reroll_n: int | None = None
    """Re-rolls per cliff (null: `rollout.group_size`)."""
    reroll_temperature: float | None = None
    """The re-rolls' sampling temperature (null: `rollout.temperature`)."""
    reroll_scale: float = 1.0
    """The adapter's scale while re-rolling; 0 is the compute-matched control, re-rolled by the base itself with no
    adapter fitted."""
    cliff_max_successes: int = 0
    """Groups with at most this many passing rows are cliffs."""
    adapter: AdapterLifetime = "fresh"
    """The adapter's lifetime: `fresh` every step (the paper) or `persistent`, fitted further across steps and
    checkpointed."""
    reset_every: int | None = None
    """Reset a persistent adapter every this many steps (null: never after its first use)."""
    # The SFT, re-roll and log-prob batches hold at least this many cliff prompts (padding repeats one):
    # set it to rollout.prompts_per_step to compile one program per phase, where compiling costs more
    # than the padded compute (small models on CPU). 1 sizes them by the cliff count (power-of-two buckets).
    min_cliff_bucket: int = 1
    """The SFT, re-roll and log-prob batches hold at least this many cliff prompts; `rollout.prompts_per_step` compiles
    one program per phase."""

    def __post_init__(self) -> None:
        options.check(self, "scaffold")
        require(self.supervise == "adapter" or self.adapter == "fresh", "scaffold.supervise",
                 f"{self.supervise} fits no adapter, so none is kept (scaffold.adapter: persistent)")  # fmt: skip
        require_bound(self, "scaffold", "mix_mu", "reroll_scale", "cliff_max_successes", inclusive=True)
        require_bound(self, "scaffold", "warmup_tokens", "reroll_n", "reroll_temperature", "reset_every", null=True)
        require(not (self.enabled and self.supervise == "sft_warmup") or self.warmup_tokens is not None,
                 "scaffold.warmup_tokens", "sft_warmup needs its SFT budget in solution tokens: set it, e.g. to the "
                 "direct arm's (supervise: base) scaffold/sft_tokens summed over a run")  # fmt: skip
        # Accepted and ignored, either would run another arm than the one named, without a word.
        require(self.warmup_tokens is None or self.supervise in WARMED, "scaffold.warmup_tokens",
                f"is read by scaffold.supervise: {' or '.join(WARMED)} only (it is {self.supervise}); remove it or set "
                "the supervision", self.warmup_tokens)  # fmt: skip
        require(self.enabled or self.supervise != "sft_warmup", "scaffold.supervise",
                "sft_warmup runs with the scaffold on, and scaffold.enabled is false (a plain DAPO run, no "
                "warm-up); set scaffold.enabled: true")  # fmt: skip
        require_bound(self, "scaffold", "sft_steps", "min_cliff_bucket", "is_cap", "shaping_gamma")
        # Above 1 the floor would lift the ratio of tokens the adapter made less likely, past the clip at 1 + eps_high.
        require(0 < self.ratio_floor <= 1, "scaffold.ratio_floor", "must be in (0, 1]", self.ratio_floor)
        require(0 < self.guide_percentile <= 1, "scaffold.guide_percentile", "must be in (0, 1]",
                 self.guide_percentile)  # fmt: skip
        require(
            self.reset_every is None or options.ADAPTER_LIFETIMES.resolve(self.adapter).scheduled,
            "scaffold.reset_every",
            "resets a persistent adapter; a fresh one is reset every step (set scaffold.adapter: persistent)",
        )

    @property
    def uses_cliffs(self) -> bool:
        """Whether the steps act on their cliffs' worked solutions: the scaffold on, and not the SFT warm-up, whose
        steps are DAPO's (a draw then keeps no cliff for it)."""
        return self.enabled and self.supervise != "sft_warmup"
