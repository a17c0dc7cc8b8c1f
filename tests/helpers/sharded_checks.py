"""Sharded-equals-unsharded checks on 8 CPU devices, run by ``test_sharding.py`` in a fresh process.

The device count is fixed when JAX starts, and the pytest process has already started it with one device,
so these checks run here: ``python tests/helpers/sharded_checks.py`` (it asks JAX for 8 CPU devices) prints one JSON
object of measured numbers (largest differences, byte ratios, token matches) and the test file asserts on
them. Everything runs in one process so JAX starts once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import tempfile
import time
import zlib

import jax
import numpy as np
from jax.sharding import PartitionSpec

from lspo_jax.config import ModelConfig
from lspo_jax.job import toy_model
from lspo_jax.models import sharding, specs
from lspo_jax.models.attention import attend, decode_attend
from lspo_jax.rl import distributed, logprobs, losses, optim, packing
from lspo_jax.rl.checkpoint import Checkpointer
from lspo_jax.rollout import programs, sampler

# Before the first use of JAX (nothing above touches a device): 8 CPU devices to build meshes from.
jax.config.update("jax_num_cpu_devices", 8)

CONFIG = ModelConfig.preset("tiny")
# A large Adam eps: the first Adam step is lr * g / (|g| + eps), which for eps = 1e-8 is lr * sign(g) and
# turns float32 rounding of a near-zero gradient into a difference of order lr; eps = 1e-3 keeps the
# update proportional to the gradient, so updated params can be compared tightly.
RL = optim.RLOptimConfig(lr=1e-3, eps=1e-3)
LAYOUTS = {"fsdp8": (1, 8, 1), "fsdp4_tp2": (1, 4, 2), "fsdp2_tp4": (1, 2, 4)}
ROWS, LENGTH, PROMPT = 8, 16, 5


def _max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b, strict=True))


def _tree_diff(a, b) -> float:
    return _max_diff(jax.tree.leaves(a), jax.tree.leaves(b))


def _params():
    """Random tiny params, drawn with numpy: ``jax.random`` would compile a program per shape, slowly on CPU."""
    rng = np.random.default_rng(0)

    def draw(spec: specs.ParamSpec) -> np.ndarray:
        if spec.init in ("zeros", "ones"):
            return np.full(spec.shape, float(spec.init == "ones"), spec.dtype)
        return (0.05 * rng.standard_normal(spec.shape)).astype(spec.dtype)  # adapter B too: it computes something

    return jax.tree.map(draw, specs.param_specs(CONFIG), is_leaf=lambda x: isinstance(x, specs.ParamSpec))


def _batch():
    rng = np.random.default_rng(0)
    lengths = np.array([16, 9, 12, 7, 16, 10, 13, 8])
    positions = np.arange(LENGTH)[None, :]
    attention = positions < lengths[:, None]
    return {
        "tokens": rng.integers(0, CONFIG.vocab_size, (ROWS, LENGTH)).astype(np.int32),
        "attention_mask": attention.astype(np.int32),
        "mask": (attention & (positions >= PROMPT)).astype(np.int32),
        "old_logp": (-np.log(CONFIG.vocab_size) + rng.uniform(-0.3, 0.3, (ROWS, LENGTH))).astype(np.float32),
        "advantages": np.array([1.0, -1.0, 0.5, -0.5, 1.0, 0.0, -1.0, 0.5], np.float32),
    }


def _loss_and_grads(base, batch, config=CONFIG):
    """RL loss (chunked head, 2 micro-batches would not change a gradient: plain here) and its base gradient."""

    def loss(b):
        logp, logits = logprobs.sequence_logprobs(config, {"base": b}, batch["tokens"], batch["attention_mask"])
        return losses.policy_loss(logp, batch["old_logp"], batch["advantages"], batch["mask"])[0], logits

    (value, logits), grads = jax.value_and_grad(loss, has_aux=True)(base)
    return logits, value, grads


def check_steps(params, batch) -> dict:
    """Forward logits, RL loss and its gradient on each mesh vs one device; then the jitted builders on the
    fsdp x tp mesh."""
    reference = jax.jit(_loss_and_grads)(params["base"], batch)
    out = {"grad_scale": max(float(np.max(np.abs(g))) for g in jax.tree.leaves(reference[2]))}
    for name, (data, fsdp, tp) in LAYOUTS.items():
        mesh = sharding.make_mesh(sharding.MeshConfig(data, fsdp, tp))
        in_shardings = (sharding.param_shardings(CONFIG, mesh)["base"], sharding.batch_sharding(mesh))
        grad_fn = jax.jit(distributed.in_mesh(mesh, _loss_and_grads), in_shardings=in_shardings)
        logits, value, grads = grad_fn(params["base"], batch)
        out[name] = {
            "logits": _max_diff([logits], [reference[0]]),
            "loss": abs(float(value) - float(reference[1])),
            "grads": _tree_diff(grads, reference[2]),
        }
    mesh = sharding.make_mesh(sharding.MeshConfig(*LAYOUTS["fsdp4_tp2"]))
    out["builders"] = check_builders(params, batch, mesh)
    # The fused attention path (rows rotated to right padding) against einsum on one device, on fsdp = 2 x tp = 4:
    # tp splits the 4 query heads but not the 2 KV heads, so each query head gets its own KV copy there.
    mesh = sharding.make_mesh(sharding.MeshConfig(*LAYOUTS["fsdp2_tp4"]))
    fused = functools.partial(_loss_and_grads, config=dataclasses.replace(CONFIG, attention="xla"))
    in_shardings = (sharding.param_shardings(CONFIG, mesh)["base"], sharding.batch_sharding(mesh))
    logits, value, grads = jax.jit(distributed.in_mesh(mesh, fused), in_shardings=in_shardings)(params["base"], batch)
    real = np.asarray(batch["attention_mask"], bool)
    out["fused_fsdp2_tp4"] = {
        "logits": _max_diff([np.asarray(logits)[real]], [np.asarray(reference[0])[real]]),
        "loss": abs(float(value) - float(reference[1])),
        "grads": _tree_diff(grads, reference[2]),
    }
    return out


def check_builders(params, batch, mesh) -> dict:
    """``sharded_rl_step`` (2 micro-batches, chunked head) and ``sharded_logprobs``; the SFT builder shares
    the RL one's plumbing and is left out to keep the run short (each step compiles for several seconds)."""
    tx = optim.make_optimizer(RL)
    rl_kwargs = dict(rl=RL, num_micro_batches=2, spec=losses.LossSpec(chunk_size=5))
    ref_rl = jax.jit(functools.partial(optim.rl_step, CONFIG, **rl_kwargs))(params, tx.init(params), batch)
    ref_logp, _ = jax.jit(logprobs.sequence_logprobs, static_argnums=0)(
        CONFIG, params, batch["tokens"], batch["attention_mask"]
    )
    params_sh, state_sh, _ = distributed.step_shardings(CONFIG, mesh, tx)
    init = jax.jit(tx.init, out_shardings=state_sh)

    def fresh():  # the steps donate params and state: each gets its own copy
        sharded = sharding.shard_params(params, params_sh)
        return sharded, init(sharded)

    rl = distributed.sharded_rl_step(CONFIG, mesh, **rl_kwargs)(*fresh(), batch)
    logprob_pass = distributed.sharded_logprobs(CONFIG, mesh, num_micro_batches=2)
    logp = logprob_pass(fresh()[0], batch)
    return {
        "rl_step_params": _tree_diff(rl[0], ref_rl[0]),
        "rl_step_metrics": _tree_diff(rl[2], ref_rl[2]),
        "logprobs": _max_diff([logp], [ref_logp]),
        "q_spec": str(rl[0]["base"]["layers"]["q"].sharding.spec),
        "embed_mu_spec": str(rl[1].inner_states["base"].inner_state[1][0].mu["base"]["embed"].sharding.spec),
    }


