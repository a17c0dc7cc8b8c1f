"""LoRA RL (``optim.train: lora``): the policy is a frozen base + a persistent policy adapter, and LSPO's scaffold
adapter stacks on top of it. Checked without a reference of our own making: the stacked forward with the scaffold's
B = 0 is the policy's, the unmerged policy is the merged one, each loss moves only its own adapter, a run keeps the
base's bytes (sha256), its spliced rows' denominators are the stacked policy's log-probs recomputed here from the
forward pass, a resumed run is the uninterrupted one, and the exports load in ``transformers`` and agree with a
PEFT adapter merged by hand and with the adapter as ``peft`` itself loads it onto the base.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_fixtures import assert_trees_equal, copy_tree, run_steps, trees_differ
from safetensors.numpy import load_file

from lspo_jax.config import LoraConfig, ModelConfig
from lspo_jax.job.export import export_checkpoint
from lspo_jax.models import hf, lora, model, specs
from lspo_jax.rl import checkpoint, optim
from lspo_jax.rl.checkpoint import Checkpointer, checkpoint_state
from lspo_jax.rl.logprobs import token_logprobs
from lspo_jax.train_config import ConfigError

pytestmark = pytest.mark.slow  # whole training runs

LORA = {"optim__train": "lora", "model__policy_lora": {"rank": 4, "alpha": 8.0}, "optim__lr": 1e-2}
CONFIG = ModelConfig(
    vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4, num_kv_heads=2,
    lora=LoraConfig(rank=2, alpha=4.0), policy_lora=LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "down")),
)  # fmt: skip


def _with_random_b(params, key, name):
    """``params`` with adapter ``name``'s B drawn (a fresh adapter's B is 0: it would change nothing)."""
    leaves, tree = jax.tree.flatten(params[name])
    keys = jax.random.split(key, len(leaves))
    drawn = [0.1 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    return {**params, name: jax.tree.unflatten(tree, drawn)}


@pytest.fixture(scope="module")
def tiny():
    params = _with_random_b(specs.init_params(CONFIG, jax.random.key(0)), jax.random.key(1), "policy")
    tokens = jax.random.randint(jax.random.key(2), (2, 7), 0, CONFIG.vocab_size)
    mask = jnp.ones((2, 7), bool).at[:, :3].set(False)  # 3 prompt tokens, 4 response tokens
    return params, tokens, mask


def test_stacked_forward_with_zero_scaffold_is_the_policy_and_unmerged_is_merged(tiny):
    params, tokens, _ = tiny
    policy = model.forward(CONFIG, {k: params[k] for k in ("base", "policy")}, tokens)
    # A fresh scaffold adapter (B = 0) on top of the policy: exactly the policy at any scale.
    np.testing.assert_array_equal(model.forward(CONFIG, params, tokens, lora_scale=1.0), policy)
    base_only = model.forward(CONFIG, {"base": params["base"]}, tokens)
    assert np.abs(policy - base_only).max() > 1e-3  # the policy adapter is on
    merged = model.forward(CONFIG, {"base": lora.merge_lora(CONFIG, params, 0.0)}, tokens)
    np.testing.assert_allclose(merged, policy, atol=1e-5)


def test_sft_moves_only_the_scaffold_adapter_and_rl_only_the_policy_adapter(tiny):
    params, tokens, mask = tiny
    rl, sft = optim.RLOptimConfig(lr=1e-2, train="lora"), optim.SFTOptimConfig(lr=1e-2)
    tx = optim.make_optimizer(rl, sft)
    state = tx.init(params)
    assert jax.tree.leaves(state.inner_states["base"]) == []  # the frozen base keeps no optimizer state
    after_sft, state, _ = optim.sft_step(CONFIG, params, state, {"tokens": tokens, "mask": mask}, sft=sft)
    assert trees_differ(params["lora"], after_sft["lora"])
    assert_trees_equal({k: params[k] for k in ("base", "policy")}, {k: after_sft[k] for k in ("base", "policy")})
    batch = {
        "tokens": tokens, "mask": mask, "advantages": jnp.array([1.0, -1.0]),
        "old_logp": jnp.zeros(tokens.shape) + jnp.log(0.5),  # ratios far from 1 on both rows: a non-zero gradient
    }  # fmt: skip
    after_rl, state, metrics = optim.rl_step(CONFIG, after_sft, state, batch, rl=rl)
    assert float(metrics["grad_norm"]) > 0 and trees_differ(after_sft["policy"], after_rl["policy"])
    assert_trees_equal({k: after_sft[k] for k in ("base", "lora")}, {k: after_rl[k] for k in ("base", "lora")})


def _policy_logp(config, params, batch, lora_scale):
    """The log-probs of ``batch``'s tokens at temperature 1 straight from ``model.forward``, zero off its mask."""
    logits = model.forward(config, params, batch["tokens"], batch["attention_mask"], lora_scale=lora_scale)
    logp = np.pad(np.asarray(token_logprobs(logits[:, :-1], batch["tokens"][:, 1:])), ((0, 0), (1, 0)))
    return np.where(batch["mask"] > 0, logp, 0.0)


