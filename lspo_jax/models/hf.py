"""Hugging Face checkpoints of Qwen2, Qwen3 and Llama 3.x <-> our params, through one declarative key table.

A Hugging Face ``nn.Linear`` stores ``weight`` as ``[out, in]`` with heads flattened into one dim; our
weights are ``[in..., out...]`` with heads split out (see ``model.py``), stacked over layers. Each row of
``KEY_TABLE`` says which HF tensor fills which of our arrays and how it is laid out, and which feature of the
family (``config.FAMILIES``) a row needs, if any: the families share every other row. Loading is strict:
an HF key that no row maps, a weight the checkpoint lacks, two HF tensors filling the same array, or a
wrong shape raise an error naming the key. Adapter weights are never written: exports are base-only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from lspo_jax.config import ModelConfig
from lspo_jax.models.specs import Params, param_specs

# How an HF tensor relates to ours. "copy": same layout. "linear": HF [prod(out), prod(in)] is the
# transpose of ours [in..., out...] (n_in leading dims are inputs). "flat": HF [prod(shape)] (biases).
_COPY, _LINEAR, _FLAT = "copy", "linear", "flat"


@dataclasses.dataclass(frozen=True)
class KeyRule:
    """One row of the table: HF name (``{i}`` = layer index) <-> our path under ``params["base"]``; ``needs``
    names the feature without which the model has no such weight (``rules``): the ``ModelConfig`` properties
    ``qkv_bias`` and ``qk_norm``, or ``untied_head``."""

    hf: str
    path: tuple[str, ...]
    layout: str = _COPY
    n_in: int = 1
    needs: str | None = None

    @property
    def layered(self) -> bool:
        return "{i}" in self.hf

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """HF shape of one tensor whose array on our side (one layer's slice) has ``shape``."""
        if self.layout == _LINEAR:
            return (math.prod(shape[self.n_in :]), math.prod(shape[: self.n_in]))
        if self.layout == _FLAT:
            return (math.prod(shape),)
        return shape

    def to_ours(self, array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return array.T.reshape(shape) if self.layout == _LINEAR else array.reshape(shape)

    def to_hf(self, array: np.ndarray) -> np.ndarray:
        if self.layout == _LINEAR:
            return np.ascontiguousarray(array.reshape(math.prod(array.shape[: self.n_in]), -1).T)
        return array.reshape(self.hf_shape(array.shape))


_P = "model.layers.{i}."
KEY_TABLE: tuple[KeyRule, ...] = (
    KeyRule("model.embed_tokens.weight", ("embed",)),
    KeyRule(_P + "input_layernorm.weight", ("layers", "attn_norm")),
    KeyRule(_P + "self_attn.q_proj.weight", ("layers", "q"), _LINEAR),
    KeyRule(_P + "self_attn.q_proj.bias", ("layers", "q_bias"), _FLAT, needs="qkv_bias"),
    KeyRule(_P + "self_attn.k_proj.weight", ("layers", "k"), _LINEAR),
    KeyRule(_P + "self_attn.k_proj.bias", ("layers", "k_bias"), _FLAT, needs="qkv_bias"),
    KeyRule(_P + "self_attn.v_proj.weight", ("layers", "v"), _LINEAR),
    KeyRule(_P + "self_attn.v_proj.bias", ("layers", "v_bias"), _FLAT, needs="qkv_bias"),
    KeyRule(_P + "self_attn.q_norm.weight", ("layers", "q_norm"), needs="qk_norm"),
    KeyRule(_P + "self_attn.k_norm.weight", ("layers", "k_norm"), needs="qk_norm"),
    KeyRule(_P + "self_attn.o_proj.weight", ("layers", "o"), _LINEAR, n_in=2),
    KeyRule(_P + "post_attention_layernorm.weight", ("layers", "mlp_norm")),
    KeyRule(_P + "mlp.gate_proj.weight", ("layers", "gate"), _LINEAR),
    KeyRule(_P + "mlp.up_proj.weight", ("layers", "up"), _LINEAR),
    KeyRule(_P + "mlp.down_proj.weight", ("layers", "down"), _LINEAR),
    KeyRule("model.norm.weight", ("final_norm",)),
    KeyRule("lm_head.weight", ("lm_head",), _LINEAR, needs="untied_head"),
)
# Buffers some older exports contain; they are recomputed from the config, so they are read and dropped.
_DERIVED = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),)
_TIED_HEAD = "lm_head.weight"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def _pattern(rule: KeyRule) -> re.Pattern[str]:
    # Layer indices without leading zeros, so "layers.01" cannot alias "layers.1".
    return re.compile(re.escape(rule.hf).replace(re.escape("{i}"), r"(0|[1-9][0-9]*)"))


