"""Every option's vocabulary, typed, and the checks of a config's fields: the ground floor the other modules read.

An option is a ``Literal`` of its values, declared here once with what each value means; a config field takes the
type (``splice: Splice = "partial"``) and ``check`` validates every such field of a config the same way, so the
YAML reader (``train_config``), a config built in Python and the functions that act on an option agree on one
vocabulary (``choices(Splice)``: its values in declaration order, the first the default). An option that selects
a strategy (an estimator, a splice, a correction, an adapter lifetime) has a ``Registry`` beside the code that
implements it, the one place its name is looked up. ``require`` and ``require_bound`` say a bad value in the config's
one dialect (``rollout.top_k: must be >= 0 (0 disables it), got -1``). Nothing here imports the rest of the package.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Literal

from lspo_jax import moved_names


class ConfigError(ValueError):
    """A config value that does not fit its field; the message names the dotted key."""


class RolloutError(RuntimeError):
    """The rollout engine's samples are not the policy's it was meant to sample (the adapter not on, weights that
    did not sync): found mid-run from the samples themselves, not from the config."""


class FieldError(ValueError):
    """A dataclass field's bad value in the config's one dialect, ``Owner.name: what is allowed, got value``; the
    config reader says it at the dotted key the user typed instead (``at``)."""

    def __init__(self, owner: str, name: str, allowed: str, value: Any):
        self.owner, self.name, self.allowed, self.value = owner, name, allowed, value
        super().__init__(self.at(f"{owner}.{name}"))

    def at(self, key: str) -> str:
        return f"{key}: {self.allowed}, got {self.value!r}"


# ------------------------------------------------------------------------------------- the vocabularies
# The group baseline of ``losses.group_advantages``: (r - mean) / std (GRPO), r - mean (Dr. GRPO), or r minus the
# mean of the other n - 1 rewards (RLOO).
Estimator = Literal["std", "mean_only", "loo"]
# How a cliff's verified re-rolls enter its group (``scaffold.splice``): replace failed rows up to a share
# (the paper's), replace the whole group, or append and keep every failed row.
Splice = Literal["partial", "group", "keep_failed"]
# The correction of a spliced row for being sampled with the adapter on (``corrections.importance_weights``).
Correction = Literal["token", "sequence", "floor", "shaped", "guide", "none"]
# When the adapter is reset: every step (the paper), or kept across steps with its own SFT state.
AdapterLifetime = Literal["fresh", "persistent"]
# What the worked solutions train: the adapter, which then re-rolls the cliffs (LSPO); the base itself with the SFT
# loss before the RL update and nothing re-rolled (the direct-supervision control: interleaved SFT, as ReLIFT's); the
# base through an SFT term in the RL update's own loss (CHORD's mixed objective); or the base once, on the training
# set's solutions, before RL begins, which then runs as DAPO (SFT then RL).
Supervise = Literal["adapter", "base", "mixed", "sft_warmup"]
# The mixed objective's weight mu over the run: cosine decay from ``scaffold.mix_mu`` to 0, or constant.
MixSchedule = Literal["cosine", "constant"]
# Per-token weights of the mixed objective's SFT term: none, or CHORD-phi's detached p (1 - p).
SFTTokenWeight = Literal["none", "p1mp"]
# What the RL update trains (``optim.train``): the base's own weights, or a persistent policy adapter of shape
# ``model.policy_lora`` beside a frozen base (LoRA RL), the policy being base + that adapter.
PolicyTraining = Literal["full", "lora"]
# What samples the rollouts: the JAX sampler, or a vLLM engine given the base's weights after each update.
RolloutEngine = Literal["jax", "vllm"]
# Where rollouts sampled ahead are drawn: on the learner's own devices, or on devices of their own beside it.
Placement = Literal["colocated", "split"]
# Training data: the row schema, where the instruction goes, and what a too-long prompt or solution gets.
DataFormat = Literal["auto", "shared", "deepmath"]
InstructionPosition = Literal["after", "before", "none"]
LengthPolicy = Literal["skip", "truncate"]
SolutionField = Literal["r1_solution_1", "r1_solution_2", "r1_solution_3"]
# How a prompt is rendered (``data.template``): the tokenizer's own chat template (``plain`` where it has none),
# DeepSeek-R1-Distill's written out by the project (any tokenizer with its tokens), or no chat markup at all.
PromptTemplate = Literal["tokenizer", "r1", "plain"]
ComputeDtype = Literal["float32", "bfloat16"]
# Rematerialisation of the layer scan: "full" saves only each layer's input and recomputes the rest in the
# backward pass; "dots" also saves the outputs of the weight matmuls (not the attention scores).
Remat = Literal["none", "full", "dots"]
# Attention of cache-free passes: the written-out einsums, jax.nn.dot_product_attention with XLA or cuDNN, the
# blocked attention of ``flash`` (pure JAX, never a [T, T] score matrix), or a vendor kernel with segment ids
# (``kernels``: Pallas on GPUs, splash on TPUs).
Attention = Literal["einsum", "xla", "cudnn", "blocked", "pallas", "splash"]
# Attention of the sampler's decode step over the KV cache (``attention.decode_attend``): the einsums, broadcast
# multiplies and sums (the default: one pass over the cache on every backend), jax.nn.dot_product_attention,
# or the Pallas GPU decode kernel (``kernels.decode_attention``).
DecodeAttention = Literal["einsum", "reduce", "xla", "pallas"]
WandbMode = Literal["online", "offline"]
# The learning rate after the warm-up (``AdamWConfig.schedule``): held, or decayed to ``min_lr_ratio`` of it by a
# half cosine or a straight line (``optim.LR_SCHEDULES``).
LRSchedule = Literal["constant", "cosine", "linear"]
# Schulman's estimators of KL(pi_theta || pi_ref) on tokens sampled from pi_theta, log r = logp_ref - logp_theta
# (``losses.KL_ESTIMATORS``): k3 = r - 1 - log r (unbiased, never negative; verl's low_var_kl, TRL's), k1 = -log r
# (unbiased, high variance), k2 = (log r)^2 / 2 (biased, low variance).
KLEstimator = Literal["k3", "k1", "k2"]
# Where the KL penalty to the reference acts (``loss.kl_in``): a term of the policy loss, differentiated (verl's
# use_kl_loss, TRL's beta), or a detached penalty on each row's reward before the advantages (verl's
# use_kl_in_reward).
KLPlacement = Literal["loss", "reward"]


def choices(option: Any) -> tuple[str, ...]:
    """The values of an option type, in declaration order."""
    return typing.get_args(option)


def require_choice(option: Any, value: Any, key: str) -> None:
    """``value`` is one of ``option``'s values, else a ``ConfigError`` that names ``key``."""
    known = choices(option)
    if value not in known:
        raise ConfigError(f"{key}: must be one of {known}, got {value!r}")