def _packable_batch() -> dict:
    """Rows of 1 to LENGTH real tokens (a left-padded prompt of up to PROMPT, then the response), one empty."""
    rng = np.random.default_rng(3)
    prompt, response = np.array([5, 1, 2, 5, 3, 1, 4, 0]), np.array([11, 0, 1, 6, 2, 9, 3, 0])
    slots = np.arange(LENGTH)[None, :]
    real = (slots >= PROMPT - prompt[:, None]) & (slots < PROMPT + response[:, None])
    mask = real & (slots >= PROMPT)
    return {
        "tokens": np.where(real, rng.integers(1, CONFIG.vocab_size, (ROWS, LENGTH)), 0).astype(np.int32),
        "attention_mask": real.astype(np.int32),
        "mask": mask.astype(np.int32),
        "old_logp": np.where(mask, -rng.uniform(1.0, 8.0, (ROWS, LENGTH)), 0.0).astype(np.float32),
        "advantages": rng.standard_normal(ROWS).astype(np.float32),
    }


def check_packed(params) -> dict:
    """Packed rows on the fsdp x tp mesh against padded rows on one device: the RL and SFT gradients, the RL step
    (2 micro-batches, chunked head) and both log-prob passes."""
    batch, mesh = _packable_batch(), sharding.make_mesh(sharding.MeshConfig(*LAYOUTS["fsdp4_tp2"]))
    packed = packing.pack_rows(batch, ("mask", "old_logp", "advantages"), LENGTH, row_multiple=8)
    params_sh = sharding.param_shardings(CONFIG, mesh)
    on_mesh = lambda fn, sh: jax.jit(distributed.in_mesh(mesh, fn), in_shardings=(sh, sharding.batch_sharding(mesh)))
    out = {"most_segments": int(packed.arrays["segment_ids"].max())}
    rl, sft = functools.partial(optim.rl_gradients, CONFIG), functools.partial(optim.sft_gradients, CONFIG)
    for name, fn, sub, sh in (("rl", rl, params["base"], params_sh["base"]), ("sft", sft, params, params_sh)):
        want_loss, want_grads, _ = jax.jit(fn)(sub, batch)
        loss, grads, _ = on_mesh(fn, sh)(sub, packed.arrays)
        scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(want_grads))
        out[name] = {"loss": abs(float(loss) - float(want_loss)) / max(1.0, abs(float(want_loss))),
                     "grads": _tree_diff(grads, want_grads) / scale}  # fmt: skip
    tx = optim.make_optimizer(RL)
    rl_kwargs = dict(rl=RL, num_micro_batches=2, spec=losses.LossSpec(chunk_size=5))
    want = jax.jit(functools.partial(optim.rl_step, CONFIG, **rl_kwargs))(params, tx.init(params), batch)
    placed = sharding.shard_params(params, params_sh)
    state = jax.jit(tx.init, out_shardings=sharding.opt_state_shardings(CONFIG, mesh, tx))(placed)
    got = distributed.sharded_rl_step(CONFIG, mesh, **rl_kwargs)(placed, state, packed.arrays)
    out["rl_step_params"], out["rl_step_loss"] = (
        _tree_diff(got[0], want[0]),
        abs(float(got[2]["loss"] - want[2]["loss"])),
    )
    real = batch["mask"] > 0
    for scale in (0.0, 1.0):
        want_logp = jax.jit(logprobs.sequence_logprobs, static_argnums=0)(
            CONFIG, params, batch["tokens"], batch["attention_mask"], lora_scale=scale
        )
        logp = distributed.sharded_logprobs(CONFIG, mesh, lora_scale=scale)(
            sharding.shard_params(params, params_sh), packed.arrays
        )
        out["logprob_scale"] = float(np.max(np.abs(np.asarray(want_logp[0])[real])))
        out[f"logprobs_{scale:g}"] = _max_diff(
            [packed.unpack(np.asarray(logp))[real]], [np.asarray(want_logp[0])[real]]
        )
    return out