def rules(config: ModelConfig) -> list[KeyRule]:
    """The rows of ``KEY_TABLE`` that ``config``'s model has (its family's features, its head): the names and
    layouts of every weight it loads, saves and syncs to an engine."""
    features = {"qkv_bias": config.qkv_bias, "qk_norm": config.qk_norm, "untied_head": not config.tie_word_embeddings}
    return [r for r in KEY_TABLE if r.needs is None or features[r.needs]]


def _get(tree: Params, path: tuple[str, ...]) -> Any:
    for part in path:
        tree = tree[part]
    return tree


# ------------------------------------------------------------------------------------------- loading
def _read_tensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor of a single or sharded safetensors checkpoint, in file order."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        if "model.safetensors" not in files and os.path.exists(os.path.join(path, "model.safetensors")):
            # transformers reads the single file, this reader the shards: two models in one directory, and which
            # one is "the model" depends on who reads it. Neither guess is safe.
            raise ValueError(f"{path} holds both model.safetensors and model.safetensors.index.json (two models); "
                             "remove the stale one")  # fmt: skip
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    for name in files:
        # Shard by shard, so peak host memory is one shard plus the arrays assembled so far.
        yield from load_file(os.path.join(path, name)).items()


def _match(rules: list[KeyRule], patterns: list[re.Pattern[str]], key: str) -> tuple[KeyRule, int | None] | None:
    for rule, pattern in zip(rules, patterns, strict=True):
        m = pattern.fullmatch(key)
        if m:
            return rule, int(m.group(1)) if rule.layered else None
    return None


def _slot_name(slot: tuple[tuple[str, ...], int | None]) -> str:
    path, layer = slot
    return ".".join(path) + ("" if layer is None else f"[{layer}]")


def _check_shape(key: str, rule: KeyRule, array: np.ndarray, shape: tuple[int, ...]) -> None:
    expected = rule.hf_shape(shape)
    if tuple(array.shape) != expected:
        raise ValueError(f"wrong shape for {key}: expected {expected}, got {tuple(array.shape)}")


def _collect(config: ModelConfig, tensors: Iterator[tuple[str, np.ndarray]], dtype: Any) -> dict[Any, np.ndarray]:
    """Place every HF tensor at (our path, layer) in our layout; strict about unmapped and duplicate keys."""
    specs = param_specs(config)["base"]
    own = rules(config)
    patterns = [_pattern(r) for r in own]
    slots: dict[Any, np.ndarray] = {}
    sources: dict[Any, str] = {}
    tied_head = None
    for key, array in tensors:
        if any(p.fullmatch(key) for p in _DERIVED):
            continue
        if config.tie_word_embeddings and key == _TIED_HEAD:
            tied_head = array
            continue
        found = _match(own, patterns, key)
        if found is None or (found[1] is not None and found[1] >= config.num_layers):
            raise ValueError(f"unmapped key {key!r}: no entry of the conversion table matches it")
        rule, layer = found
        slot = (rule.path, layer)
        if slot in sources:
            raise ValueError(f"duplicate target {_slot_name(slot)}: filled by {sources[slot]!r} and {key!r}")
        shape = _get(specs, rule.path).shape
        shape = shape[1:] if rule.layered else shape
        _check_shape(key, rule, array, shape)
        slots[slot], sources[slot] = rule.to_ours(array, shape).astype(dtype), key
    _check_tied_head(slots, tied_head)
    return slots


def _check_tied_head(slots: dict[Any, np.ndarray], head: np.ndarray | None) -> None:
    # Tied checkpoints may still store lm_head.weight; it must then be the embedding itself.
    if head is None:
        return
    embed = slots.get((("embed",), None))
    if embed is None or head.shape != embed.shape or not np.array_equal(head.astype(embed.dtype), embed):
        raise ValueError(f"{_TIED_HEAD} differs from model.embed_tokens.weight but tie_word_embeddings is true")


def _assemble(config: ModelConfig, slots: dict[Any, np.ndarray]) -> Params:
    """Stack per-layer arrays on the L axis and nest them as ``params["base"]``; error on a missing weight."""
    base: Params = {}
    for rule in rules(config):
        layers = range(config.num_layers) if rule.layered else [None]
        missing = [rule.hf.format(i=i) for i in layers if (rule.path, i) not in slots]
        if missing:
            raise ValueError(f"missing weight {missing[0]!r} ({len(missing)} missing for {'.'.join(rule.path)})")
        parts = [slots.pop((rule.path, i)) for i in layers]
        node = base
        for part in rule.path[:-1]:
            node = node.setdefault(part, {})
        node[rule.path[-1]] = jnp.asarray(np.stack(parts) if rule.layered else parts[0])
    return base


