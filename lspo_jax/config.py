"""Configuration as frozen dataclasses.

Every class checks its fields in ``__post_init__`` and names the bad field in the error, so a typo in a
YAML file fails at load time rather than deep inside a jitted function. YAML (or any dict) only
serialises these classes; the classes are the source of truth.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from lspo_jax.options import Attention, DecodeAttention, FieldError, Remat, check_fields, choices

# Projections of a decoder layer that can carry a LoRA adapter (peft's q_proj ... down_proj).
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
_DTYPES = ("float32", "bfloat16", "float16")
# The kernels and rematerialisation policies, declared with what each does in ``options``.
REMAT_POLICIES = choices(Remat)
ATTENTION_IMPLS = choices(Attention)
DECODE_ATTENTION = choices(DecodeAttention)


def cache_root() -> Path:
    """The project's cache directory (compiled programs, example stores, downloaded files):
    ``$LSPO_JAX_CACHE``, else ``$XDG_CACHE_HOME/lspo_jax``, else ``~/.cache/lspo_jax``."""
    if root := os.environ.get("LSPO_JAX_CACHE"):
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "lspo_jax"


def _check(ok: bool, cls: str, field: str, allowed: str, value: Any) -> None:
    if not ok:
        raise FieldError(cls, field, allowed, value)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapter ``W + (alpha / rank) * s * B A`` on the projections named in ``targets``.

    ``s`` is the run-time ``lora_scale`` passed to the forward pass (0 switches the adapter off).
    """

    rank: int = 16
    """The rank of the low-rank adapter `W + (alpha / rank) * s * B A`."""
    alpha: float = 64.0
    """The adapter's `alpha`: `B A` is scaled by `alpha / rank` (4.0 at rank 16, alpha 64)."""
    targets: tuple[str, ...] = LORA_TARGETS
    """The projections of each decoder layer that carry the adapter (peft's `q_proj` ... `down_proj`)."""

    def __post_init__(self) -> None:
        # YAML gives lists; a tuple keeps the dataclass hashable (configs are static jit arguments).
        object.__setattr__(self, "targets", tuple(self.targets))
        _check(
            isinstance(self.rank, int) and self.rank > 0,
            "LoraConfig",
            "rank",
            "must be a positive int",
            self.rank,
        )
        _check(self.alpha > 0, "LoraConfig", "alpha", "must be positive", self.alpha)
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        _check(
            not unknown,
            "LoraConfig",
            "targets",
            f"unknown target(s) {unknown}; known: {list(LORA_TARGETS)}",
            self.targets,
        )
        _check(
            len(set(self.targets)) == len(self.targets), "LoraConfig", "targets", "must not repeat one", self.targets
        )

    @property
    def scale(self) -> float:
        """alpha / rank, the fixed multiplier of ``B A`` (4.0 for the paper's rank 16, alpha 64)."""
        return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class Family:
    """What sets a Hugging Face model family apart in this one decoder: its ``config.json`` names and the features
    of its attention. The layer is otherwise shared: pre-norm RMSNorm, grouped-query attention with RoPE, SiLU-gated
    MLP, tied or untied head. A new family is a row of ``FAMILIES`` (and of ``hf.KEY_TABLE`` for new weights)."""

    architecture: str  # config.json's "architectures"; the key of FAMILIES is its "model_type"
    qkv_bias: bool  # biases on the q, k and v projections (Qwen2)
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (Qwen3)
    attention_bias: bool | None  # config.json's attention_bias it must have (None: the family has no such key)
    hf_fields: tuple[tuple[str, Any], ...] = ()  # further config.json keys transformers reads, at their values