@functools.cache
def _option_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls)
    fields = (f.name for f in dataclasses.fields(cls))
    return tuple((name, hints[name]) for name in fields if typing.get_origin(hints[name]) is Literal)


def check_fields(config: Any, checks: dict[str, tuple[bool, str]]) -> None:
    """``checks``: a field of the dataclass ``config`` -> (whether its value is allowed, what is); the first that is
    not is a ``FieldError`` at ``Owner.field``, which the config reader says at the dotted key."""
    for field, (ok, allowed) in checks.items():
        if not ok:
            raise FieldError(type(config).__name__, field, allowed, getattr(config, field))


def check(config: Any, section: str) -> None:
    """Every option field of the dataclass ``config`` holds one of its values (keys named ``section.field``)."""
    for name, option in _option_fields(type(config)):
        require_choice(option, getattr(config, name), f"{section}.{name}")


def require(ok: bool, key: str, message: str, *value: Any) -> None:
    """A ``ConfigError`` in the config's one dialect unless ``ok``: ``key: what is allowed, got value`` (the value
    left out where the message says it, or where no one value is at fault)."""
    if not ok:
        raise ConfigError(f"{key}: {message}" + (f", got {value[0]!r}" if value else ""))


def require_bound(
    config: Any, section: str, *names: str, low: float = 0, inclusive: bool = False, null: bool = False, why: str = ""
) -> None:
    """Each field ``names`` of the dataclass ``config`` above ``low`` (or at it, where ``inclusive``; or None, where
    ``null``), else a ``ConfigError`` at ``section.name`` (``name`` at the top level, ``section`` empty) that says
    the bound: ``must be positive``, ``must be positive or null``, ``must be >= 0 (0 never compacts)`` (``why``),
    ``must be > 1 or null``."""
    bound = "positive" if (low, inclusive) == (0, False) else f"{'>=' if inclusive else '>'} {low}"
    message = f"must be {bound}" + (" or null" if null else "") + (f" ({why})" if why else "")
    for name in names:
        value = getattr(config, name)
        ok = (null and value is None) or (value is not None and (value >= low if inclusive else value > low))
        require(ok, f"{section}.{name}" if section else name, message, value)


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# ------------------------------------------------------------------------------------------- registries
class Registry(dict):
    """One option axis's strategies by name: ``@REGISTRY.register("loo")`` files a function (or an object) under a
    value of ``option``, and ``REGISTRY.resolve(name)`` is the one place a name becomes its strategy. The suite
    checks that every registry holds exactly its option's values, so a value declared without a strategy (or the
    reverse) fails there, not mid-run."""

    def __init__(self, option: Any, what: str):
        super().__init__()
        self.option, self.what = option, what

    def register(self, name: str):
        def add(strategy):
            if name not in choices(self.option):
                raise ValueError(f"{self.what} {name!r} is not a value of its option {choices(self.option)}")
            if name in self:
                raise ValueError(f"{self.what} {name!r} is registered twice")
            self[name] = strategy
            return strategy

        return add

    def resolve(self, name: Any) -> Any:
        """The strategy named ``name`` (a strategy of this registry, already resolved, is returned as it is); a
        ``ValueError`` naming the known ones otherwise."""
        if not isinstance(name, str) and any(name is strategy for strategy in self.values()):
            return name
        if name not in self:
            raise ValueError(f"unknown {self.what} {name!r}; known: {tuple(self)}")
        return self[name]


