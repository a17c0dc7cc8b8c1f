"""LoRA RL's policy adapter -> a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``).

peft stores a LoRA adapter of a ``transformers`` model as two tensors per wrapped ``nn.Linear``, named after the
module path under ``base_model.model`` with the adapter's name dropped on save:
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ``[r, in_features]`` and ``...lora_B.weight``
``[out_features, r]``, and the layer computes ``W x + (lora_alpha / r) B A x`` in Hugging Face's ``[out, in]``
layout. Ours (``model.py``) are ``A [L, in..., R]`` and ``B [L, R, out...]`` with ``y = x W + c (x A) B``, so peft's
``lora_A`` is our A of layer i flattened to ``[in, R]`` and transposed, ``lora_B`` our B flattened to ``[R, out]`` and
transposed; the module paths are ``hf.KEY_TABLE``'s, so the names cannot drift from the base's.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from lspo_jax.config import LoraConfig, ModelConfig
from lspo_jax.models import hf
from lspo_jax.models.specs import Params

_PREFIX = "base_model.model."
_WEIGHT = ".weight"


def _target_rules(config: ModelConfig) -> dict[str, hf.KeyRule]:
    """Our projection name (``q``, ..., ``down``) -> its ``hf.KEY_TABLE`` row (its HF module path and layout)."""
    return {r.path[1]: r for r in hf.rules(config) if r.path[:1] == ("layers",) and r.layout == "linear"}


def module_names(config: ModelConfig, adapter: LoraConfig) -> list[str]:
    """peft's ``target_modules`` for ``adapter``'s targets: the HF modules' own names (``q_proj``, ``down_proj``)."""
    rules = _target_rules(config)
    return [rules[name].hf.removesuffix(_WEIGHT).rsplit(".", 1)[1] for name in adapter.targets]


def adapter_state_dict(config: ModelConfig, adapter: LoraConfig, tree: Params) -> Iterator[tuple[str, np.ndarray]]:
    """``(peft name, array)`` of every ``lora_A`` and ``lora_B`` of ``tree`` (the policy adapter, stacked over
    layers), layer by layer."""
    rules = _target_rules(config)
    for i in range(config.num_layers):
        for name in adapter.targets:
            rule, a, b = rules[name], np.asarray(tree[name]["a"][i]), np.asarray(tree[name]["b"][i])
            module = _PREFIX + rule.hf.format(i=i).removesuffix(_WEIGHT)
            yield f"{module}.lora_A.weight", np.ascontiguousarray(a.reshape(math.prod(a.shape[:-1]), -1).T)
            yield f"{module}.lora_B.weight", np.ascontiguousarray(b.reshape(b.shape[0], -1).T)


def adapter_config(config: ModelConfig, adapter: LoraConfig, base_model: str) -> dict[str, Any]:
    """The ``adapter_config.json`` peft's ``LoraConfig`` reads: rank, alpha and target modules; no dropout, no bias,
    the plain ``alpha / r`` scale (not rsLoRA's), ``fan_in_fan_out`` false (``nn.Linear``'s ``[out, in]``)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": adapter.rank, "lora_alpha": adapter.alpha, "target_modules": module_names(config, adapter),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
    }  # fmt: skip


def save_adapter(
    path: str, config: ModelConfig, params: Params, *, base_model: str, check: Callable[[], None] | None = None
) -> None:
    """Write ``params["policy"]`` (shape ``config.policy_lora``) as a PEFT adapter directory at ``path``, float32;
    ``base_model`` is the base it was trained on (peft's ``base_model_name_or_path``). ``check``: as
    ``hf.save_pretrained``'s, after each tensor and file."""
    adapter = config.policy_lora
    if adapter is None or "policy" not in params:
        raise ValueError("no policy adapter to write: the run trained the base (optim.train: full)")
    os.makedirs(path, exist_ok=True)
    tensors = {
        k: v.astype(np.float32) for k, v in hf.checked(adapter_state_dict(config, adapter, params["policy"]), check)
    }
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    if check is not None:
        check()
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(adapter_config(config, adapter, base_model), f, indent=2, sort_keys=True)
        f.write("\n")