def load_tokenizer(path: str) -> Any:
    """The tokenizer saved in the model directory ``path``.

    Without tokenizer files transformers still builds one, which encodes every text to nothing, so every prompt
    would be empty; that is an error here, naming the directory.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if not tokenizer.encode("1+1=2", add_special_tokens=False):
        raise FileNotFoundError(f"{path}: no usable tokenizer (it encodes text to nothing); save it with the model")
    return tokenizer


def load_pretrained(path: str, dtype: Any = jnp.float32) -> tuple[ModelConfig, Params]:
    """Read a local Hugging Face directory of one of ``config.FAMILIES`` -> ``(ModelConfig, {"base": params})``,
    weights in ``dtype``.

    No adapter is created; add one with ``specs.init_lora``.
    """
    if not os.path.isfile(os.path.join(path, "config.json")):
        what = "no such directory" if not os.path.isdir(path) else "no config.json in it"
        raise FileNotFoundError(f"{path}: not a Hugging Face model directory ({what})")
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    dtype = jnp.dtype(dtype)
    config = ModelConfig.from_hf_config(hf_config, param_dtype=dtype.name)
    slots = _collect(config, _read_tensors(path), dtype)
    return config, {"base": _assemble(config, slots)}


# ------------------------------------------------------------------------------------------- saving
def _base_of(params: Params) -> Params:
    # Accept the full {"base", "lora"} tree or a bare base (what merge_lora returns).
    return params["base"] if "base" in params else params


def to_hf_state_dict(config: ModelConfig, params: Params) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(hf_name, numpy array)`` in HF layout, one tensor at a time (base only, never the adapter).

    Tensors come embeddings first, then layer by layer, then the final norm and head, so a consumer can
    stream them without holding a second copy of the model.
    """
    base = _base_of(params)
    own = rules(config)
    for rule in (r for r in own if not r.layered and r.path == ("embed",)):
        yield rule.hf, rule.to_hf(np.asarray(_get(base, rule.path)))
    for i in range(config.num_layers):
        for rule in (r for r in own if r.layered):
            yield rule.hf.format(i=i), rule.to_hf(np.asarray(_get(base, rule.path)[i]))
    for rule in (r for r in own if not r.layered and r.path != ("embed",)):
        yield rule.hf, rule.to_hf(np.asarray(_get(base, rule.path)))


def save_pretrained(
    path: str, config: ModelConfig, params: Params, *, tokenizer_from: str | None = None,
    check: Callable[[], None] | None = None,
) -> None:  # fmt: skip
    """Write ``config.json``, ``model.safetensors`` (the params' dtype) and ``generation_config.json`` so
    that ``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads the base model.

    ``params["lora"]`` is ignored (merge it first with ``lora.merge_lora`` if wanted). Tokenizer files
    present in ``tokenizer_from`` are copied alongside. ``check`` is called after each tensor is gathered and each
    file written, and may raise to end the writing there (a stop: the caller removes what was written).
    """
    os.makedirs(path, exist_ok=True)
    tensors = dict(checked(to_hf_state_dict(config, params), check))
    dtype = next(iter(tensors.values())).dtype
    # "format": "pt" is what transformers expects in the safetensors metadata of a PyTorch checkpoint.
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    check = check or (lambda: None)
    check()
    _remove_sharded_checkpoint(path)
    hf_config = {**config.to_hf_config(), "dtype": np.dtype(dtype).name, "torch_dtype": np.dtype(dtype).name}
    _write_json(os.path.join(path, "config.json"), hf_config)
    if config.bos_token_id is not None or config.eos_token_id is not None:
        generation = {"bos_token_id": config.bos_token_id, "eos_token_id": hf_config["eos_token_id"]}
        _write_json(os.path.join(path, "generation_config.json"), generation)
    check()
    if tokenizer_from is not None:
        _copy_tokenizer(tokenizer_from, path, check)


def checked(items: Iterable, check: Callable[[], None] | None) -> Iterator:
    """``items``, with ``check()`` called after each: each tensor is a device-to-host copy, the piece a stop waits
    for."""
    for item in items:
        yield item
        if check is not None:
            check()


def _remove_sharded_checkpoint(path: str) -> None:
    """Remove a sharded checkpoint that an earlier writer left in ``path``: its index and the shards it names.
    Readers that prefer the index (this module's, vLLM's) would load its old weights, while transformers loads the
    new ``model.safetensors``: the same directory would be two models."""
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index):
        return
    try:
        with open(index) as f:
            shards = set(json.load(f)["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # a damaged index: remove it alone
        shards = set()
    os.remove(index)
    for name in shards:
        shard = os.path.join(path, os.path.basename(str(name)))
        if os.path.basename(shard) != "model.safetensors" and os.path.isfile(shard):
            os.remove(shard)


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def _copy_tokenizer(src: str, dst: str, check: Callable[[], None] = lambda: None) -> None:
    if os.path.abspath(src) == os.path.abspath(dst):
        return
    for name in _TOKENIZER_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
            check()
