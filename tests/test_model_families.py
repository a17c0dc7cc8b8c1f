"""The families beside Qwen2 (``config.FAMILIES``): Qwen3 and Llama 3.x against transformers' own implementations of
them, built as tiny random models by transformers itself; the export back to each; a few RL steps of each; and the
families this model does not compute, refused in one line.

The tiny models are those of ``conftest.TINY_HF_KWARGS`` (GQA 4 query heads over 2 KV heads, rope theta 100) with
each family's features: Qwen3 with ``head_dim`` 32 where hidden / heads is 16, Llama with a ``llama3`` rope scaling
whose original context (64 positions) puts the rotary dims of head_dim 16 in all three of its bands (kept, smoothed,
stretched).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import jax
import numpy as np
import pytest
import torch
from conftest import TINY_HF_KWARGS, _randomize, build_char_tokenizer
from run_fixtures import copy_tree, one_line, run_steps
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from lspo_jax.config import FAMILIES, HUB_PRESETS, ModelConfig
from lspo_jax.job import cli, toy_model
from lspo_jax.models import hf, layer, model, sharding, specs
from lspo_jax.models.axes import MESH_AXES
from lspo_jax.rollout.sampler import generate

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # fmt: skip
BUILDERS = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),
    "llama": (LlamaConfig, LlamaForCausalLM, {"rope_scaling": LLAMA3}),
}  # transformers' config classes add keys to the dicts they are given: give them copies
# Logits of the random models reach |4-5| (asserted below). float32 rounding between torch and XLA, and between XLA's
# AVX2 and AVX-512 kernels, moves them by about 1e-6 of that scale (5e-6 seen here): 1e-4 leaves a margin of 20,
# while a real bug (a norm on the wrong axis, a frequency in the wrong band, a transposed weight) moves them by O(1).
ATOL = 1e-4
_forward = jax.jit(model.forward, static_argnums=0)


def build_family_model(path: str, family: str, *, tied: bool, seed: int = 0) -> str:
    """A random float32 transformers model of ``family`` and the character tokenizer, saved into ``path``."""
    config_class, model_class, extra = BUILDERS[family]
    torch.manual_seed(seed)
    hf_config = config_class(**TINY_HF_KWARGS, **copy.deepcopy(extra), tie_word_embeddings=tied)
    built = model_class(hf_config).to(torch.float32).eval()
    _randomize(built, seed)
    built.save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return path


_BUILT: dict[str, tuple] = {}


def _family_model(name: str, tmp_path_factory) -> tuple:
    """(family, directory, our config, our params, transformers' model) of ``name``: ``family-tied`` or
    ``family-untied``, built once a session."""
    if name not in _BUILT:
        family, tied = name.split("-")
        path = build_family_model(str(tmp_path_factory.mktemp(name)), family, tied=tied == "tied")
        config, params = hf.load_pretrained(path)
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        _BUILT[name] = (family, path, config, params, reference.eval())
    return _BUILT[name]


@pytest.fixture(params=["qwen3-untied", "qwen3-tied", "llama-untied", "llama-tied"])
def family_model(request, tmp_path_factory):
    """Each family, tied and untied."""
    return _family_model(request.param, tmp_path_factory)


@pytest.fixture(params=["qwen3-tied", "llama-untied"])
def decode_model(request, tmp_path_factory):
    """One model per family: Qwen3-1.7B's tied head and Llama 3.1-8B's untied one (3.2-1B's is tied)."""
    return _family_model(request.param, tmp_path_factory)


def _batch() -> tuple[np.ndarray, np.ndarray]:
    """Two rows of 48 tokens, the second left-padded by 9: positions reach 47, where the stretched (low-frequency)
    rotary dims have turned far enough for a wrong factor to show."""
    tokens = np.random.default_rng(0).integers(4, TINY_HF_KWARGS["vocab_size"], size=(2, 48)).astype(np.int32)
    mask = np.ones_like(tokens)
    mask[1, :9] = 0
    tokens[mask == 0] = 0
    return tokens, mask


def _reference_logits(reference, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """transformers' logits, positions given as ``cumsum(mask) - 1`` as its ``generate`` gives them."""
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    as_torch = lambda x: torch.from_numpy(x).long()
    with torch.no_grad():
        out = reference(input_ids=as_torch(tokens), attention_mask=as_torch(mask), position_ids=as_torch(positions))
    return out.logits.numpy()


# ----------------------------------------------------------------------------------------------- parity
def test_config_reads_the_family_and_its_features(family_model):
    family, path, config, params, _ = family_model
    layers = params["base"]["layers"]
    assert config.family == family and FAMILIES[family].architecture == json.load(open(f"{path}/config.json"))[
        "architectures"][0]  # fmt: skip
    assert ("q_bias" in layers) is False and ("q_norm" in layers) == (family == "qwen3")
    if family == "qwen3":
        assert config.head_dim == 32 and layers["q_norm"].shape == (2, 32)  # not hidden / heads = 16
    else:
        assert dataclasses.asdict(config.rope_scaling) == {k: v for k, v in LLAMA3.items() if k != "rope_type"}


def test_logits_match_transformers(family_model):
    family, _, config, params, reference = family_model
    tokens, mask = _batch()
    ref = _reference_logits(reference, tokens, mask)
    ours = np.asarray(_forward(config, params, tokens, mask))
    real = mask == 1
    assert np.abs(ref[real]).max() > 3.0  # the scale ATOL is reasoned from
    np.testing.assert_allclose(ours[real], ref[real], rtol=0, atol=ATOL)
    # The family's feature is not idle: without it the logits move far beyond the tolerance.
    plain = dataclasses.replace(config, rope_scaling=None)
    if family == "qwen3":
        plain = dataclasses.replace(config, family="llama")  # the same weights but the q/k norms
        layers = {k: v for k, v in params["base"]["layers"].items() if k not in ("q_norm", "k_norm")}
        params = {"base": {**params["base"], "layers": layers}}
    assert np.abs(np.asarray(_forward(plain, params, tokens, mask))[real] - ref[real]).max() > 100 * ATOL


def test_rotary_frequencies_are_transformers(family_model):
    """Llama 3's remapped frequencies (and Qwen3's plain ones), against the buffer transformers computed."""
    family, _, config, _, reference = family_model
    theirs = reference.model.rotary_emb.inv_freq.numpy()
    np.testing.assert_allclose(np.asarray(layer.rope_frequencies(config)), theirs, rtol=1e-6, atol=0)
    if family == "llama":  # every band of the remapping is exercised: kept, smoothed and stretched dims
        plain = np.asarray(layer.rope_frequencies(dataclasses.replace(config, rope_scaling=None)))
        ratio = plain / theirs
        assert np.any(ratio == 1.0) and np.any(np.isclose(ratio, 8.0)) and np.any((ratio > 1.01) & (ratio < 7.99))


def test_cached_decode_matches_transformers_and_the_full_forward(decode_model):
    """The sampler's prompt pass and KV-cached decode: greedy tokens as transformers' ``generate``, log-probs as the
    teacher-forced full forward (across one cache growth: window 8 of 12 tokens)."""
    _, _, config, params, reference = decode_model
    prompts = [[5, 9, 13, 17, 21, 25, 29], [30, 31, 32]]
    out = generate(config, params, prompts, key=jax.random.key(0), max_new_tokens=12, greedy=True, cache_window=8,
                   eos_token_ids=(2,))  # fmt: skip
    tokens, mask = np.zeros((2, 7), np.int64), np.zeros((2, 7), np.int64)
    for i, prompt in enumerate(prompts):
        tokens[i, 7 - len(prompt) :], mask[i, 7 - len(prompt) :] = prompt, 1
    with torch.no_grad():
        theirs = reference.generate(input_ids=torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask),
                                    do_sample=False, max_new_tokens=12, pad_token_id=0, eos_token_id=2)  # fmt: skip
    for i, completion in enumerate(out):
        new = len(completion.tokens)
        np.testing.assert_array_equal(completion.tokens, theirs[i, 7 : 7 + new].numpy())
        whole = np.asarray(prompts[i] + completion.tokens.tolist(), np.int32)[None]
        logp = np.asarray(jax.nn.log_softmax(_forward(config, params, whole), axis=-1))[0]
        teacher = logp[len(prompts[i]) - 1 + np.arange(new), completion.tokens]
        np.testing.assert_allclose(completion.logprobs, teacher, rtol=0, atol=ATOL)


# ------------------------------------------------------------------------------------------------ export
def test_export_round_trip_is_exact_and_loads_in_transformers(family_model, tmp_path):
    family, path, config, params, reference = family_model
    original = load_file(os.path.join(path, "model.safetensors"))
    ours = dict(hf.to_hf_state_dict(config, params))
    assert set(ours) == set(original) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    hf.save_pretrained(str(tmp_path), config, params, tokenizer_from=path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["model_type"], saved["architectures"]) == (family, [FAMILIES[family].architecture])
    config2, params2 = hf.load_pretrained(str(tmp_path))
    assert config2 == config
    jax.tree.map(np.testing.assert_array_equal, params2, params)
    for name, tensor in load_file(str(tmp_path / "model.safetensors")).items():
        np.testing.assert_array_equal(tensor, original[name])  # bit for bit the checkpoint transformers wrote
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, attn_implementation="eager")
    assert type(loaded).__name__ == FAMILIES[family].architecture
    tokens, mask = _batch()
    np.testing.assert_array_equal(loaded.model.rotary_emb.inv_freq.numpy(), reference.model.rotary_emb.inv_freq.numpy())
    expected = _reference_logits(reference, tokens, mask)
    np.testing.assert_array_equal(_reference_logits(loaded.eval(), tokens, mask), expected)


def test_the_vllm_sync_pushes_the_familys_state_dict(family_model):
    """The tensors a vLLM engine is given in place (``vllm_weights.hf_tensors``, what ``sync_weights`` pushes) are
    the export's: the same names, order and values, so an engine of the family loads every weight."""
    from lspo_jax.rollout.vllm_weights import Handover, hf_tensors

    _, _, config, params, _ = family_model
    reference = list(hf.to_hf_state_dict(config, params))
    pushed = list(hf_tensors(config, params["base"], {"layers", "outer"}, dtype="float32",
                             handover=Handover(torch, "cpu")))  # fmt: skip
    assert [name for name, _ in pushed] == [name for name, _ in reference]
    for (_, ours), (_, theirs) in zip(pushed, reference, strict=True):
        np.testing.assert_array_equal(ours.numpy(), theirs)


# --------------------------------------------------------------------------------------- sharding, shapes
def test_every_weight_of_each_family_has_a_layout_on_a_mesh():
    """q/k norms are replicated (head_dim is not split), the projections split as Qwen2's are."""
    mesh = jax.sharding.AbstractMesh((1, 4, 2), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)
    for name in ("qwen3-1.7b", "llama-3.2-1b"):
        config = ModelConfig.preset(name)
        layers = sharding.abstract_params(config, mesh)["base"]["layers"]
        assert layers["q"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tp", None)
        if config.qk_norm:
            assert layers["q_norm"].sharding.spec == jax.sharding.PartitionSpec(None, None)
        assert ("q_bias" in layers) is False


# The config.json files the hub publishes for the recipes' models (transformers 4.x wrote them: rope_scaling and
# rope_theta, no rope_parameters), keys that do not change the computation left out.
PUBLISHED = {
    "qwen3-1.7b": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16,
        "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True, "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
        "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "rope_theta": 500000.0,
        "tie_word_embeddings": True, "vocab_size": 128256,
    },
}  # fmt: skip


@pytest.mark.parametrize(
    "name, params, family",
    # Counted from the published shapes: embeddings + layers (attention, MLP, norms) + final norm, tied heads.
    [("qwen3-1.7b", 1_720_574_976, "qwen3"), ("llama-3.2-1b", 1_235_814_400, "llama")],
)
def test_presets_of_the_recipes_models_are_their_published_configs(name, params, family):
    config = ModelConfig.preset(name)
    assert config.family == family and specs.count_params(specs.abstract_params(config)["base"]) == params
    assert ModelConfig.from_hf_config(PUBLISHED[name]) == config
    assert ModelConfig.from_hf_config(config.to_hf_config()) == config


def test_lower_check_compiles_a_recipe_at_its_models_shape():
    from tools.lower_check import paper_shape

    configs = os.path.join(os.path.dirname(__file__), "..", "configs")
    for file, preset in [("lspo_deepmath_qwen3_1p7b.yaml", "qwen3-1.7b"),
                         ("lspo_deepmath_llama3p2_1b.yaml", "llama-3.2-1b")]:  # fmt: skip
        shape = paper_shape(os.path.join(configs, file))
        section = shape.run.model
        expected = ModelConfig.preset(preset, compute_dtype=section.compute_dtype, remat=section.remat,
                                      lora=section.lora)  # fmt: skip
        assert HUB_PRESETS[shape.run.model.path] == preset and shape.model == expected


# ----------------------------------------------------------------------------------------------- refusals
REFUSED = {
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "vocab_size": 96,
                "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
    "gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 96, "n_embd": 64},
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_another_family_is_refused_in_one_line_by_lspo_train(family, tmp_path, train_file, capsys):
    with pytest.raises(ValueError, match=f"^model_type '{family}' is not supported; supported: qwen2, qwen3, llama$"):
        ModelConfig.from_hf_config(REFUSED[family])
    path = tmp_path / family
    path.mkdir()
    (path / "config.json").write_text(json.dumps(REFUSED[family]))
    argv = ["--config", os.path.join(os.path.dirname(__file__), "..", "configs", "demo.yaml"), "--out",
            str(tmp_path / "run"), f"model.path={path}", f"data.train={train_file}"]  # fmt: skip
    assert cli.train_main(argv) == 2
    err = one_line(capsys, "lspo-train")
    assert f"model.path {path}: model_type '{family}' is not supported; supported: qwen2, qwen3, llama" in err


@pytest.mark.parametrize(
    "family, key, value, message",
    [
        ("llama", "attention_bias", True, "attention_bias=True"),
        ("llama", "mlp_bias", True, "mlp_bias=True"),
        ("qwen3", "attention_bias", True, "attention_bias=True"),
        ("qwen3", "rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}, "rope_type 'yarn'"),
        ("llama", "rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "rope_scaling=.*'dynamic' is not"),
        ("llama", "rope_parameters", {**LLAMA3, "rope_theta": 1e4, "partial_rotary_factor": 0.5}, "partial rotary"),
    ],
)
def test_features_a_family_does_not_compute_are_refused(family, key, value, message):
    config_class, _, extra = BUILDERS[family]
    hf_config = config_class(**TINY_HF_KWARGS, **copy.deepcopy(extra)).to_dict()
    ModelConfig.from_hf_config(hf_config)
    with pytest.raises(ValueError, match=f"unsupported Hugging Face config: .*{message}"):
        ModelConfig.from_hf_config({**hf_config, key: value})


def test_a_family_is_read_from_architectures_without_model_type():
    hf_config = {**ModelConfig.preset("llama-3.2-1b").to_hf_config()}
    del hf_config["model_type"]
    assert ModelConfig.from_hf_config(hf_config).family == "llama"
    with pytest.raises(ValueError, match="architecture 'MistralForCausalLM' is not supported"):
        ModelConfig.from_hf_config({**hf_config, "architectures": ["MistralForCausalLM"]})


# ---------------------------------------------------------------------------------------------- RL steps
@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family_policy(request, model_dir, tmp_path_factory):
    """The demo's policy shape in each family (random weights), with the demo's character tokenizer."""
    family = request.param
    scaling = dict(rope_scaling={k: v for k, v in LLAMA3.items() if k != "rope_type"}) if family == "llama" else {}
    config = dataclasses.replace(toy_model.model_config(), family=family, **scaling)
    path = str(tmp_path_factory.mktemp(f"policy_{family}"))
    hf.save_pretrained(path, config, specs.init_params(config, jax.random.key(0)), tokenizer_from=model_dir)
    return family, path


def test_rl_steps_with_the_scaffold_in_each_family(family_policy, make_config, easy_rule, tmp_path):
    """Two steps of the demo's loop (JAX sampler, packed update, scaffold on): each step has one cliff group, which the
    scaffold fits, re-rolls and splices; then ``lspo-export`` of its checkpoint, which transformers loads as the
    family's model and which computes the trained base's logits."""
    family, path = family_policy
    run = tmp_path / "run"
    job = run_steps(make_config(model__path=path), str(run), easy_rule)
    assert job.policy.config.family == family
    records = [m for m in _records(run) if m["kind"] == "train"]
    assert [m["step"] for m in records] == [1, 2]
    for m in records:
        assert m["cliff_groups"] == 1 and {"surpassed_groups", "spliced_rows", "rescue_pass_rate", "sft_loss"} <= set(m)
    assert cli.export_main([str(run), str(tmp_path / "hf")]) == 0
    config, params = hf.load_pretrained(str(tmp_path / "hf"))
    assert config.family == family
    jax.tree.map(np.testing.assert_array_equal, params["base"], copy_tree(job.state.params["base"]))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    assert type(loaded).__name__ == FAMILIES[family].architecture
    tokens, mask = np.array([[5, 9, 13, 17, 21, 25]], np.int32), np.ones((1, 6), np.int32)
    ours = np.asarray(_forward(config, params, tokens, mask))
    np.testing.assert_allclose(_reference_logits(loaded.eval(), tokens, mask), ours, rtol=0, atol=ATOL)


def _records(out) -> list[dict]:
    from lspo_jax.job.metrics_log import read_metrics

    return read_metrics(os.path.join(out, "metrics.jsonl"))