# ------------------------------------------------------------------------------------- adapter lifetimes
# Plain objects with no dependencies, here beside their names: the config's checks read them too, and the config
# imports nothing above this module.
class FreshAdapter:
    """The paper's: a fresh adapter (A random, B zero, a new SFT state) every step, never checkpointed."""

    checkpointed = False  # a checkpoint holds the adapter and its SFT state
    scheduled = False  # reset on ``scaffold.reset_every``'s schedule

    def due(self, step: int, last_reset: int | None, reset_every: int | None) -> bool:
        """Whether the step ``step`` starts from a fresh adapter, the last reset having been at ``last_reset``."""
        return True


class PersistentAdapter(FreshAdapter):
    """Kept and fitted further across steps with its own SFT state, checkpointed with the run; reset at its first
    use and then every ``reset_every`` steps (None: never again)."""

    checkpointed = True
    scheduled = True

    def due(self, step: int, last_reset: int | None, reset_every: int | None) -> bool:
        return last_reset is None or (reset_every is not None and step - last_reset >= reset_every)


ADAPTER_LIFETIMES = Registry(AdapterLifetime, "adapter lifetime")
ADAPTER_LIFETIMES.register("fresh")(FreshAdapter())
ADAPTER_LIFETIMES.register("persistent")(PersistentAdapter())


# ------------------------------------------------------------------------------------- evaluation protocols
# Published evaluations whose numbers ``lspo-eval`` is compared with, by name (``eval.protocol``, ``--protocol``).
ProtocolName = Literal["deepscaler", "deepmath", "dapo", "lspo"]


