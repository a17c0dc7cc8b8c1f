"""The configuration of a training run: frozen dataclasses, read from YAML with dotted overrides.

A YAML file only serialises ``TrainConfig``. Reading is strict: an unknown key, a key given twice, a value of the
wrong type or a float that is not finite is an error that names the dotted key (``rollout.group_size: expected
int, got 'sixteen'``). The DAPO baseline is the same config with ``scaffold.enabled: false``, not a separate code
path.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, ClassVar

import yaml

from lspo_jax import options
from lspo_jax.config import LoraConfig
from lspo_jax.options import (
    AdapterLifetime,
    Attention,
    ComputeDtype,
    ConfigError,
    Correction,
    DataFormat,
    DecodeAttention,
    Estimator,
    FieldError,
    InstructionPosition,
    KLEstimator,
    KLPlacement,
    LengthPolicy,
    MixSchedule,
    Placement,
    PromptTemplate,
    ProtocolName,
    Remat,
    RLOptimConfig,
    RolloutEngine,
    SFTOptimConfig,
    SFTTokenWeight,
    SolutionField,
    Splice,
    Supervise,
    WandbMode,
)


def require(ok: bool, key: str, message: str, *value: Any) -> None:
    """A ``ConfigError`` in the config's one dialect unless ``ok``: ``key: what is allowed, got value`` (the value
    left out where the message says it, or where no one value is at fault)."""
    if not ok:
        raise ConfigError(f"{key}: {message}" + (f", got {value[0]!r}" if value else ""))


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """The policy: a local Hugging Face directory (``path``), or a hub name (``ORG/NAME[@REVISION]``, e.g.
    ``deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B``: fetched once into the Hugging Face cache and read from it
    afterwards, ``lspo_jax.hub``); ``path: toy`` is the demo's own model.

    ``remat`` rematerialises the layer scan in the backward pass (none, full, dots): with ``dots`` and a kernel
    that holds no ``[T, T]`` scores the paper's shape fits 8 H100s (``tools/lower_check.py --compile``; with
    ``einsum`` it needs ``full``). ``attention`` is the kernel of
    the training and log-prob passes: ``einsum``, ``xla``, ``cudnn`` (fused, on a CUDA GPU with bf16) or
    ``blocked`` (pure JAX, flash-style: no ``[T, T]`` scores on any backend). ``decode_attention`` is the JAX
    sampler's decode step over the KV cache: ``reduce`` (default), ``einsum``, ``xla`` or ``pallas`` (GPU).

    ``lora`` is the shape of the scaffold's transient adapter (rank, alpha, targets); ``policy_lora`` that of LoRA RL's
    persistent policy adapter (``optim.train: lora``; unused otherwise), beside it because both are parts of the
    model's forward pass (``model.decoder`` stacks them) and their optimizers live in ``optim`` and ``scaffold.sft``.
    ``param_dtype`` stores the base's weights: ``float32`` (default), or ``bfloat16`` for a frozen base
    (``optim.train: lora`` only: half the memory; the adapters stay float32).
    """

    path: str = "toy"
    param_dtype: ComputeDtype = "float32"
    compute_dtype: ComputeDtype = "float32"
    remat: Remat = "none"
    attention: Attention = "einsum"
    decode_attention: DecodeAttention = "reduce"
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    policy_lora: LoraConfig = dataclasses.field(default_factory=lambda: LoraConfig(rank=32, alpha=64.0))

    def __post_init__(self) -> None:
        options.check(self, "model")
        require(bool(self.path), "model.path", "must name a Hugging Face directory, ORG/NAME or 'toy'", self.path)
        if self.attention == "cudnn":
            require(self.compute_dtype == "bfloat16", "model.attention", "cudnn needs model.compute_dtype: bfloat16")


R1_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclasses.dataclass(frozen=True)
class DataFields:
    """``data.fields``: the column each role of a row is read from, where a file names it otherwise than its format
    (``{problem: question, answer: gold, solution: worked, id: uid}``); null keeps the format's column. A section
    rather than a free mapping: its keys are the roles, so a misspelt one is refused by name, and it stays hashable.
    """

    KEY_NAME: ClassVar[str] = "role"  # what ``from_dict``'s errors call a key of this section

    problem: str | None = None
    answer: str | None = None
    solution: str | None = None
    id: str | None = None

    def __post_init__(self) -> None:
        named = {}
        for role, column in dataclasses.asdict(self).items():
            require(column is None or bool(column.strip()), f"data.fields.{role}", "must name a column or be null",
                    column)  # fmt: skip
            require(column not in named, f"data.fields.{role}", f"is also data.fields.{named.get(column)}'s column; a "
                    "column holds one role", column)  # fmt: skip
            if column is not None:
                named[column] = role


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Training prompts: a file or directory of rows, a hub dataset (``ORG/NAME[@REVISION][:PART]``, e.g.
    ``zwhe99/DeepMath-103K``: fetched once into the Hugging Face cache, ``lspo_jax.hub``), or ``toy:addition``.

    ``format`` says how rows are read: ``shared`` (``problem, answer``, and ``id, solution, source, meta`` where
    given: the packaged benchmarks' schema, which the hub's MATH-500 and AIME files also read as), ``deepmath``
    (DeepMath-103K: ``question, final_answer, difficulty, topic, r1_solution_1..3``; ``solution_field`` names the
    trace the scaffold learns from), or ``auto`` (told apart by the fields of each file: ``shared`` where a file has
    ``problem`` or the column ``fields.problem`` names, else ``deepmath`` where it has ``question``). Files are JSONL,
    parquet or a JSON array; a directory is read file by file.

    ``fields`` (``DataFields``) maps the roles ``problem, answer, solution, id`` to a file's own column names, e.g.
    ``{problem: question, answer: gold, solution: worked, id: uid}``; a role left out keeps its format's column, and
    a row without the named column is read from its format's (the packaged benchmarks, in the shared schema, read
    as before). A row missing its problem or answer is counted and listed by the column's name. The row's other
    columns travel with it as ``Example.fields``, which the reward functions receive (DeepMath's unused traces are
    left out). The solution column (``fields.solution``, else ``solution``, or ``solution_field`` in ``deepmath``)
    holds the worked solutions the scaffold learns from: a cliff's adapter is fitted on them before it re-rolls the
    cliff. A source with no solution in any row rescues no cliff, which the run says in one line; it then behaves as
    DAPO on them.

    Each problem is sent as one user turn: ``instruction`` is placed ``after`` or ``before`` the problem
    (joined by a newline), or left out (``none``). ``system_prompt`` (null: none) is a system turn before it.
    ``template`` renders the turns: ``tokenizer``, the tokenizer's chat template with its generation prompt (a
    tokenizer without one renders ``plain``; a template that drops the system turn is refused); ``r1``,
    DeepSeek-R1-Distill's ``<｜begin▁of▁sentence｜>{system_prompt}<｜User｜>{text}<｜Assistant｜><think>`` and a
    newline, written out by the project for any tokenizer that has those tokens, the system prompt right after BOS
    as R1's own template puts it; ``plain``, no chat markup: BOS (when the tokenizer has one), the system prompt
    and a newline (when set), then the text. docs/getting-started.md shows one row rendered by each. Validation
    prompts (``eval.benchmarks``) are rendered the same way; generated tasks (``toy:``) keep their own format: no
    instruction, no system prompt, the tokenizer's template.

    Prompts longer than ``max_prompt_tokens`` and solutions longer than ``max_solution_tokens`` follow
    their policy, ``skip`` or ``truncate``, and are counted (a prompt's length is that of the rendered prompt,
    template, system prompt and instruction included). A truncated solution gets no EOS unless
    ``eos_after_truncated``: the adapter should not learn to stop mid-thought. Rows without a solution are
    counted and never used by the scaffold; rows lacking a required field are counted, listed and skipped.
    ``limit`` keeps the first that many usable prompts (null: all).

    ``cache_dir``: where a file's encoded prompts are kept between runs (``example_store``): ``default`` is
    ``$LSPO_JAX_CACHE``, else ``$XDG_CACHE_HOME/lspo_jax``, else ``~/.cache/lspo_jax``, then ``examples``; null
    keeps them in memory only. The first run over a file encodes its prompts into it; a resume or a later run
    reads them in seconds. Solutions are tokenised when the scaffold first needs one, either way.
    """

    train: str = "toy:addition"
    format: DataFormat = "auto"
    solution_field: SolutionField = "r1_solution_1"
    instruction: str = R1_INSTRUCTION
    instruction_position: InstructionPosition = "after"
    fields: DataFields = dataclasses.field(default_factory=DataFields)
    system_prompt: str | None = None
    template: PromptTemplate = "tokenizer"
    max_prompt_tokens: int = 512
    prompt_policy: LengthPolicy = "skip"
    max_solution_tokens: int = 4096
    solution_policy: LengthPolicy = "truncate"
    eos_after_truncated: bool = False
    shuffle: bool = True
    limit: int | None = None
    cache_dir: str | None = "default"

    def __post_init__(self) -> None:
        options.check(self, "data")
        require(self.limit is None or self.limit > 0, "data.limit", "must be positive or null", self.limit)
        require(self.cache_dir is None or bool(self.cache_dir.strip()), "data.cache_dir",
                 "must be a directory, default or null", self.cache_dir)  # fmt: skip
        require(self.max_prompt_tokens > 0, "data.max_prompt_tokens", "must be positive", self.max_prompt_tokens)
        require(self.max_solution_tokens > 0, "data.max_solution_tokens", "must be positive", self.max_solution_tokens)
        require(self.system_prompt is None or bool(self.system_prompt.strip()), "data.system_prompt",
                "must be text or null", self.system_prompt)  # fmt: skip


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
    group_size: int = 16
    max_new_tokens: int = 8192
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    engine: RolloutEngine = "jax"
    vllm_kv_cache_gib: int = 1
    compact_every: int = 16  # sampler.DEFAULT_COMPACT_EVERY
    dynamic_sampling: bool = False
    max_draw_rounds: int = 4
    max_staleness: int = 0
    placement: Placement = "colocated"
    sampler_devices: int | None = None
    max_logprob_gap: float | None = None
    max_logprob_gap_steps: int = 2

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
        require(self.max_logprob_gap_steps >= 0, "rollout.max_logprob_gap_steps", "must be >= 0 (0 never stops)",
                self.max_logprob_gap_steps)  # fmt: skip
        require(self.prompts_per_step > 0, "rollout.prompts_per_step", "must be positive", self.prompts_per_step)
        require(
            self.group_size > 1,
            "rollout.group_size",
            "must be > 1: advantages are normalised per group",
            self.group_size,
        )
        require(self.max_new_tokens > 0, "rollout.max_new_tokens", "must be positive", self.max_new_tokens)
        require(self.temperature > 0, "rollout.temperature", "must be positive", self.temperature)
        require(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]", self.top_p)
        require(self.top_k >= 0, "rollout.top_k", "must be >= 0 (0 disables it)", self.top_k)
        require(
            self.vllm_kv_cache_gib > 0,
            "rollout.vllm_kv_cache_gib",
            "must be a positive number of GiB",
            self.vllm_kv_cache_gib,
        )
        require(self.compact_every >= 0, "rollout.compact_every", "must be >= 0 (0 never compacts)", self.compact_every)
        require(
            self.max_draw_rounds >= 1,
            "rollout.max_draw_rounds",
            "must be >= 1 (the first round included)",
            self.max_draw_rounds,
        )
        require(self.max_staleness in (0, 1), "rollout.max_staleness", "must be 0 or 1", self.max_staleness)
        require(self.sampler_devices is None or self.sampler_devices >= 1, "rollout.sampler_devices",
                "must be >= 1 or null (half the devices)", self.sampler_devices)  # fmt: skip
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
    overlong_factor: float = 1.0
    require_think_close: bool = False
    workers: int = 2
    timeout_s: float = 5.0
    functions: tuple[RewardFunctionConfig, ...] = ()

    def __post_init__(self) -> None:
        names = [f.name for f in self.functions]
        twice = sorted({name for name in names if names.count(name) > 1})
        require(not twice, "reward.functions", f"two functions are named {twice[0] if twice else ''}; give each its "
                "own name")  # fmt: skip
        judges = [f.name for f in self.functions if f.correctness]
        require(len(judges) <= 1, "reward.functions", f"at most one function may be the correctness signal, got "
                f"{judges}")  # fmt: skip
        require(self.overlong_buffer > 0, "reward.overlong_buffer", "must be positive", self.overlong_buffer)
        require(self.workers >= 0, "reward.workers", "must be >= 0 (0 scores in-process)", self.workers)
        require(self.timeout_s > 0, "reward.timeout_s", "must be positive", self.timeout_s)


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
    eps_low: float = 0.2
    eps_high: float = 0.28
    clip_c: float | None = None
    micro_batches: int = 1
    # Run the LM head over this many positions at a time, so [rows, length, vocab] logits are never whole.
    chunk_size: int | None = None
    # The update, the log-prob passes and the SFT step run over token buffers (packing.pack_rows) that hold the
    # rows' real tokens only, several sequences to a buffer row; false runs the padded [B * K, P + R] rows.
    packing: bool = True
    # Truncated importance sampling against the sampling engine's numerics: each token's loss times
    # min(exp(old_logp - sampler_logp), tis_cap), detached (``corrections.importance_weights``); null: off.
    tis_cap: float | None = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    kl_in: KLPlacement = "loss"
    kl_reference: str | None = None
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        options.check(self, "loss")
        require(self.kl_coef >= 0, "loss.kl_coef", "must be >= 0 (0: no KL penalty)", self.kl_coef)
        require(self.entropy_coef >= 0, "loss.entropy_coef", "must be >= 0 (0: no entropy bonus)", self.entropy_coef)
        require(self.kl_reference is None or bool(self.kl_reference.strip()), "loss.kl_reference",
                "must be a Hugging Face directory or null (the base the run loaded)", self.kl_reference)  # fmt: skip
        require(self.kl_reference is None or self.kl_coef > 0, "loss.kl_reference", "names the KL penalty's "
                "reference, which is off (loss.kl_coef: 0); set loss.kl_coef or leave it null")  # fmt: skip
        require(
            self.chunk_size is None or self.chunk_size > 0,
            "loss.chunk_size",
            "must be positive or null",
            self.chunk_size,
        )
        require(0 <= self.eps_low < 1, "loss.eps_low", "must be in [0, 1)", self.eps_low)
        require(self.eps_high >= 0, "loss.eps_high", "must be >= 0", self.eps_high)
        # Clip-higher widens the upper side (DAPO: 0.2 / 0.28); a narrower one is a swapped pair.
        pair = f"eps_high {self.eps_high} < eps_low {self.eps_low}"
        require(self.eps_high >= self.eps_low, "loss.eps_high", f"must be >= loss.eps_low (clip-higher), got {pair}")
        require(self.clip_c is None or self.clip_c > 1, "loss.clip_c", "must be > 1 or null", self.clip_c)
        require(self.micro_batches > 0, "loss.micro_batches", "must be positive", self.micro_batches)
        require(self.tis_cap is None or self.tis_cap > 0, "loss.tis_cap", "must be positive or null", self.tis_cap)

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
    supervise: Supervise = "adapter"
    sft_steps: int = 4
    sft: SFTOptimConfig = dataclasses.field(default_factory=SFTOptimConfig)
    splice: Splice = "partial"
    correction: Correction = "token"
    is_cap: float = 1.0
    ratio_floor: float = 0.2
    shaping_gamma: float = 0.1
    guide_percentile: float = 0.9
    mix_mu: float = 0.1
    mix_schedule: MixSchedule = "cosine"
    mix_token_weight: SFTTokenWeight = "none"
    warmup_tokens: int | None = None
    grad_share: bool = False
    reroll_n: int | None = None
    reroll_temperature: float | None = None
    reroll_scale: float = 1.0
    cliff_max_successes: int = 0
    adapter: AdapterLifetime = "fresh"
    reset_every: int | None = None
    # The SFT, re-roll and log-prob batches hold at least this many cliff prompts (padding repeats one):
    # set it to rollout.prompts_per_step to compile one program per phase, where compiling costs more
    # than the padded compute (small models on CPU). 1 sizes them by the cliff count (power-of-two buckets).
    min_cliff_bucket: int = 1

    def __post_init__(self) -> None:
        options.check(self, "scaffold")
        require(self.supervise == "adapter" or self.adapter == "fresh", "scaffold.supervise",
                 f"{self.supervise} fits no adapter, so none is kept (scaffold.adapter: persistent)")  # fmt: skip
        require(self.mix_mu >= 0, "scaffold.mix_mu", "must be >= 0", self.mix_mu)
        require(self.warmup_tokens is None or self.warmup_tokens > 0, "scaffold.warmup_tokens",
                 "must be positive or null", self.warmup_tokens)  # fmt: skip
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
        require(self.sft_steps > 0, "scaffold.sft_steps", "must be positive", self.sft_steps)
        require(self.min_cliff_bucket > 0, "scaffold.min_cliff_bucket", "must be positive", self.min_cliff_bucket)
        require(self.is_cap > 0, "scaffold.is_cap", "must be positive", self.is_cap)
        # Above 1 the floor would lift the ratio of tokens the adapter made less likely, past the clip at 1 + eps_high.
        require(0 < self.ratio_floor <= 1, "scaffold.ratio_floor", "must be in (0, 1]", self.ratio_floor)
        require(self.shaping_gamma > 0, "scaffold.shaping_gamma", "must be positive", self.shaping_gamma)
        require(0 < self.guide_percentile <= 1, "scaffold.guide_percentile", "must be in (0, 1]",
                 self.guide_percentile)  # fmt: skip
        require(
            self.reroll_n is None or self.reroll_n > 0, "scaffold.reroll_n", "must be positive or null", self.reroll_n
        )
        temperature = self.reroll_temperature
        require(
            temperature is None or temperature > 0,
            "scaffold.reroll_temperature",
            "must be positive or null",
            temperature,
        )
        require(self.reroll_scale >= 0, "scaffold.reroll_scale", "must be >= 0", self.reroll_scale)
        require(self.cliff_max_successes >= 0, "scaffold.cliff_max_successes", "must be >= 0", self.cliff_max_successes)
        require(
            self.reset_every is None or self.reset_every > 0,
            "scaffold.reset_every",
            "must be positive or null",
            self.reset_every,
        )
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


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Held-out validation every ``every`` steps (0: only before and after training), pass@k over ``n``;
    ``enabled: false`` validates never, not even before and after (a run that checks the step, not the model).

    ``benchmarks`` are bare names, paths or hub datasets (``tasks.benchmarks``: ``math500`` is ``NAME.jsonl`` in
    ``data_dir`` (else ``$LSPO_JAX_DATA_DIR``) when there, else the package's own; ``aime26`` is MathArena's on the
    hub); each is scored and logged on its own. ``limit`` keeps the first problems of each benchmark. ``top_p``: the
    samples' nucleus; null samples with ``rollout.top_p``.

    ``coverage_n`` (null: off) adds a coverage pass to validation at step 0, the last step and every
    ``coverage_every`` steps (0: only those two; a multiple of ``every``, as it rides on a validation): ``coverage_n``
    samples a problem of each of ``coverage_benchmarks`` (empty: every benchmark validated), reduced to pass@k for the
    powers of two up to ``coverage_n`` and the distinct correct completions a problem (``evaluation.coverage``).

    ``protocol`` names a published evaluation (``options.EVAL_PROTOCOLS``: deepscaler, deepmath, dapo, lspo) whose
    ``n``, ``temperature``, ``top_p`` and ``max_new_tokens`` the YAML reader (``load_config``) fills in for each of
    those keys the file and the overrides do not name, and ``ks`` (``default_ks(n)``) unless named; a key named
    wins, and ``lspo-eval`` records it as a deviation from the protocol. A config built in Python names its values
    itself: the field only checks the name.
    """

    every: int = 10
    enabled: bool = True
    benchmarks: tuple[str, ...] = ()
    n: int = 16
    ks: tuple[int, ...] = (1, 4, 8, 16)
    max_new_tokens: int = 8192
    temperature: float = 1.0
    limit: int | None = None
    data_dir: str | None = None
    top_p: float | None = None
    protocol: ProtocolName | None = None
    coverage_n: int | None = None
    coverage_every: int = 0
    coverage_benchmarks: tuple[str, ...] = ()

    DEFAULT_KS: ClassVar[tuple[int, ...]] = (1, 4, 8, 16)

    def __post_init__(self) -> None:
        require(self.every >= 0, "eval.every", "must be >= 0", self.every)
        require(self.n > 0, "eval.n", "must be positive", self.n)
        require(all(0 < k <= self.n for k in self.ks), "eval.ks", f"each k must be in 1..n={self.n}", list(self.ks))
        require(self.max_new_tokens > 0, "eval.max_new_tokens", "must be positive", self.max_new_tokens)
        require(self.temperature > 0, "eval.temperature", "must be positive", self.temperature)
        require(self.limit is None or self.limit > 0, "eval.limit", "must be positive or null", self.limit)
        require(self.top_p is None or 0 < self.top_p <= 1, "eval.top_p", "must be in (0, 1] or null", self.top_p)
        if self.protocol is not None:
            options.eval_protocol(self.protocol)
        require(self.coverage_n is None or self.coverage_n > 0, "eval.coverage_n", "must be positive or null",
                self.coverage_n)  # fmt: skip
        on_a_validation = self.every > 0 < self.coverage_every and self.coverage_every % self.every == 0
        require(self.coverage_every == 0 or on_a_validation,
                "eval.coverage_every", f"must be 0 or a multiple of eval.every={self.every} (a coverage pass is part "
                "of a validation)", self.coverage_every)  # fmt: skip

    @classmethod
    def default_ks(cls, n: int) -> list[int]:
        """The ks reported for ``n`` samples a problem: those of ``DEFAULT_KS`` that fit, the powers of two from 32
        up to n, and n itself (n = 16: 1, 4, 8, 16; n = 256: 1, 4, 8, 16, 32, 64, 128, 256)."""
        doubling = [2**j for j in range(5, max(n, 1).bit_length())]  # 32, 64, ... <= n
        return sorted({k for k in cls.DEFAULT_KS if k <= n} | set(doubling) | {n})


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints of the base and RL state every ``every`` steps, the last ``keep`` kept."""

    every: int = 50
    keep: int = 3

    def __post_init__(self) -> None:
        require(self.every > 0, "checkpoint.every", "must be positive", self.every)
        require(self.keep > 0, "checkpoint.keep", "must be positive", self.keep)


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """The device mesh and, for a multi-host job, how its processes meet.

    ``data``, ``fsdp`` and ``tp`` are the mesh's axis sizes (one may be -1: the rest of the devices). With
    ``enabled: null`` (the default) a run spans every device when JAX sees more than one; ``false`` runs on
    the first device alone, a 1 x 1 x 1 mesh (the programs are the same either way). ``coordinator``
    (host:port of process 0), ``num_processes`` and ``process_id`` start ``jax.distributed``; left null they
    come from ``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID`` or SLURM's variables.

    ``memory_fraction``: the share of each GPU's memory JAX's allocator takes (``lspo-train`` sets
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` from it before JAX starts). With ``rollout.engine: vllm`` the engine takes
    the rest but ``VLLM_MARGIN`` (its ``gpu_memory_utilization``), so one setting splits the device. Null: 0.9
    alone, 0.6 beside vLLM (``memory_fractions``); JAX's own default would be 0.75.
    """

    enabled: bool | None = None
    data: int = 1
    fsdp: int = -1
    tp: int = 1
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    memory_fraction: float | None = None

    VLLM_MARGIN: ClassVar[float] = 0.05  # the CUDA contexts and what neither allocator counts
    DEFAULT_FRACTION: ClassVar[dict[str, float]] = {"jax": 0.9, "vllm": 0.6}

    def __post_init__(self) -> None:
        for name in ("data", "fsdp", "tp"):
            size = getattr(self, name)
            require(size >= 1 or size == -1, f"mesh.{name}", "must be a positive size or -1 (the rest)", size)
        require([self.data, self.fsdp, self.tp].count(-1) <= 1, "mesh", "at most one axis may be -1")
        fraction = self.memory_fraction
        require(fraction is None or 0.05 <= fraction <= 0.98, "mesh.memory_fraction",
                 f"must be null or between 0.05 and 0.98, got {fraction}")  # fmt: skip

    def memory_fractions(self, engine: str) -> tuple[float, float]:
        """``(jax, vllm)``: the shares of each GPU's memory for JAX and, with ``engine`` vllm, the engine (else 0)."""
        jax_share = self.memory_fraction or self.DEFAULT_FRACTION[engine]
        return jax_share, (max(0.0, round(1.0 - jax_share - self.VLLM_MARGIN, 4)) if engine == "vllm" else 0.0)


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """Where metrics go besides ``metrics.jsonl`` and TensorBoard: a Weights & Biases run when ``wandb``
    (an optional dependency: ``pip install -e '.[wandb]'``). ``offline`` writes it under the run directory for a
    later ``wandb sync``; a resumed run continues the same W&B run."""

    wandb: bool = False
    wandb_project: str = "lspo_jax"
    wandb_mode: WandbMode = "offline"

    def __post_init__(self) -> None:
        options.check(self, "log")
        require(bool(self.wandb_project), "log.wandb_project", "must not be empty", self.wandb_project)


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run; every section has defaults, so a YAML file names only what differs.

    ``compile_cache``: where compiled XLA programs are kept between runs (``compiles.use_cache``): ``default`` is
    ``$LSPO_JAX_COMPILATION_CACHE`` when set (empty: none), else ``$LSPO_JAX_CACHE``, ``$XDG_CACHE_HOME/lspo_jax``
    or ``~/.cache/lspo_jax``, then ``xla``; null keeps none. A second run of the same shapes, or a resume, reads
    its programs back instead of compiling them.
    """

    model: ModelSource = dataclasses.field(default_factory=lambda: ModelSource(path="toy"))
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    optim: RLOptimConfig = dataclasses.field(default_factory=RLOptimConfig)
    scaffold: ScaffoldConfig = dataclasses.field(default_factory=ScaffoldConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    steps: int = 1500
    seed: int = 42
    max_nonfinite_in_row: int = 3
    compile_cache: str | None = "default"

    def __post_init__(self) -> None:
        require(self.compile_cache is None or bool(self.compile_cache.strip()), "compile_cache",
                 "must be a directory, default or null", self.compile_cache)  # fmt: skip
        require(self.steps > 0, "steps", "must be positive", self.steps)
        # JAX keys and numpy's generators take unsigned seeds: a negative one fails deep in the first draw.
        require(0 <= self.seed < 2**32, "seed", "must be in 0..2**32-1", self.seed)
        require(self.max_nonfinite_in_row > 0, "max_nonfinite_in_row", "must be positive", self.max_nonfinite_in_row)
        # The penalty starts at max_new_tokens - buffer tokens: a larger buffer penalises every response.
        buffer, limit = self.reward.overlong_buffer, self.rollout.max_new_tokens
        require(buffer <= limit or self.reward.overlong_factor == 0, "reward.overlong_buffer",
                 f"{buffer} is more than rollout.max_new_tokens {limit}: every response would be penalised; "
                 "set it <= max_new_tokens (or reward.overlong_factor: 0)")  # fmt: skip
        rows = self.rollout.prompts_per_step * self.rollout.group_size
        require(self.optim.mini_batches <= rows, "optim.mini_batches",
                 f"must be at most the step's {rows} rows", self.optim.mini_batches)  # fmt: skip
        updates = self.optim.mini_batches * self.optim.epochs
        require(not (self.scaffold.enabled and self.scaffold.supervise == "mixed") or updates == 1,
                 "scaffold.supervise", "mixed adds its SFT term to the step's one update; set optim.mini_batches "
                 f"and optim.epochs to 1 (they make {updates})")  # fmt: skip
        m, k = self.scaffold.cliff_max_successes, self.rollout.group_size
        require(m < k, "scaffold.cliff_max_successes", f"{m} makes every group of {k} a cliff; set it below {k}")
        self._check_lora_training()
        self._fix_decay_horizons()
        self._check_staleness()

    def _fix_decay_horizons(self) -> None:
        """A decaying schedule's null ``decay_steps`` set to its optimizer's lifetime, here where the run's length is
        known: ``optim``'s to the run's updates (``steps x optim.mini_batches x optim.epochs``), ``scaffold.sft``'s to
        ``scaffold.sft_steps`` (a fresh adapter's optimizer lives for one step's SFT). Every program built from the
        config then reads one horizon, and the run's config.yaml records it, so a resume with more ``steps`` keeps the
        schedule it began with rather than jumping to another rate midway. A constant schedule keeps its null."""
        optim = self.optim.lasting(self.steps * self.optim.mini_batches * self.optim.epochs)
        sft = self.scaffold.sft.lasting(self.scaffold.sft_steps)
        object.__setattr__(self, "optim", optim)  # frozen: set once, while the config is being built
        if sft is not self.scaffold.sft:
            object.__setattr__(self, "scaffold", dataclasses.replace(self.scaffold, sft=sft))

    def _check_lora_training(self) -> None:
        """LoRA RL trains the policy adapter alone: a bf16 base only where it is frozen, and none of the options that
        write the base (the supervision controls) or copy it alone (a stale sampler's copy)."""
        lora = self.optim.train == "lora"
        require(self.model.param_dtype == "float32" or lora, "model.param_dtype", "bfloat16 stores a frozen base: "
                "set optim.train: lora (full RL updates need float32 master weights)")  # fmt: skip
        if not lora:
            return
        require(self.scaffold.supervise == "adapter", "scaffold.supervise", f"{self.scaffold.supervise} updates the "
                "base, which optim.train: lora keeps frozen; use adapter", self.scaffold.supervise)  # fmt: skip
        require(not self.rollout.max_staleness, "rollout.max_staleness", "samples from a copy of the base alone; "
                "set it to 0 with optim.train: lora", self.rollout.max_staleness)  # fmt: skip

    def _check_staleness(self) -> None:
        """Rows sampled one update old need their correction, and a sampler the update does not wait for."""
        rollout = self.rollout
        if not rollout.max_staleness:
            return
        # Plain PPO on rows one update old diverges: the truncated weight on proximal / behaviour is not optional.
        require(
            self.loss.tis_cap is not None,
            "rollout.max_staleness",
            f"{rollout.max_staleness} needs loss.tis_cap "
            "(the truncated weight on the stale rows' proximal / behaviour ratio), which is null; set it, e.g. 2.0",
        )
        require(rollout.engine == "jax", "rollout.max_staleness", f"{rollout.max_staleness} samples with the JAX "
                f"engine only, got rollout.engine {rollout.engine!r}")  # fmt: skip
        require(not rollout.dynamic_sampling, "rollout.max_staleness", f"{rollout.max_staleness} and "
                "rollout.dynamic_sampling: draw rounds are sampled inside the step; turn one off")  # fmt: skip
        require(rollout.placement != "split" or self.mesh.enabled is not False, "rollout.placement",
                "split needs a mesh of the learner's devices and one of the sampler's, and mesh.enabled: false runs on "
                "one device; set mesh.enabled to null or true")  # fmt: skip

    def update_rows_per_micro(self) -> int:
        """Rows of ``max_prompt_tokens + max_new_tokens`` slots in one micro-batch of the padded update."""
        return -(-self.rollout.prompts_per_step * self.rollout.group_size // self.loss.micro_batches)


# ------------------------------------------------------------------------------------------ reading
def _renamed(cls: type, data: dict[str, Any], where: str) -> dict[str, Any]:
    """``data`` with the keys of an earlier version that section ``cls`` names in its ``RENAMED`` (old -> new; a
    run's own config.yaml, resumed, may hold them) under their new names; the old and the new one together is an
    error."""
    for old, new in getattr(cls, "RENAMED", {}).items():
        if old in data:
            require(new not in data, f"{where}{old}", f"renamed {where}{new}, which is also given; keep one")
            data = {(new if key == old else key): value for key, value in data.items()}
    return data


def from_dict(cls: type, data: Any, where: str = "") -> Any:
    """Build dataclass ``cls`` from a nested dict, checking every key and type; errors name the key."""
    require(isinstance(data, dict), where.rstrip(".") or "config", f"expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    data = _renamed(cls, data, where)
    unknown = sorted(set(data) - set(fields))
    noun = getattr(cls, "KEY_NAME", "key")
    require(not unknown, f"{where}{unknown[0]}" if unknown else where, f"unknown {noun}; known: {sorted(fields)}")
    values = {name: _coerce(hints[name], value, f"{where}{name}") for name, value in data.items()}
    try:
        return cls(**values)
    except ConfigError:
        raise
    except FieldError as err:  # said at the dotted key the user typed
        raise ConfigError(err.at(f"{where}{err.name}")) from err
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{where.rstrip('.') or cls.__name__}: {err}") from err


def _coerce(hint: Any, value: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``hint`` (YAML's int is accepted for float)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: expected {hint}, got {value!r}")
    if origin is typing.Literal:
        return value  # an option: checked once, by its section's ``options.check``, which names the key
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, f"{key}.")
    if origin is tuple:
        require(isinstance(value, list | tuple), key, f"expected a list, got {value!r}")
        return tuple(_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if hint is float:
        return _finite_float(value, key)
    ok = isinstance(value, hint) and not (hint is int and isinstance(value, bool))
    require(ok, key, f"expected {hint.__name__}, got {value!r}")
    return value


def _finite_float(value: Any, key: str) -> float:
    """``value`` as a float (YAML's int, and a string Python reads as a number: YAML 1.1 reads 1e-3, no dot, as a
    string), refused unless finite. Every float field of every section is read here, so this one check covers them:
    an inf passes each "must be positive", and a nan where no check reads the field (``reward.overlong_factor``)
    makes every update non-finite and skipped, in a run that still exits 0."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    elif isinstance(value, int) and not isinstance(value, bool):
        number = float(value)
    require(isinstance(number, float), key, f"expected float, got {value!r}")
    require(math.isfinite(number), key, "must be finite", number)
    return number


def to_dict(config: Any) -> dict[str, Any]:
    """The nested dict that ``from_dict`` reads back to an equal config (tuples become lists)."""

    def plain(x: Any) -> Any:
        if isinstance(x, tuple | list):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    return plain(dataclasses.asdict(config))


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``dotted.key=value`` strings (value parsed as YAML) to a nested dict, returning a new dict."""
    data = to_plain_copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        require(bool(sep) and bool(key), item, "an override is written dotted.key=value")
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
            require(isinstance(node, dict), key, f"{part!r} is not a section")
        node[leaf] = yaml.safe_load(raw)
    return data


def to_plain_copy(data: dict[str, Any]) -> dict[str, Any]:
    return {k: to_plain_copy(v) if isinstance(v, dict) else v for k, v in data.items()}


def load_config(path: str | Path | None, overrides: list[str] = (), cls: type = TrainConfig) -> Any:
    """Read a YAML file (or the defaults when ``path`` is None), apply overrides, check everything, into ``cls``:
    the core sections here; a run's whole config, the methods' sections included, is ``job.config.load_config``'s.

    A file may start from another: ``base_config: other.yaml`` (relative to the file) reads that one first and
    lays this file's keys over it, section by section (a recipe for another chip names only what differs)."""
    data = {} if path is None else _read_yaml(Path(path), ())
    merged = apply_overrides(data, list(overrides))
    return from_dict(cls, _with_eval_protocol(merged, apply_overrides({}, list(overrides))))


def _with_eval_protocol(data: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``data`` with ``eval.protocol``'s settings (``options.EvalProtocol.KEYS``) in each of its ``eval`` keys not
    named, and with ``eval.ks`` the ``default_ks`` of the resulting n unless named. A protocol sits just below
    the layer that names it: named by an override (``top``: the overrides alone), it fills every key the
    overrides do not name, the file's included (a resumed run's config.yaml names them all); named in the file,
    only the keys the file and the overrides leave out. Either way the result names every key the protocol sets, so
    a config.yaml written from it reads back to the same config."""
    section, top_section = data.get("eval"), top.get("eval")
    if not isinstance(section, dict) or section.get("protocol") is None:
        return data
    protocol = options.eval_protocol(section["protocol"])
    named = top_section if isinstance(top_section, dict) and "protocol" in top_section else section
    filled = {**section, **{key: value for key, value in protocol.settings().items() if key not in named}}
    if "ks" not in named and isinstance(filled.get("n"), int):  # a bad n is said by from_dict, at its key
        filled["ks"] = EvalConfig.default_ks(filled["n"])
    return {**data, "eval": filled}


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping, naming its dotted path and both lines.

    PyYAML keeps the last of two, silently: a second ``rollout:`` block would replace the first whole. The
    constructor builds a nested mapping after its parent (or inside it, deep), so each mapping's dotted path is
    noted on its child nodes before they are built."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._paths: dict[yaml.Node, str] = {}

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        where, lines = self._paths.get(node, ""), {}
        for key_node, value_node in node.value:
            # ``<<: *anchor`` lays keys in, not a key given twice; a list or mapping as a key SafeLoader refuses itself.
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key, line = self.construct_object(key_node), key_node.start_mark.line + 1
            if key in lines:
                raise ConfigError(f"{where}{key} appears twice (lines {lines[key]} and {line})")
            lines[key] = line
            self._name(value_node, f"{where}{key}")
        return super().construct_mapping(node, deep=deep)

    def _name(self, node: yaml.Node, dotted: str) -> None:
        """Note ``dotted`` as the path of ``node``, or of each mapping in the list ``node`` (``key[i]``)."""
        if isinstance(node, yaml.MappingNode):
            self._paths.setdefault(node, f"{dotted}.")
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._name(item, f"{dotted}[{i}]")


def _load_yaml(text: str) -> Any:
    loader = _UniqueKeyLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _read_yaml(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    try:
        data = _load_yaml(path.read_text(encoding="utf-8"))
    except ConfigError as err:  # a key given twice: said at the file
        raise ConfigError(f"{path}: {err}") from None
    except FileNotFoundError as err:
        raise ConfigError(f"config file not found: {path}") from err
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); a config is a YAML file") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if data is None or data == {}:  # the defaults alone are the paper's shape: an empty file is a mistake
        raise ConfigError(f"{path}: holds no settings (the defaults alone are the paper's 1.5B shape); name at "
                          "least model.path, or start from configs/demo.yaml")  # fmt: skip
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must map section names to settings, got a {type(data).__name__}")
    base = data.pop("base_config", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base_config: must be a file name, got {base!r}")
    base_path = path.parent / base
    if base_path.resolve() in seen:
        raise ConfigError(f"{path}: base_config: {base} is already being read (a cycle)")
    return _laid_over(_read_yaml(base_path, (*seen, path.resolve())), data)


def _laid_over(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``top``'s keys laid over it, mappings merged key by key."""
    merged = dict(base)
    for key, value in top.items():
        below = merged.get(key)
        merged[key] = _laid_over(below, value) if isinstance(below, dict) and isinstance(value, dict) else value
    return merged