FAMILIES = {
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True, qk_norm=False, attention_bias=None,
                    hf_fields=(("use_sliding_window", False),)),
    "qwen3": Family("Qwen3ForCausalLM", qkv_bias=False, qk_norm=True, attention_bias=False,
                    hf_fields=(("use_sliding_window", False), ("attention_bias", False))),
    "llama": Family("LlamaForCausalLM", qkv_bias=False, qk_norm=False, attention_bias=False,
                    hf_fields=(("attention_bias", False), ("mlp_bias", False))),
}  # fmt: skip
_ARCHITECTURES = {family.architecture: name for name, family in FAMILIES.items()}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3's remapping of the rotary frequencies (``rope_type: llama3``, ``layer.rope_frequencies``): wavelengths
    longer than ``original_max_position_embeddings / low_freq_factor`` are stretched by ``factor``, those shorter than
    ``... / high_freq_factor`` kept, and the band between interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            _check(getattr(self, name) > 0, "RopeScaling", name, "must be positive", getattr(self, name))
        _check(
            self.high_freq_factor > self.low_freq_factor,
            "RopeScaling",
            "high_freq_factor",
            f"must exceed low_freq_factor={self.low_freq_factor}",
            self.high_freq_factor,
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only model of one of ``FAMILIES`` (Qwen2, Qwen3, Llama 3.x).

    ``family`` is static (a config is a static jit argument): the forward pass branches on it at trace time, so a
    Qwen2 program holds no trace of the others' features. ``rope_scaling`` (None: plain RoPE) is Llama 3's.

    ``param_dtype`` is how weights are stored (float32 master copy for training); ``compute_dtype`` is
    the matmul dtype (bfloat16 on accelerators). Norms, softmax and logits are always float32. ``remat``
    trades compute for activation memory in differentiated passes (one of ``REMAT_POLICIES``). ``attention``
    picks the kernel of cache-free passes (training, log-probs): ``einsum`` (written out, any backend),
    ``xla`` or ``cudnn`` (``jax.nn.dot_product_attention``; cuDNN's fused kernel needs a CUDA GPU and bf16), or
    ``blocked`` (``flash.blocked_attention``: online softmax over blocks, any backend, O(T x block) memory), or
    the vendor kernels with segment ids ``pallas`` (GPU) and ``splash`` (TPU), see ``kernels``.
    ``decode_attention`` picks the sampler's decode-step attention over the KV cache (``DECODE_ATTENTION``).
    ``lora`` is the scaffold's transient adapter (switched by the forward's ``lora_scale``); ``policy_lora``, when
    set, the shape of a persistent policy adapter that every pass applies (LoRA RL, ``optim.train: lora``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    policy_lora: LoraConfig | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    remat: str = "none"
    attention: str = "einsum"
    decode_attention: str = "reduce"
    family: str = "qwen2"
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        self._read_nested()
        _check(self.family in FAMILIES, "ModelConfig", "family", f"must be one of {list(FAMILIES)}", self.family)
        _check(self.rope_scaling is None or isinstance(self.rope_scaling, RopeScaling), "ModelConfig", "rope_scaling",
               "must be a RopeScaling or null", self.rope_scaling)  # fmt: skip
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value > 0, "ModelConfig", name, "must be a positive int", value)
        _check(self.head_dim > 0, "ModelConfig", "head_dim", "must be positive", self.head_dim)
        check_fields(self, {
            "head_dim": (self.head_dim % 2 == 0, "must be even for rotary embeddings"),
            "num_kv_heads": (self.num_heads % self.num_kv_heads == 0,
                             f"must divide num_heads={self.num_heads} (grouped-query attention)"),
            "rope_theta": (self.rope_theta > 0, "must be positive"),
            "rms_norm_eps": (self.rms_norm_eps > 0, "must be positive"),
            "max_position_embeddings": (self.max_position_embeddings > 0, "must be positive"),
            "param_dtype": (self.param_dtype in _DTYPES, f"must be one of {_DTYPES}"),
            "compute_dtype": (self.compute_dtype in _DTYPES, f"must be one of {_DTYPES}"),
            "lora": (isinstance(self.lora, LoraConfig), "must be a LoraConfig"),
            "policy_lora": (self.policy_lora is None or isinstance(self.policy_lora, LoraConfig),
                            "must be a LoraConfig or None"),
            "remat": (self.remat in REMAT_POLICIES, f"must be one of {REMAT_POLICIES}"),
            "attention": (self.attention in ATTENTION_IMPLS, f"must be one of {ATTENTION_IMPLS}"),
            "decode_attention": (self.decode_attention in DECODE_ATTENTION, f"must be one of {DECODE_ATTENTION}"),
        })  # fmt: skip
        if self.attention == "cudnn":  # the fused kernel's own limits, named here rather than deep in a trace
            _check(self.compute_dtype == "bfloat16", "ModelConfig", "attention", "cudnn needs compute_dtype bfloat16",
                   self.compute_dtype)  # fmt: skip
            _check(self.head_dim % 8 == 0, "ModelConfig", "attention", "cudnn needs head_dim % 8 == 0", self.head_dim)

    def _read_nested(self) -> None:
        """The fields a dict or a list may give (``from_hf_config``, a YAML file) as their classes and tuples, and a
        null ``head_dim`` as ``hidden_size / num_heads``; frozen: set once, while the config is being built."""
        if self.head_dim is None and self.num_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        for name, cls in (("lora", LoraConfig), ("policy_lora", LoraConfig), ("rope_scaling", RopeScaling)):
            if isinstance(getattr(self, name), dict):
                object.__setattr__(self, name, cls(**getattr(self, name)))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    @property
    def qkv_bias(self) -> bool:
        """Whether the q, k and v projections carry biases (``FAMILIES``)."""
        return FAMILIES[self.family].qkv_bias

    @property
    def qk_norm(self) -> bool:
        """Whether q and k are RMS-normed per head before RoPE (``FAMILIES``)."""
        return FAMILIES[self.family].qk_norm

    # ----------------------------------------------------------------------------------------- presets
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named model shape, with optional field overrides (e.g. ``compute_dtype="bfloat16"``)."""
        if name not in _PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {sorted(_PRESETS)}")
        return dataclasses.replace(_PRESETS[name], **overrides)

    # ---------------------------------------------------------------------------- Hugging Face config
    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], **overrides: Any) -> ModelConfig:
        """Read a Hugging Face ``config.json`` dict of one of ``FAMILIES``; refuse features this model lacks."""
        family = hf_family(hf)
        _check_hf_supported(hf, family)
        fields = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"),
            rope_theta=float(_hf_rope(hf).get("rope_theta", 10000.0)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            family=family,
            rope_scaling=_hf_rope_scaling(hf),
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json`` dict that transformers' config class of ``family`` accepts (inverse of
        ``from_hf_config``)."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        family = FAMILIES[self.family]
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {"rope_type": "llama3", "rope_theta": self.rope_theta, **dataclasses.asdict(self.rope_scaling)}
        hf = {
            "architectures": [family.architecture],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            # Older transformers (and vLLM) read rope_theta and rope_scaling, newer ones rope_parameters; each pair
            # names the same thing.
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            **({"rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}} if self.rope_scaling else {}),
            "tie_word_embeddings": self.tie_word_embeddings,
            **dict(family.hf_fields),
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        }
        return hf


def hf_family(hf: dict[str, Any]) -> str:
    """The ``FAMILIES`` name of a Hugging Face ``config.json`` dict: its ``model_type``, else its ``architectures``;
    refused in one line naming what is supported."""
    model_type = hf.get("model_type")
    if model_type is None:
        architectures = hf.get("architectures") or [None]
        model_type = _ARCHITECTURES.get(architectures[0], architectures[0])
        what = f"architecture {architectures[0]!r}"
    else:
        what = f"model_type {model_type!r}"
    if model_type not in FAMILIES:
        raise ValueError(f"{what} is not supported; supported: {', '.join(FAMILIES)}")
    return model_type


def _hf_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """The rotary parameters of a config.json: ``rope_parameters`` (transformers 5) over the older ``rope_scaling``
    (whose type key was ``type`` before ``rope_type``) and ``rope_theta``."""
    older = dict(hf.get("rope_scaling") or {})
    if "type" in older:
        older.setdefault("rope_type", older.pop("type"))
    if "rope_theta" in hf:
        older.setdefault("rope_theta", hf["rope_theta"])
    return {"rope_type": "default", **older, **(hf.get("rope_parameters") or {})}


def _rope_type(rope: dict[str, Any]) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def _hf_rope_scaling(hf: dict[str, Any]) -> RopeScaling | None:
    rope = _hf_rope(hf)
    if rope["rope_type"] != "llama3":
        return None
    names = [f.name for f in dataclasses.fields(RopeScaling)]
    missing = [name for name in names if name not in rope]
    if missing:
        raise ValueError(f"unsupported Hugging Face config: rope_type 'llama3' without {missing[0]!r}")
    return RopeScaling(**{name: rope[name] for name in names})


def _check_hf_supported(hf: dict[str, Any], family: str) -> None:
    """Raise on any Hugging Face config feature that this implementation of ``family`` does not compute."""

    def refuse(key: str, why: str) -> None:
        raise ValueError(f"unsupported Hugging Face config: {key}={hf.get(key)!r} ({why})")

    if hf.get("use_sliding_window"):
        refuse("use_sliding_window", "sliding-window attention is not implemented")
    if any(kind != "full_attention" for kind in hf.get("layer_types") or ()):
        refuse("layer_types", "only full_attention layers are implemented")
    kinds = {key: _rope_type(hf[key]) for key in ("rope_scaling", "rope_parameters") if hf.get(key)}
    for key, kind in kinds.items():
        if kind not in ("default", "llama3"):
            refuse(key, f"rope_type {kind!r} is not implemented, only 'default' and 'llama3'")
    if len(set(kinds.values())) > 1:
        refuse("rope_scaling", f"its rope_type disagrees with rope_parameters' {kinds['rope_parameters']!r}")
    if _hf_rope(hf).get("partial_rotary_factor", 1.0) != 1.0:
        refuse("rope_parameters", "partial rotary embeddings are not implemented")
    bias = FAMILIES[family].attention_bias
    if bias is None and hf.get("attention_bias", True) is not True:
        refuse("attention_bias", f"{family} has q/k/v biases; a model without them is not implemented")
    if bias is False and hf.get("attention_bias", False) is not False:
        refuse("attention_bias", f"{family} with attention biases (o_proj's included) is not implemented")
    if hf.get("mlp_bias", False):
        refuse("mlp_bias", "MLP biases are not implemented")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "only the SiLU-gated MLP is implemented")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in hf:
            raise ValueError(f"Hugging Face config lacks required field {key!r}")


_PRESETS = {
    # DeepSeek-R1-Distill-Qwen-1.5B (1,777,088,000 parameters, untied lm head).
    "deepseek-r1-distill-qwen-1.5b": ModelConfig(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        bos_token_id=151646,
        eos_token_id=151643,
    ),
    # DeepSeek-R1-Distill-Qwen-7B (7,615,616,512 parameters, untied lm head): LoRA RL's larger shape.
    "deepseek-r1-distill-qwen-7b": ModelConfig(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        bos_token_id=151646,
        eos_token_id=151643,
    ),
    # Qwen3-1.7B (1,720,574,976 parameters, tied head; q/k norms, head_dim 128 = hidden 2048 / 16 heads).
    "qwen3-1.7b": ModelConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        bos_token_id=151643,
        eos_token_id=151645,
        family="qwen3",
    ),
    # Llama-3.2-1B and its Instruct (1,235,814,400 parameters, tied head; llama3 rope scaling).
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_id=(128001, 128008, 128009),
        family="llama",
        rope_scaling=RopeScaling(
            factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
        ),
    ),
    # A model small enough for unit tests on a laptop CPU; same structure (GQA, biases, untied head).
    "tiny": ModelConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        lora=LoraConfig(rank=4, alpha=16.0),
    ),
}


# Hub names whose published shapes are presets: what tools that never download a model (``tools.lower_check``)
# compile a recipe at. Their config.json files say the same; the parity tests hold the families to transformers.
HUB_PRESETS = {
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": "deepseek-r1-distill-qwen-1.5b",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": "deepseek-r1-distill-qwen-7b",
    "Qwen/Qwen3-1.7B": "qwen3-1.7b",
    "meta-llama/Llama-3.2-1B": "llama-3.2-1b",
    "meta-llama/Llama-3.2-1B-Instruct": "llama-3.2-1b",
}