@dataclasses.dataclass(frozen=True)
class EvalProtocol:
    """A published evaluation's sampling: ``n`` samples a problem at ``temperature`` and nucleus ``top_p`` (no
    top-k), each at most ``max_new_tokens`` long. The score it reports is the mean per-sample accuracy,
    ``avg@n = (1 / (P n)) sum_p c_p`` (pass@1 averaged over n samples; ``c_p`` of problem p's n samples pass)."""

    name: str
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    description: str
    source: str

    KEYS = ("n", "temperature", "top_p", "max_new_tokens")  # the ``eval.`` keys a protocol sets

    def settings(self) -> dict[str, Any]:
        """The protocol's values of ``KEYS``."""
        return {key: getattr(self, key) for key in self.KEYS}

    def deviations(self, used: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Each setting of ``used`` (``KEYS`` and ``top_k``) that differs from what the protocol states:
        ``{key: {"protocol": stated, "used": value}}``. A protocol's top-k is 0: none of them truncates to the top k."""
        stated = {**self.settings(), "top_k": 0}
        return {key: {"protocol": stated[key], "used": used[key]} for key in stated
                if key in used and used[key] != stated[key]}  # fmt: skip


# DeepSeek-R1's sampling (DeepSeek-AI 2025, arXiv 2501.12948, section 3.1): temperature 0.6, top-p 0.95, 32,768 tokens.
_R1_SAMPLING = dict(temperature=0.6, top_p=0.95, max_new_tokens=32768)
EVAL_PROTOCOLS = Registry(ProtocolName, "eval protocol")
for _protocol in (
    EvalProtocol("deepscaler", n=16, **_R1_SAMPLING, description="pass@1 averaged over 16 samples a problem at "
                 "DeepSeek-R1's sampling settings", source="DeepScaleR (Luo et al. 2025, agentica-project/rllm), "
                 "DeepSeek-R1 (arXiv 2501.12948) section 3.1"),
    EvalProtocol("deepmath", n=16, **_R1_SAMPLING, description="DeepScaleR's settings, as DeepMath-103K evaluates",
                 source="DeepMath-103K (He et al. 2025, arXiv 2504.11456), evaluation setup"),
    EvalProtocol("dapo", n=32, temperature=1.0, top_p=0.7, max_new_tokens=20480, description="avg@32: AIME "
                 "repeated 32 times, temperature 1.0, top-p 0.7, a 20,480-token generation limit",
                 source="DAPO (Yu et al. 2025, arXiv 2503.14476) section 4"),
    EvalProtocol("lspo", n=16, temperature=1.0, top_p=1.0, max_new_tokens=8192, description="this project's paper "
                 "validation: 16 samples of at most 8192 tokens at temperature 1.0, no nucleus cut",
                 source="the LSPO paper's validation protocol (EvalConfig's defaults)"),
):  # fmt: skip
    EVAL_PROTOCOLS.register(_protocol.name)(_protocol)


def eval_protocol(name: Any, key: str = "eval.protocol") -> EvalProtocol:
    """The protocol named ``name``; a one-line ``ConfigError`` naming ``key``, the value and the known names
    otherwise."""
    if not (isinstance(name, str) and name in EVAL_PROTOCOLS):
        raise ConfigError(f"{key}: must be one of {', '.join(EVAL_PROTOCOLS)} (or null), got {name!r}")
    return EVAL_PROTOCOLS[name]


# ------------------------------------------------------------------------------------------ plug-ins
class PluginImportError(ImportError):
    """A ``module:function`` or ``file.py:function`` path that does not name a callable; the message says why."""


@functools.cache
def load_function(path: str) -> Any:
    """The callable named by ``path``: ``package.module:function`` (imported as usual) or ``path/to/file.py:function``
    (the file run as a module of its own, once per process). Cached: a worker process that scores thousands of
    completions imports the user's module once. ``PluginImportError`` in one line otherwise."""
    import hashlib
    import importlib
    import importlib.util
    import sys
    from pathlib import Path

    where, sep, name = path.rpartition(":")
    if not sep or not where or not name:
        raise PluginImportError("must be package.module:function or path/to/file.py:function")
    try:
        if where.endswith(".py"):
            file = Path(where).expanduser().resolve()
            if not file.is_file():
                raise PluginImportError(f"no such file {where}")
            # A name of its own, never __main__: a script's `if __name__ == "__main__":` block is not run again.
            digest = hashlib.sha256(str(file).encode()).hexdigest()[:12]
            spec = importlib.util.spec_from_file_location(f"lspo_plugin_{file.stem}_{digest}", file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses and pickling look a module up here
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except PluginImportError:
        raise
    except Exception as err:  # the user's module failed at import: its own error, in one line
        raise PluginImportError(f"cannot import {where} ({type(err).__name__}: {err})") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise PluginImportError(f"{where} has no {name!r}")
    if not callable(fn):
        raise PluginImportError(f"{where}:{name} is a {type(fn).__name__}, not a function")
    return fn


# The optimizers' sections sit beside the run's other sections now; their old path here warns for one release.
__getattr__ = moved_names(
    __name__, {name: "optim_config" for name in ("AdamWConfig", "RLOptimConfig", "SFTOptimConfig")}
)