def check_sampler(params) -> dict:
    """Greedy rollouts on two meshes vs one device: tokens exactly, log-probs to float32 rounding."""
    prompts = [[5, 9, 13, 17, 21], [30, 31, 32, 33, 34, 35, 36, 37, 38], [60, 61]]
    kwargs = dict(key=jax.random.key(1), max_new_tokens=10, n=2, greedy=True, cache_window=8, temperature=0.7)
    reference = sampler.generate_arrays(CONFIG, params, prompts, **kwargs)
    out = {}
    for name in ("fsdp4_tp2",):
        mesh = sharding.make_mesh(sharding.MeshConfig(*LAYOUTS[name]))
        got = sampler.generate_arrays(CONFIG, params, prompts, mesh=mesh, **kwargs)
        out[name] = {
            "tokens_equal": bool(np.array_equal(got.tokens, reference.tokens)),
            "lengths_equal": bool(np.array_equal(got.lengths, reference.lengths)),
            "logprobs": _max_diff([got.logprobs], [reference.logprobs]),
        }
    # Rows ending at 10, 3 and 5 tokens: on the mesh the 8 rows move into a bucket of 4 (one row per fsdp shard)
    # at step 4; the single-device call without compaction is the reference.
    limits = dict(kwargs, max_new_tokens=[10, 3, 5])
    still = sampler.generate_arrays(CONFIG, params, prompts, **limits, compact_every=0)
    before = programs.TRACE_COUNTS["compact"]
    sampler.MIN_COMPACT_ROWS, floor = 1, sampler.MIN_COMPACT_ROWS
    try:
        moved = sampler.generate_arrays(CONFIG, params, prompts, mesh=mesh, **limits, compact_every=2)
    finally:
        sampler.MIN_COMPACT_ROWS = floor
    out["compacted"] = {
        "compactions": programs.TRACE_COUNTS["compact"] - before,
        "tokens_equal": bool(np.array_equal(moved.tokens, still.tokens)),
        "lengths_equal": bool(np.array_equal(moved.lengths, still.lengths)),
        "logprobs": _max_diff([moved.logprobs], [still.logprobs]),
    }
    return out


