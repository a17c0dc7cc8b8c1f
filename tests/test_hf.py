"""Parity with transformers' Qwen2 and strict checkpoint conversion (the reference nobody here wrote)."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import assert_close_relative
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from lspo_jax.config import ModelConfig
from lspo_jax.models.hf import load_pretrained, load_tokenizer, save_pretrained, to_hf_state_dict
from lspo_jax.models.model import forward
from lspo_jax.models.specs import init_lora

_forward = jax.jit(forward, static_argnums=0)


def _hf_logits(path: str, tokens: np.ndarray, mask: np.ndarray, dtype=torch.float32) -> np.ndarray:
    """transformers' logits; positions passed explicitly as cumsum(mask) - 1 >= 0, which is what its
    generate() uses for left padding (a bare forward would count pads as positions)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(tokens).long(),
            attention_mask=torch.from_numpy(mask).long(),
            position_ids=torch.from_numpy(positions).long(),
        )
    return out.logits.float().numpy()


@pytest.fixture(scope="module")
def hf_reference(hf_model_dir, left_padded_batch):
    """(dir, our config, our params, transformers' logits) for each tiny checkpoint."""
    tokens, mask = left_padded_batch
    config, params = load_pretrained(hf_model_dir)
    return hf_model_dir, config, params, _hf_logits(hf_model_dir, tokens, mask)


# ----------------------------------------------------------------------------------------------- parity
def test_logits_match_transformers_on_left_padded_batch(hf_reference, left_padded_batch):
    path, config, params, ref = hf_reference
    tokens, mask = left_padded_batch
    assert config.tie_word_embeddings == ("lm_head" not in params["base"])
    ours = np.asarray(_forward(config, params, tokens, mask))
    real = mask == 1
    assert np.abs(ref[real]).max() > 1.0  # weights are wide enough that a layout bug cannot hide
    # Two float32 implementations (XLA against torch) of two layers: rounding is ~5e-7 of the logits' norm.
    assert_close_relative(ours[real], ref[real], 2e-5)


def test_export_loads_in_transformers_and_round_trips(hf_reference, left_padded_batch, tmp_path):
    path, config, params, _ = hf_reference
    tokens, mask = left_padded_batch
    with_adapter = {**params, "lora": init_lora(config, jax.random.key(0))}
    save_pretrained(str(tmp_path), config, with_adapter, tokenizer_from=path)
    assert not any("lora" in k for k in load_file(str(tmp_path / "model.safetensors")))  # base only
    ours = np.asarray(_forward(config, params, tokens, mask))
    real = mask == 1
    assert_close_relative(_hf_logits(str(tmp_path), tokens, mask)[real], ours[real], 2e-5)  # as in the parity test
    config2, params2 = load_pretrained(str(tmp_path))
    assert config2 == config
    jax.tree.map(np.testing.assert_array_equal, params2, params)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.decode(tok("1+1=2").input_ids) == "1+1=2"


def test_state_dict_matches_transformers_names_and_values(hf_reference):
    path, config, params, _ = hf_reference
    hf_state = load_file(os.path.join(path, "model.safetensors"))
    ours = dict(to_hf_state_dict(config, params))
    assert set(ours) == set(hf_state) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    for name, array in ours.items():
        np.testing.assert_array_equal(array, hf_state[name], err_msg=name)


def test_bfloat16_export_loads_in_transformers(hf_untied_dir, tmp_path):
    config, params = load_pretrained(hf_untied_dir, dtype=jnp.bfloat16)
    assert config.param_dtype == "bfloat16" and params["base"]["layers"]["q"].dtype == jnp.bfloat16
    save_pretrained(str(tmp_path), config, params)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert model.dtype == torch.bfloat16
    expected = np.asarray(params["base"]["embed"].astype(jnp.float32))
    np.testing.assert_array_equal(model.model.embed_tokens.weight.detach().float().numpy(), expected)


def test_sharded_checkpoint_loads(hf_untied_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(hf_untied_dir)
    model.save_pretrained(str(tmp_path), max_shard_size="100KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    _, sharded = load_pretrained(str(tmp_path))
    _, single = load_pretrained(hf_untied_dir)
    jax.tree.map(np.testing.assert_array_equal, sharded, single)


def test_writing_over_a_sharded_checkpoint_leaves_only_the_new_weights(hf_untied_dir, tmp_path):
    """A directory that held a sharded model: its index and shards go, so every reader loads what was written."""
    AutoModelForCausalLM.from_pretrained(hf_untied_dir).save_pretrained(str(tmp_path), max_shard_size="100KB")
    shards = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) > 1
    config, params = load_pretrained(hf_untied_dir)
    changed = jax.tree.map(lambda x: x + 1.0, params)
    save_pretrained(str(tmp_path), config, changed)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors*")) == ["model.safetensors"]
    _, ours = load_pretrained(str(tmp_path))
    jax.tree.map(np.testing.assert_array_equal, ours, {"base": changed["base"]})
    embed = AutoModelForCausalLM.from_pretrained(str(tmp_path)).model.embed_tokens.weight.detach().numpy()
    np.testing.assert_array_equal(embed, np.asarray(changed["base"]["embed"]))


def test_a_directory_holding_a_single_file_and_an_index_is_refused(hf_untied_dir, tmp_path):
    """transformers reads model.safetensors, an index reader the shards: two models, and no reader may pick one."""
    AutoModelForCausalLM.from_pretrained(hf_untied_dir).save_pretrained(str(tmp_path), max_shard_size="100KB")
    shutil.copy(os.path.join(hf_untied_dir, "model.safetensors"), tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="holds both model.safetensors and model.safetensors.index.json"):
        load_pretrained(str(tmp_path))


# ------------------------------------------------------------------------------------------- bad input
def _tampered_copy(src: str, dst, edit) -> str:
    """Copy a checkpoint directory, applying ``edit`` to its tensor dict."""
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


_Q0 = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing weight 'model.layers.1.mlp.up_proj.weight'"),
        (lambda t: t.update({"model.layers.0.mlp.extra.weight": t[_Q0]}), "unmapped key 'model.layers.0.mlp.extra"),
        (lambda t: t.update({"model.layers.2.input_layernorm.weight": t["model.norm.weight"]}), "unmapped key"),
        (
            lambda t: t.update({_Q0: t[_Q0][:, :32].copy()}),
            rf"wrong shape for {_Q0}: expected \(64, 64\), got \(64, 32\)",
        ),
        (lambda t: t.update({"model.layers.01.input_layernorm.weight": t["model.norm.weight"]}), "unmapped key"),
    ],
    ids=["missing", "unmapped", "layer_out_of_range", "wrong_shape", "leading_zero"],
)
def test_bad_checkpoint_is_an_error_naming_the_key(hf_untied_dir, tmp_path, edit, message):
    path = _tampered_copy(hf_untied_dir, tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=message):
        load_pretrained(path)


