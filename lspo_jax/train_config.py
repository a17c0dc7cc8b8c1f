"""The configuration of a training run: ``TrainConfig``, frozen dataclasses whose sections each check their own
fields, and which checks what reads two sections.

The sections of the model, the data, validation, checkpoints, the mesh and the logs are here; those of what one
step does (``rollout``, ``reward``, ``loss``, ``scaffold``) in ``step_config``, the optimizers' in ``optim_config``,
and each method's beside its code (``job.config.RunConfig`` composes them). A YAML file only serialises the config
(``job.config_io`` reads it, strictly: an unknown key, a key given twice or a value of the wrong type is an error
that names the dotted key). Each key's meaning is the docstring under its field, from which docs/options.md is
written (``tools.options_reference``). The DAPO baseline is the same config with ``scaffold.enabled: false``, not a
separate code path.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from lspo_jax import moved_names, optim_config, options, step_config
from lspo_jax.config import LoraConfig
from lspo_jax.options import (
    Attention,
    ComputeDtype,
    ConfigError,  # noqa: F401 (the config's error, read from here across the package)
    DataFormat,
    DecodeAttention,
    InstructionPosition,
    LengthPolicy,
    PromptTemplate,
    ProtocolName,
    Remat,
    SolutionField,
    WandbMode,
    require,
    require_bound,
)


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
    """The policy: a local Hugging Face directory, a hub name `ORG/NAME[@REVISION]` (fetched once into the Hugging Face
    cache), or `toy`, the demo's own model."""
    param_dtype: ComputeDtype = "float32"
    """How the base's weights are stored; `bfloat16` only for a frozen base (`optim.train: lora`): half the memory, the
    adapters stay float32."""
    compute_dtype: ComputeDtype = "float32"
    """The matmul dtype of the forward pass (bfloat16 on accelerators); norms, softmax and logits stay float32."""
    remat: Remat = "none"
    """Rematerialisation of the layer scan in the backward pass: `full` saves each layer's input only, `dots` also the
    weight matmuls' outputs."""
    attention: Attention = "einsum"
    """The attention kernel of the training and log-prob passes; `blocked` holds no `[T, T]` scores on any backend,
    `cudnn` needs a CUDA GPU and bfloat16."""
    decode_attention: DecodeAttention = "reduce"
    """The attention of the sampler's decode step over the KV cache (`pallas`: the GPU kernel)."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    policy_lora: LoraConfig = dataclasses.field(
        default_factory=lambda: LoraConfig(rank=32, alpha=64.0),
        # ``LoraConfig``'s keys (whose docstrings say them for ``lora``), as they read for the policy adapter:
        metadata={"meanings": {
            "rank": "The rank of LoRA RL's persistent policy adapter (`optim.train: lora`; unused otherwise).",
            "alpha": "The policy adapter's `alpha`: its `B A` is scaled by `alpha / rank`, always on.",
            "targets": "The projections that carry the policy adapter (peft's `q_proj` ... `down_proj` on export).",
        }},
    )  # fmt: skip

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
    """The column holding the problem (null: the format's, `problem` or DeepMath's `question`); a row without it is read
    from the format's."""
    answer: str | None = None
    """The column holding the gold answer (null: `answer`, or DeepMath's `final_answer`)."""
    solution: str | None = None
    """The column holding the worked solution the scaffold learns from (null: `solution`, or DeepMath's
    `data.solution_field`); with none in any row, cliffs cannot be rescued."""
    id: str | None = None
    """The column holding the row's id (null: `id`, `unique_id` or `problem_idx`, else the row's position). The row's
    other columns reach the reward functions as `Example.fields`."""

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
    """The training prompts: a file or directory of rows, a hub dataset `ORG/NAME[@REVISION][:PART]`, or `toy:addition`.
    """
    format: DataFormat = "auto"
    """How rows are read: `shared` (`problem, answer`), `deepmath` (DeepMath-103K's fields), or `auto` (told apart by
    each file's fields)."""
    solution_field: SolutionField = "r1_solution_1"
    """The DeepMath-103K trace the scaffold learns from."""
    instruction: str = R1_INSTRUCTION
    """The instruction sent with each problem in its user turn (generated `toy:` tasks never get it)."""
    instruction_position: InstructionPosition = "after"
    """Where the instruction goes: `after` or `before` the problem (joined by a newline), or left out (`none`)."""
    fields: DataFields = dataclasses.field(default_factory=DataFields)
    system_prompt: str | None = None
    """A system turn before each problem's user turn (null: none); generated `toy:` tasks never get it."""
    template: PromptTemplate = "tokenizer"
    """How the prompt is rendered: the tokenizer's chat template (`plain` without one), DeepSeek-R1-Distill's written
    out, or BOS, the system prompt and a newline, the text ([Your own data](getting-started.md#your-own-data))."""
    max_prompt_tokens: int = 512
    """Prompts longer than this many tokens follow `data.prompt_policy`, and are counted."""
    prompt_policy: LengthPolicy = "skip"
    """What a prompt over `data.max_prompt_tokens` gets: skipped or truncated."""
    max_solution_tokens: int = 4096
    """Worked solutions longer than this many tokens follow `data.solution_policy`, and are counted."""
    solution_policy: LengthPolicy = "truncate"
    """What a solution over `data.max_solution_tokens` gets: skipped or truncated."""
    eos_after_truncated: bool = False
    """Whether a truncated solution still ends with EOS (off: the adapter should not learn to stop mid-thought)."""
    shuffle: bool = True
    """Whether prompts are drawn in a seeded permutation per epoch (`seed`) rather than in file order."""
    limit: int | None = None
    """Keep the first this many usable prompts (null: all)."""
    cache_dir: str | None = "default"
    """Where a file's encoded prompts are kept between runs: `default` is the project's cache directory's `examples`,
    null keeps them in memory only."""

    def __post_init__(self) -> None:
        options.check(self, "data")
        require_bound(self, "data", "limit", null=True)
        require(self.cache_dir is None or bool(self.cache_dir.strip()), "data.cache_dir",
                 "must be a directory, default or null", self.cache_dir)  # fmt: skip
        require_bound(self, "data", "max_prompt_tokens", "max_solution_tokens")
        require(self.system_prompt is None or bool(self.system_prompt.strip()), "data.system_prompt",
                "must be text or null", self.system_prompt)  # fmt: skip


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
    """Validate on the held-out benchmarks every this many steps (0: only before and after training)."""
    enabled: bool = True
    """Validate at all; false never validates, not even before and after training."""
    benchmarks: tuple[str, ...] = ()
    """The held-out benchmarks, each scored and logged on its own: bare names (`math500`, `aime26`), paths or hub
    datasets."""
    n: int = 16
    """Samples per problem; pass@k is reported over them."""
    ks: tuple[int, ...] = (1, 4, 8, 16)
    """The k of each pass@k reported (each in 1..`eval.n`)."""
    max_new_tokens: int = 8192
    """The longest validation response, in tokens."""
    temperature: float = 1.0
    """The validation samples' temperature."""
    limit: int | None = None
    """Keep the first this many problems of each benchmark (null: all)."""
    data_dir: str | None = None
    """Where a bare benchmark name's `NAME.jsonl` is looked for first (null: `$LSPO_JAX_DATA_DIR`), else the package's
    own."""
    top_p: float | None = None
    """The validation samples' nucleus (null: `rollout.top_p`)."""
    protocol: ProtocolName | None = None
    """A published evaluation whose `n`, `temperature`, `top_p` and `max_new_tokens` the YAML reader fills in for the
    keys not named."""
    coverage_n: int | None = None
    """Samples a problem of the coverage pass (pass@k for k in powers of two up to it, distinct correct completions);
    null: no coverage pass."""
    coverage_every: int = 0
    """Steps between coverage passes, besides step 0 and the last (0: only those); a multiple of `eval.every`."""
    coverage_benchmarks: tuple[str, ...] = ()
    """The validated benchmarks the coverage pass samples; empty: all of them."""

    DEFAULT_KS: ClassVar[tuple[int, ...]] = (1, 4, 8, 16)

    def __post_init__(self) -> None:
        require_bound(self, "eval", "every", inclusive=True)
        require_bound(self, "eval", "n", "max_new_tokens", "temperature")
        require(all(0 < k <= self.n for k in self.ks), "eval.ks", f"each k must be in 1..n={self.n}", list(self.ks))
        require_bound(self, "eval", "limit", "coverage_n", null=True)
        require(self.top_p is None or 0 < self.top_p <= 1, "eval.top_p", "must be in (0, 1] or null", self.top_p)
        if self.protocol is not None:
            options.eval_protocol(self.protocol)
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
    """Write an Orbax checkpoint of the base and RL state every this many steps."""
    keep: int = 3
    """Keep the last this many checkpoints."""

    def __post_init__(self) -> None:
        require_bound(self, "checkpoint", "every", "keep")


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
    """Null spans every device when JAX sees more than one; false runs on the first device alone, a 1 x 1 x 1 mesh."""
    data: int = 1
    """The mesh's data axis size (-1: the rest of the devices)."""
    fsdp: int = -1
    """The mesh's fsdp axis size (-1, the default: the rest of the devices)."""
    tp: int = 1
    """The mesh's tensor-parallel axis size (-1: the rest of the devices)."""
    coordinator: str | None = None
    """A multi-host job's `host:port` of process 0 (null: from `JAX_COORDINATOR_ADDRESS` or SLURM)."""
    num_processes: int | None = None
    """A multi-host job's process count (null: from `JAX_NUM_PROCESSES` or SLURM)."""
    process_id: int | None = None
    """This process's index in a multi-host job (null: from `JAX_PROCESS_ID` or SLURM)."""
    memory_fraction: float | None = None
    """The share of each GPU's memory JAX's allocator takes, vLLM the rest but a margin (null: 0.9 alone, 0.6 beside
    vLLM)."""

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
    """Also log metrics to a Weights & Biases run (the optional extra: `.venv/bin/pip install -e '.[wandb]'`); a resumed
    run continues it."""
    wandb_project: str = "lspo_jax"
    """The W&B project the run logs to."""
    wandb_mode: WandbMode = "offline"
    """`online`, or `offline`: written under the run directory for a later `wandb sync`."""

    def __post_init__(self) -> None:
        options.check(self, "log")
        require(bool(self.wandb_project), "log.wandb_project", "must not be empty", self.wandb_project)


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
    rollout: step_config.RolloutConfig = dataclasses.field(default_factory=step_config.RolloutConfig)
    reward: step_config.RewardConfig = dataclasses.field(default_factory=step_config.RewardConfig)
    loss: step_config.LossConfig = dataclasses.field(default_factory=step_config.LossConfig)
    optim: optim_config.RLOptimConfig = dataclasses.field(default_factory=optim_config.RLOptimConfig)
    scaffold: step_config.ScaffoldConfig = dataclasses.field(default_factory=step_config.ScaffoldConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    steps: int = 1500
    """Training steps of the run."""
    seed: int = 42
    """The run's seed: the prompt order, the rollouts' and validation's sampling keys (0..2**32-1)."""
    max_nonfinite_in_row: int = 3
    """Stop the run, after a checkpoint, once this many updates in a row are non-finite (each is skipped)."""
    compile_cache: str | None = "default"
    """Where compiled XLA programs are kept between runs: `default` is the project's cache directory's `xla`, null keeps
    none."""

    def __post_init__(self) -> None:
        require(self.compile_cache is None or bool(self.compile_cache.strip()), "compile_cache",
                 "must be a directory, default or null", self.compile_cache)  # fmt: skip
        require_bound(self, "", "steps", "max_nonfinite_in_row")
        # JAX keys and numpy's generators take unsigned seeds: a negative one fails deep in the first draw.
        require(0 <= self.seed < 2**32, "seed", "must be in 0..2**32-1", self.seed)
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


# Names that moved: the reader to the job's floor (only a run reads YAML), the step's and the optimizers' sections
# to modules of their own. Their old path here warns for one release.
__getattr__ = moved_names(__name__, {
    **{name: "job.config_io" for name in ("load_config", "apply_overrides", "from_dict", "to_dict")},
    **{name: "step_config" for name in ("RolloutConfig", "RewardConfig", "RewardFunctionConfig", "LossConfig",
                                        "ScaffoldConfig", "BUILTIN_REWARD", "WARMED")},
    **{name: "optim_config" for name in ("AdamWConfig", "RLOptimConfig", "SFTOptimConfig")},
})  # fmt: skip
