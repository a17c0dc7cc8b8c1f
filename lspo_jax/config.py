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

from lspo_jax.options import Attention, DecodeAttention, FieldError, Remat, choices

# Projections of a Qwen2 decoder layer that can carry a LoRA adapter (peft's q_proj ... down_proj).
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
    alpha: float = 64.0
    targets: tuple[str, ...] = LORA_TARGETS

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
class ModelConfig:
    """Shape and numerics of a Qwen2 decoder-only model.

    ``param_dtype`` is how weights are stored (float32 master copy for training); ``compute_dtype`` is
    the matmul dtype (bfloat16 on accelerators). Norms, softmax and logits are always float32. ``remat``
    trades compute for activation memory in differentiated passes (one of ``REMAT_POLICIES``). ``attention``
    picks the kernel of cache-free passes (training, log-probs): ``einsum`` (written out, any backend),
    ``xla`` or ``cudnn`` (``jax.nn.dot_product_attention``; cuDNN's fused kernel needs a CUDA GPU and bf16), or
    ``blocked`` (``flash.blocked_attention``: online softmax over blocks, any backend, O(T x block) memory), or
    the vendor kernels with segment ids ``pallas`` (GPU) and ``splash`` (TPU), see ``kernels``.
    ``decode_attention`` picks the sampler's decode-step attention over the KV cache (``DECODE_ATTENTION``).
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
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    remat: str = "none"
    attention: str = "einsum"
    decode_attention: str = "reduce"

    def __post_init__(self) -> None:
        if self.head_dim is None and self.num_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if isinstance(self.lora, dict):
            object.__setattr__(self, "lora", LoraConfig(**self.lora))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value > 0, "ModelConfig", name, "must be a positive int", value)
        _check(self.head_dim > 0, "ModelConfig", "head_dim", "must be positive", self.head_dim)
        _check(
            self.head_dim % 2 == 0,
            "ModelConfig",
            "head_dim",
            "must be even for rotary embeddings",
            self.head_dim,
        )
        _check(
            self.num_heads % self.num_kv_heads == 0,
            "ModelConfig",
            "num_kv_heads",
            f"must divide num_heads={self.num_heads} (grouped-query attention)",
            self.num_kv_heads,
        )
        _check(self.rope_theta > 0, "ModelConfig", "rope_theta", "must be positive", self.rope_theta)
        _check(self.rms_norm_eps > 0, "ModelConfig", "rms_norm_eps", "must be positive", self.rms_norm_eps)
        _check(
            self.max_position_embeddings > 0,
            "ModelConfig",
            "max_position_embeddings",
            "must be positive",
            self.max_position_embeddings,
        )
        for name in ("param_dtype", "compute_dtype"):
            value = getattr(self, name)
            _check(value in _DTYPES, "ModelConfig", name, f"must be one of {_DTYPES}", value)
        _check(isinstance(self.lora, LoraConfig), "ModelConfig", "lora", "must be a LoraConfig", self.lora)
        _check(self.remat in REMAT_POLICIES, "ModelConfig", "remat", f"must be one of {REMAT_POLICIES}", self.remat)
        _check(
            self.attention in ATTENTION_IMPLS,
            "ModelConfig",
            "attention",
            f"must be one of {ATTENTION_IMPLS}",
            self.attention,
        )
        _check(
            self.decode_attention in DECODE_ATTENTION,
            "ModelConfig",
            "decode_attention",
            f"must be one of {DECODE_ATTENTION}",
            self.decode_attention,
        )
        if self.attention == "cudnn":  # the fused kernel's own limits, named here rather than deep in a trace
            _check(
                self.compute_dtype == "bfloat16",
                "ModelConfig",
                "attention",
                "cudnn needs compute_dtype bfloat16",
                self.compute_dtype,
            )
            _check(
                self.head_dim % 8 == 0,
                "ModelConfig",
                "attention",
                "cudnn needs head_dim % 8 == 0",
                self.head_dim,
            )

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
        """Read a Hugging Face ``config.json`` dict of a Qwen2 model; refuse features this model lacks."""
        _check_hf_supported(hf)
        fields = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"),
            rope_theta=float(_hf_rope_theta(hf)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json`` dict that ``transformers.Qwen2Config`` accepts (inverse of ``from_hf_config``)."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
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
            # Older transformers read rope_theta, newer ones rope_parameters; both name the same thing.
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_sliding_window": False,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        }


def _hf_rope_theta(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    return params.get("rope_theta", hf.get("rope_theta", 10000.0))


def _check_hf_supported(hf: dict[str, Any]) -> None:
    """Raise on any Hugging Face config feature that this Qwen2 implementation does not compute."""

    def refuse(key: str, why: str) -> None:
        raise ValueError(f"unsupported Hugging Face config: {key}={hf.get(key)!r} ({why})")

    if hf.get("model_type") != "qwen2":
        refuse("model_type", "only 'qwen2' is implemented")
    if hf.get("use_sliding_window"):
        refuse("use_sliding_window", "sliding-window attention is not implemented")
    if any(kind != "full_attention" for kind in hf.get("layer_types") or ()):
        refuse("layer_types", "only full_attention layers are implemented")
    if hf.get("rope_scaling") is not None:
        refuse("rope_scaling", "rotary scaling (YaRN, linear, dynamic) is not implemented")
    rope_type = (hf.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default":
        refuse("rope_parameters", f"rope_type {rope_type!r} is not implemented, only 'default'")
    if hf.get("attention_bias", True) is not True:
        refuse("attention_bias", "Qwen2 has q/k/v biases; a model without them is not implemented")
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