def check_decode_kernel() -> dict:
    """The Pallas decode kernel (interpreted) on fsdp4 x tp2 with 6 query heads over 3 KV heads, which tp cannot
    split: each shard must then keep every query head of its rows (split 3 and 3, query heads 0-2 would be paired
    with KV heads 0-2 instead of 0, 0, 1). Against ``attention.attend`` on one device."""
    rng = np.random.default_rng(5)
    rows, heads, kv_heads, head_dim, slots = 4, 6, 3, 16, 48
    q = rng.normal(size=(rows, 1, heads, head_dim)).astype(np.float32)
    k, v = (rng.normal(size=(rows, kv_heads, slots, head_dim)).astype(np.float32) for _ in range(2))
    start, end = np.array([0, 5, 16, 31]), np.array([48, 40, 17, 35])
    mask = ((np.arange(slots) >= start[:, None]) & (np.arange(slots) < end[:, None]))[:, None]
    ref = np.asarray(attend(q, k, v, mask))
    with jax.set_mesh(sharding.make_mesh(sharding.MeshConfig(*LAYOUTS["fsdp4_tp2"]))):
        got = np.asarray(jax.jit(decode_attend, static_argnums=0)("pallas", q, k, v, mask))
    return {"max_abs_diff": float(np.abs(got - ref).max()), "scale": float(np.abs(ref).max())}


def check_param_bytes(params) -> dict:
    """Per-device share of the parameters under fsdp = 8: measured on the tiny model, from shapes for 1.5B.

    The base is split 8 ways; adapter factors without an embed axis (B of q/k/v/gate/up, A of o/down) and
    the q/k/v biases stay whole, which the tiny model's adapter (a large part of it) makes visible.
    """
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=8))
    sharded = sharding.shard_params(params, sharding.param_shardings(CONFIG, mesh))
    nbytes = lambda tree: sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))
    abstract = sharding.abstract_params(ModelConfig.preset("deepseek-r1-distill-qwen-1.5b"), mesh)
    full = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    shard = lambda tree: sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )
    batch = _batch()
    placed = [sharding.global_batch(mesh, batch), sharding.host_local_batch(mesh, batch)]
    return {
        "batch_placed": all(
            np.array_equal(np.asarray(p[k]), batch[k]) and p[k].sharding.spec == PartitionSpec("fsdp")
            for p in placed
            for k in batch
        ),
        "tiny_base": sharding.device_bytes(sharded["base"]) / nbytes(params["base"]),
        "tiny_all": sharding.device_bytes(sharded) / nbytes(params),
        "r1_base": shard(abstract["base"]) / full(abstract["base"]),
        "r1_all": shard(abstract) / full(abstract),
    }