def test_lora_run_keeps_the_base_and_splices_stacked_logprobs(tmp_path, make_config, easy_rule):
    updates = []

    def capture(job):
        job.initial = (copy_tree(job.state.params), job.state.base_digest, jax.tree.leaves(job.state.params["base"]))
        real = job.learner.rl_step

        def rl_step(batch, **kwargs):
            updates.append((batch, copy_tree(job.state.params)))
            return real(batch, **kwargs)

        job.learner.rl_step = rl_step

    job = run_steps(make_config(steps=3, **LORA), str(tmp_path), easy_rule, prepare=capture)
    initial, digest, arrays = job.initial
    assert digest == checkpoint.base_digest(job.state.params["base"])  # the base's bytes, unchanged
    # The very arrays: no step donates or rewrites the frozen base (the vLLM sync keys on them to skip it).
    assert all(a is b for a, b in zip(arrays, jax.tree.leaves(job.state.params["base"]), strict=True))
    assert_trees_equal(initial["base"], job.state.params["base"])
    assert trees_differ(initial["policy"], job.state.params["policy"])
    records = [r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(k in r for r in records for k in ("loss", "surpassed_groups", "spliced_rows", "rerolls"))
    config = job.learner.policy.config
    spliced = 0
    for (batch, params), record in zip(updates, records, strict=True):
        policy = _policy_logp(config, {k: params[k] for k in ("base", "policy")}, batch, 0.0)
        stacked = _policy_logp(config, params, batch, 1.0)  # the adapter fitted this step, on the policy
        on_policy = np.abs(batch["old_logp"] - policy).max(axis=1) < 1e-4
        on_stacked = np.abs(batch["old_logp"] - stacked).max(axis=1) < 1e-4
        assert np.all(on_policy | on_stacked) and np.sum(on_stacked & ~on_policy) == record["spliced_rows"]
        spliced += record["spliced_rows"]
    assert spliced > 0


def test_lora_resume_is_exact(tmp_path, tmp_path_factory, make_config, easy_rule):
    whole = run_steps(make_config(steps=4, **LORA), str(tmp_path_factory.mktemp("whole")), easy_rule)
    expected = copy_tree(checkpoint_state(whole.state.params, whole.state.opt_state))
    assert set(expected) == {"policy", "rl_opt"}  # the adapter and its optimizer state; the base is model.path's
    out = str(tmp_path)
    run_steps(make_config(steps=2, **LORA), out, easy_rule)
    checkpointer = Checkpointer(os.path.join(out, "checkpoints"))
    saved, meta = checkpointer.restore(2, expected)
    checkpointer.close()
    assert meta[checkpoint.BASE_DIGEST] == whole.state.base_digest and meta["model"]["num_hidden_layers"] > 0
    start = {}

    def prepare(job):
        start.update(step=job.state.step, state=copy_tree(checkpoint_state(job.state.params, job.state.opt_state)))

    resumed = run_steps(make_config(steps=4, **LORA), out, easy_rule, resume=True, prepare=prepare)
    assert start["step"] == 2
    assert_trees_equal(start["state"], saved)  # the adapter and its AdamW moments, as step 2 wrote them
    assert_trees_equal(checkpoint_state(resumed.state.params, resumed.state.opt_state), expected)
    assert_trees_equal(resumed.state.params["base"], whole.state.params["base"])


def test_exports_merged_and_peft_adapter(tmp_path, make_config, easy_rule):
    transformers, torch = pytest.importorskip("transformers"), pytest.importorskip("torch")
    run_dir = str(tmp_path / "run")
    job = run_steps(make_config(steps=2, **LORA), run_dir, easy_rule)
    config, params = job.learner.policy.config, copy_tree(job.state.params)
    merged_dir = export_checkpoint(run_dir, str(tmp_path / "merged"))
    adapter_dir = export_checkpoint(run_dir, str(tmp_path / "adapter"), adapter=True)
    adapter_config = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    assert (adapter_config["r"], adapter_config["lora_alpha"], adapter_config["peft_type"]) == (4, 8.0, "LORA")
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert adapter_config["target_modules"] == names
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    assert len(tensors) == 2 * len(names) * config.num_layers
    merged = load_file(os.path.join(merged_dir, "model.safetensors"))
    base = dict(hf.to_hf_state_dict(config, {"base": params["base"]}))
    scale = adapter_config["lora_alpha"] / adapter_config["r"]
    for key, weight in merged.items():  # the HF base plus peft's scale * B @ A, by hand: the merged export's weight
        module = key.removesuffix(".weight")
        a = tensors.get(f"base_model.model.{module}.lora_A.weight")
        if a is not None:
            b = tensors[f"base_model.model.{module}.lora_B.weight"]
            assert a.shape == (4, weight.shape[1]) and b.shape == (weight.shape[0], 4)
            np.testing.assert_allclose(base[key] + scale * b @ a, weight, atol=1e-5, err_msg=key)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    tokens = np.array([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        theirs = hf_model(torch.tensor(tokens)).logits.numpy()
    ours = model.forward(config, {k: params[k] for k in ("base", "policy")}, jnp.asarray(tokens))
    np.testing.assert_allclose(theirs, np.asarray(ours), atol=1e-4)
    # peft itself loads the adapter onto the run's base: its forward is the merged export's. Both in torch float32;
    # x W + s (x A) B against x (W + s B A) differ by rounding only, about 1e-7 of logits of order 1.
    peft = pytest.importorskip("peft")
    base_model = transformers.AutoModelForCausalLM.from_pretrained(job.run.model.path, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base_model, adapter_dir).eval()
    with torch.no_grad():
        through_peft = with_adapter(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(through_peft, theirs, atol=1e-5)
    with torch.no_grad(), with_adapter.disable_adapter():  # peft wraps the base in place: its adapter switched off
        base_logits = with_adapter(torch.tensor(tokens)).logits.numpy()
    assert np.abs(through_peft - base_logits).max() > 1e-3  # the adapter was on


def test_lora_training_refuses_what_writes_the_base(make_config):
    with pytest.raises(ConfigError, match="model.param_dtype"):
        make_config(model__param_dtype="bfloat16")
    with pytest.raises(ConfigError, match="scaffold.supervise"):
        make_config(scaffold__supervise="base", **LORA)
    assert optim.rl_subtree(make_config(**LORA).optim) == "policy"