def test_duplicate_target_across_shards_is_an_error(hf_untied_dir, tmp_path):
    # Two shards that both hold the embedding: the second would silently overwrite the first.
    path = _tampered_copy(hf_untied_dir, tmp_path / "dup", lambda t: None)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    save_file(
        {"model.embed_tokens.weight": tensors["model.embed_tokens.weight"]}, os.path.join(path, "extra.safetensors")
    )
    weight_map = dict.fromkeys(tensors, "model.safetensors") | {"model.embed_tokens.weight": "extra.safetensors"}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with pytest.raises(
        ValueError,
        match="duplicate target embed: filled by 'model.embed_tokens.weight' and 'model.embed_tokens.weight'",
    ):
        load_pretrained(path)


def test_tied_lm_head_must_equal_embedding(hf_tied_dir, tmp_path):
    embed_key = "model.embed_tokens.weight"
    same = _tampered_copy(hf_tied_dir, tmp_path / "same", lambda t: t.update({"lm_head.weight": t[embed_key].copy()}))
    load_pretrained(same)  # a stored copy of the tied head is accepted
    other = _tampered_copy(hf_tied_dir, tmp_path / "other", lambda t: t.update({"lm_head.weight": t[embed_key] + 1}))
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        load_pretrained(other)


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "key, value, message",
    [
        ("use_sliding_window", True, "use_sliding_window=True.*sliding-window"),
        ("rope_scaling", {"type": "yarn", "factor": 4.0}, "rope_scaling"),
        (
            "rope_parameters",
            {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
            "rope_parameters=.*rope_type 'yarn' is not implemented",
        ),
        ("attention_bias", False, "attention_bias=False"),
        ("hidden_act", "gelu", "hidden_act='gelu'"),
        ("layer_types", ["full_attention", "sliding_attention"], "layer_types"),
    ],
)
def test_unsupported_hf_config_is_an_error_naming_it(key, value, message):
    hf = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2).to_dict()
    ModelConfig.from_hf_config(hf)  # the unmodified config is fine
    with pytest.raises(ValueError, match=f"unsupported Hugging Face config: {message}"):
        ModelConfig.from_hf_config({**hf, key: value})


def test_hf_config_round_trip_through_transformers():
    ours = ModelConfig.preset("deepseek-r1-distill-qwen-1.5b")
    hf = Qwen2Config(**ours.to_hf_config())
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_key_value_heads, hf.vocab_size) == (1536, 28, 2, 151936)
    assert hf.rope_parameters["rope_theta"] == 10000.0 and hf.tie_word_embeddings is False
    assert hf.max_position_embeddings == 131072 and hf.eos_token_id == 151643
    assert ModelConfig.from_hf_config(hf.to_dict()) == ours


def test_a_directory_without_model_or_tokenizer_is_named(hf_untied_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_pretrained(str(tmp_path / "missing"))
    assert load_tokenizer(hf_untied_dir).encode("1+1=2", add_special_tokens=False)
    # Weights without tokenizer files: transformers builds a tokenizer that encodes everything to nothing.
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(hf_untied_dir, name), bare / name)
    load_pretrained(str(bare))  # the weights alone load
    with pytest.raises(FileNotFoundError, match="no usable tokenizer"):
        load_tokenizer(str(bare))


@pytest.mark.parametrize("damage", ["weights", "shape", "architecture"])
def test_a_model_directory_that_cannot_load_is_one_config_error_naming_it(hf_untied_dir, tmp_path, damage):
    """What lspo-train and lspo-eval say of ``model.path``: a damaged ``model.safetensors``, a ``config.json`` the
    weights disagree with, another architecture; each a ``ConfigError`` (one line, exit 2) naming the directory."""
    from lspo_jax.job.build import load_policy
    from lspo_jax.job.config import load_config
    from lspo_jax.train_config import ConfigError

    model = tmp_path / "model"
    shutil.copytree(hf_untied_dir, model)
    config = json.loads((model / "config.json").read_text())
    if damage == "weights":
        (model / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    else:
        config.update({"shape": {"intermediate_size": 96}, "architecture": {"model_type": "mistral"}}[damage])
        (model / "config.json").write_text(json.dumps(config))
    run = load_config(None, [f"model.path={model}"])
    with pytest.raises(ConfigError) as raised:
        load_policy(run, str(tmp_path / "cache"))
    message = str(raised.value)
    assert message.startswith(f"model.path {model}: ") and "\n" not in message
    refused = "model_type 'mistral' is not supported; supported: qwen2, qwen3, llama"
    expected = {"weights": "", "shape": "wrong shape for", "architecture": refused}[damage]
    assert expected in message