def check_checkpoint(params) -> dict:
    """Save base + RL optimizer state from an fsdp = 8 mesh, restore onto fsdp = 2 x tp = 4."""
    tx = optim.make_optimizer(RL)
    save_mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=8))
    load_mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=2, tp=4))

    def state_on(mesh, values):
        params_sh, state_sh, _ = distributed.step_shardings(CONFIG, mesh, tx)
        opt_state = jax.jit(tx.init, out_shardings=state_sh)(sharding.shard_params(values, params_sh))
        opt_state = jax.tree.map(lambda x: x + 0.25 if x.ndim else x, opt_state)  # moments worth checking
        return {"base": sharding.shard_params(values, params_sh)["base"], "rl_opt": opt_state.inner_states["base"]}

    saved = state_on(save_mesh, params)
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        state_on(load_mesh, jax.tree.map(np.zeros_like, params)),
    )
    with tempfile.TemporaryDirectory() as directory:
        checkpointer = Checkpointer(directory)
        checkpointer.save(3, saved, {"step": 3})
        restored, meta = checkpointer.restore(None, target)
        checkpointer.close()
    layouts_match = all(
        r.sharding.is_equivalent_to(t.sharding, r.ndim)
        for r, t in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True)
    )
    q = restored["base"]["layers"]["q"]
    return {
        "values": _tree_diff(restored, saved),
        "layouts_match": layouts_match,
        "q_spec": str(q.sharding.spec),
        "meta_step": meta["step"],
    }


class _Verifier:
    """Slot 0 of every other prompt's group passes; the others pass by a hash of their text (rarely), so some
    groups are cliffs and some of their re-rolls pass."""

    def __init__(self, golds: list[str]):
        self.easy = set(golds[1::2])

    def score(self, responses, golds):
        passed = [
            (g in self.easy and i % 2 == 0) or (g not in self.easy and zlib.crc32(r.encode()) % 4 == 0)
            for i, (r, g) in enumerate(zip(responses, golds, strict=True))
        ]
        return np.array(passed, np.float32)

    def close(self):
        pass


def _train_config(workdir: str, **mesh):
    from lspo_jax.job.config import load_config
    from lspo_jax.tasks import toy

    rows = toy.addition_rows(8, (2, 2), seed=0)
    train_file = os.path.join(workdir, "train.jsonl")
    with open(train_file, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    values = {
        "model.path": toy_model.ensure_model(os.path.join(workdir, "toy"), steps=0),
        "model.lora": {"rank": 4, "alpha": 16.0},
        "data.train": train_file, "data.instruction_position": "none", "data.max_prompt_tokens": 16,
        "data.max_solution_tokens": 48, "data.shuffle": False, "rollout.prompts_per_step": 4, "rollout.group_size": 2,
        "rollout.max_new_tokens": 12, "reward.overlong_buffer": 4, "reward.workers": 0, "optim.lr": 1e-3,
        "optim.eps": 1e-3, "scaffold.sft_steps": 2, "scaffold.sft.lr": 1e-2, "scaffold.sft.eps": 1e-3,
        "eval.every": 0, "checkpoint.every": 100, "loss.micro_batches": 2, "loss.chunk_size": 8, "steps": 2,
        **{f"mesh.{k}": v for k, v in mesh.items()},
    }  # fmt: skip
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in values.items()]), [r["answer"] for r in rows]


def _train(config, golds, out: str, *, steps: int, resume: bool = False):
    import dataclasses

    from lspo_jax.job.metrics_log import read_metrics
    from lspo_jax.job.run import Run

    job = Run(dataclasses.replace(config, steps=steps), out, resume=resume, verifier=_Verifier(golds))
    try:
        job.train()
        base = jax.tree.map(np.asarray, job.state.params["base"])
        spec = str(getattr(job.state.params["base"]["layers"]["q"].sharding, "spec", None))
    finally:
        job.close()
    records = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if r.get("kind") == "train"]
    return base, records, spec


def check_train_loop(params) -> dict:
    """Two LSPO steps of the training loop on fsdp = 4 x tp = 2 against the same on one device
    (``mesh.enabled: false``): sampling, scoring, the adapter's SFT, re-rolls, splicing and the RL update.

    Restoring a checkpoint on another layout is ``check_checkpoint``'s; each layout here compiles every
    program of the loop again, so one mesh covers both kinds of split."""
    keys = ("loss", "accuracy_mean", "cliff_groups", "surpassed_groups", "spliced_rows", "grad_norm", "sft_loss")
    with tempfile.TemporaryDirectory() as workdir:
        single, golds = _train_config(workdir, enabled=False)
        mesh, _ = _train_config(workdir, enabled=True, data=1, fsdp=4, tp=2)
        ref, ref_records, _ = _train(single, golds, os.path.join(workdir, "one"), steps=2)
        got, got_records, spec = _train(mesh, golds, os.path.join(workdir, "mesh"), steps=2)
        start = _train_config_base(single)
    metric_diff = max(
        abs(float(a[k]) - float(b[k])) for a, b in zip(ref_records, got_records, strict=True) for k in keys
        if a.get(k) is not None
    )  # fmt: skip
    return {
        "params": _tree_diff(got, ref),
        "moved": _tree_diff(got, start),
        "metrics": metric_diff,
        "records": len(got_records),
        "cliffs": sum(r["cliff_groups"] for r in got_records),
        "spliced": sum(r["spliced_rows"] for r in got_records),
        "q_spec": spec,
    }


def check_eval(_params) -> dict:
    """``lspo-eval`` on every device (rows split over 8) against the same on the first alone: which devices
    sampled, and the responses' tokens, which depend only on the key and the row, so equal."""
    from lspo_jax.job import cli, eval_command
    from lspo_jax.tasks import toy

    with tempfile.TemporaryDirectory() as workdir:
        bench = os.path.join(workdir, "sums.jsonl")
        with open(bench, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in toy.addition_rows(4, (2, 2), seed=1))
        model_dir = toy_model.ensure_model(os.path.join(workdir, "toy"), steps=0)
        out = {}
        for name, mesh in (("all", eval_command.eval_mesh), ("first", lambda: None)):
            eval_command.eval_mesh, kept = mesh, eval_command.eval_mesh
            try:
                argv = ["--model", model_dir, "--benchmarks", bench, "--n", "2", "--max-new-tokens", "8", "--workers",
                        "0", "--out", os.path.join(workdir, f"{name}.json"), "data.instruction_position=none",
                        "data.max_prompt_tokens=32"]  # fmt: skip
                with contextlib.redirect_stdout(sys.stderr):  # this script's stdout is its JSON alone
                    status = cli.eval_main(argv)
            finally:
                eval_command.eval_mesh = kept
            with open(os.path.join(workdir, f"{name}.json")) as f:
                result = json.load(f)
            with open(os.path.join(workdir, f"{name}.samples.jsonl")) as f:
                responses = [json.loads(line)["tokens"] for line in f]
            out[name] = {"status": status, "devices": result["devices"], "responses": responses}
    return {"devices": [out["all"]["devices"], out["first"]["devices"]], "status": [out["all"]["status"],
            out["first"]["status"]], "samples": len(out["all"]["responses"]),
            "responses_equal": out["all"]["responses"] == out["first"]["responses"]}  # fmt: skip


def _train_config_base(config):
    from lspo_jax.models import hf

    return jax.tree.map(np.asarray, hf.load_pretrained(config.model.path)[1]["base"])


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    params, batch = _params(), _batch()
    results = {}
    for name, check in (
        ("steps", check_steps),
        ("packed", check_packed),
        ("sampler", check_sampler),
        ("decode_kernel", lambda _: check_decode_kernel()),
        ("param_bytes", check_param_bytes),
        ("checkpoint", check_checkpoint),
        ("train_loop", check_train_loop),
        ("eval", check_eval),
    ):
        if sys.argv[1:] and name not in sys.argv[1:]:  # a subset by name, for working on one check
            continue
        start = time.perf_counter()
        results[name] = check(params, batch) if name == "steps" else check(params)
        results[name]["seconds"] = time.perf_counter() - start
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
