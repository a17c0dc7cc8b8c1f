"""vLLM engine checks, run by ``test_vllm.py`` in a fresh process: ``python tests/helpers/vllm_checks.py``.

After the engine's checks (and with their engine closed), the same process runs two LSPO steps of
``configs/demo.yaml`` with ``rollout.engine=vllm``: the result's ``train`` holds the run's train records and whether
its summary was written; then, on the same run and engine, steps whose merged-adapter sync pushes the base weights
instead: ``train.base_for_adapter`` holds the error the scaffold's adapter check stopped them with. Then
``lspo-train`` of a model whose head_dim vLLM's CPU attention lacks: ``refusal`` holds its exit status and what it
printed.

vLLM spawns processes (so its caller needs the main-module guard) and takes about 30 s to start and 20 s to
warm up, so one engine serves every check here; the script prints one JSON object of measured numbers
(token matches, largest log-prob differences, sync counts and times) and the test file asserts on them.

The model: a random float32 Qwen2 with head_dim 64 (what vLLM's CPU attention supports), untied embeddings,
over the toy character vocabulary, with the character tokenizer saved beside it.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import tempfile
import time

import jax
import numpy as np
from wide_params import wide_params

from lspo_jax.config import LoraConfig, ModelConfig
from lspo_jax.models import hf
from lspo_jax.rl import logprobs
from lspo_jax.rollout import sampler, samples
from lspo_jax.tasks import toy

CONFIG = ModelConfig(
    vocab_size=toy.vocab_size(), hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
    num_kv_heads=1, head_dim=64, rope_theta=100.0, max_position_embeddings=512, tie_word_embeddings=False,
    bos_token_id=toy.BOS_ID, eos_token_id=toy.EOS_ID, lora=LoraConfig(rank=8, alpha=32.0),
)  # fmt: skip
NEW = 12  # new tokens per row
T = 0.7  # sampling temperature of the log-prob check


def random_params(seed: int = 0, config: ModelConfig = CONFIG):
    """O(1) logits (``wide_params``) and a non-zero adapter that changes the greedy output."""
    return wide_params(config, seed, lora_std=0.1)


@functools.partial(jax.jit, static_argnames=("temperature", "lora_scale"))
def _logprobs(params, tokens, mask, temperature, lora_scale):
    logp, _ = logprobs.sequence_logprobs(CONFIG, params, tokens, mask, temperature=temperature, lora_scale=lora_scale)
    return logp


def teacher_forced(params, prompts, batch: samples.SampleBatch, *, temperature: float, lora_scale: float = 0.0):
    """Our log-probs of each row's sampled tokens given its prompt: [rows, NEW], 0 past each length."""
    width = max(len(p) for p in prompts) + NEW
    tokens = np.zeros((len(batch.lengths), width), np.int32)
    mask = np.zeros_like(tokens)
    for row, length in enumerate(batch.lengths.tolist()):
        prompt = prompts[row // batch.n]
        seq = list(prompt) + batch.tokens[row, :length].tolist()
        tokens[row, : len(seq)], mask[row, : len(seq)] = seq, 1
    logp = np.asarray(_logprobs(params, tokens, mask, temperature, lora_scale))
    out = np.zeros((len(batch.lengths), NEW), np.float32)
    for row, length in enumerate(batch.lengths.tolist()):
        start = len(prompts[row // batch.n])
        out[row, :length] = logp[row, start : start + length]
    return out


def valid(batch: samples.SampleBatch) -> np.ndarray:
    return np.arange(batch.tokens.shape[1])[None, :] < batch.lengths[:, None]


def max_diff(a, b, mask) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))[mask])) if mask.any() else 0.0


def jax_greedy(params, prompts, *, lora_scale=0.0, eos=()):
    return sampler.generate_arrays(
        CONFIG, params, prompts, key=jax.random.key(0), max_new_tokens=NEW, greedy=True, temperature=1.0,
        eos_token_ids=eos, lora_scale=lora_scale, cache_window=16,
    )  # fmt: skip


def same_tokens(a: samples.SampleBatch, b: samples.SampleBatch) -> bool:
    return bool(
        np.array_equal(a.tokens, b.tokens) and np.array_equal(a.lengths, b.lengths) and np.array_equal(a.eos, b.eos)
    )


def compare(engine_batch, jax_batch) -> dict:
    return {
        "tokens_equal": same_tokens(engine_batch, jax_batch),
        "logprobs": max_diff(engine_batch.logprobs, jax_batch.logprobs, valid(jax_batch)),
    }


def greedy_kw() -> dict:
    """The engine's greedy arguments, those of ``jax_greedy``."""
    return dict(key=jax.random.key(0), max_new_tokens=NEW, greedy=True, temperature=1.0)


def start_engine(workdir: str):
    """The random params saved to ``workdir`` and an engine started on them; its start and warm-up times."""
    from lspo_jax.rollout.vllm_sampler import VLLMSampler

    params = random_params()
    hf.save_pretrained(workdir, CONFIG, params)
    toy.char_tokenizer().save_pretrained(workdir)
    t0 = time.perf_counter()
    engine = VLLMSampler(workdir, CONFIG, kv_cache_space_gib=1, dtype="float32", max_model_len=512, seed=0)
    out = {"time_engine_start": time.perf_counter() - t0, "time_warmup": engine.warmup()}
    return engine, params, out


def pushed_tensors(engine, params) -> dict:
    """The pushed tensors are exactly hf.to_hf_state_dict's, in its order."""
    reference = list(hf.to_hf_state_dict(CONFIG, params))
    ours = list(engine._hf_tensors(CONFIG, params["base"], {"layers", "outer"}))
    return {
        "hf_names_equal": [k for k, _ in reference] == [k for k, _ in ours],
        "hf_values_equal": all(np.array_equal(a, b.numpy()) for (_, a), (_, b) in zip(reference, ours, strict=True)),
    }


def check_prompts(block: int) -> list[list[int]]:
    """Two short prompts and one spanning two full KV blocks, so the prefix cache has blocks to reuse."""
    rng = np.random.default_rng(1)
    long_prompt = rng.integers(4, CONFIG.vocab_size, size=2 * block + 3).tolist()
    return [[toy.BOS_ID, 5, 6, 7, 8], [toy.BOS_ID, *range(20, 28)], [toy.BOS_ID, *long_prompt]]


def sampled_checks(engine, params, prompts) -> dict:
    """Sampled tokens' log-probs after a sync equal our teacher-forced ones (temperature T, n = 2); a key repeats
    its samples, and a repeated call with the same params does not sync again."""
    from lspo_jax.rollout.vllm_sampler import logprob_mismatch

    out: dict = {}
    t0 = time.perf_counter()
    sampled = engine.generate_arrays(params, prompts, key=jax.random.key(1), max_new_tokens=NEW, temperature=T, n=2)
    out["time_generate_first"] = time.perf_counter() - t0
    out["first_sync_s"] = engine.stats["last_sync_s"]
    out["first_sync_tensors"] = engine.stats["last_sync_tensors"]
    ours_logp = teacher_forced(params, prompts, sampled, temperature=T)
    out["sampled"] = {
        "shape": list(sampled.tokens.shape),
        "lengths": sampled.lengths.tolist(),
        "logprobs": max_diff(sampled.logprobs, ours_logp, valid(sampled)),
        "mismatch": logprob_mismatch(ours_logp, sampled.logprobs, valid(sampled)),
        "samples_differ": any(
            not np.array_equal(sampled.tokens[2 * i], sampled.tokens[2 * i + 1]) for i in range(len(prompts))
        ),
    }
    again = engine.generate_arrays(params, prompts, key=jax.random.key(1), max_new_tokens=NEW, temperature=T, n=2)
    other = engine.generate_arrays(params, prompts, key=jax.random.key(2), max_new_tokens=NEW, temperature=T, n=2)
    out["sampled"]["same_key_same_tokens"] = same_tokens(sampled, again)
    out["sampled"]["other_key_other_tokens"] = not np.array_equal(sampled.tokens, other.tokens)
    out["syncs_after_repeat_calls"] = engine.stats["syncs"]  # the params did not change: still 1
    out["cached_prompt_tokens_repeat"] = engine.stats["last_cached_prompt_tokens"]  # the long prompt's blocks
    return out


def greedy_checks(engine, params, prompts):
    """Greedy equals our sampler's greedy, EOS included: the engine's base greedy batch and the comparisons."""
    base_greedy = engine.generate_arrays(params, prompts, **greedy_kw())
    base_jax = jax_greedy(params, prompts)
    out: dict = {"base_greedy": compare(base_greedy, base_jax)}
    # EOS: row 0's first token that it has not emitted before, from its 4th on, so row 0 ends early there.
    row0 = base_jax.tokens[0].tolist()
    stop_at = next((i for i in range(3, NEW) if row0[i] not in row0[:i]), NEW - 1)
    eos = [row0[stop_at]]
    out["eos_stop_at"] = stop_at
    out["eos_greedy"] = compare(engine.generate_arrays(params, prompts, eos_token_ids=eos, **greedy_kw()),
                                jax_greedy(params, prompts, eos=eos))  # fmt: skip
    eos_jax = jax_greedy(params, prompts, eos=eos)
    out["eos_greedy"].update(lengths=eos_jax.lengths.tolist(), eos=eos_jax.eos.tolist())
    return base_greedy, out


def update_checks(engine, params, prompts, base_greedy) -> dict:
    """An update is followed (greedy and sampled), and undone exactly when the old params come back."""
    base = params["base"]
    updated = {
        **params,
        "base": {
            **base,
            "lm_head": base["lm_head"][:, ::-1] * 1.3,  # a permuted, sharper head
            "layers": {**base["layers"], "up": base["layers"]["up"] * 1.5},
        },
    }
    out: dict = {}
    new_greedy = engine.generate_arrays(updated, prompts, **greedy_kw())
    out["update_sync_s"] = engine.stats["last_sync_s"]
    out["update_sync_tensors"] = engine.stats["last_sync_tensors"]
    out["cached_prompt_tokens_after_sync"] = engine.stats["last_cached_prompt_tokens"]
    out["updated_greedy"] = compare(new_greedy, jax_greedy(updated, prompts))
    out["updated_greedy"]["differs_from_base"] = not np.array_equal(new_greedy.tokens, base_greedy.tokens)
    new_sampled = engine.generate_arrays(
        updated, prompts, key=jax.random.key(1), max_new_tokens=NEW, temperature=T, n=2
    )
    out["updated_sampled_logprobs"] = max_diff(
        new_sampled.logprobs, teacher_forced(updated, prompts, new_sampled, temperature=T), valid(new_sampled)
    )
    restored = engine.generate_arrays(params, prompts, **greedy_kw())
    out["restored"] = {
        "tokens_equal": same_tokens(restored, base_greedy),
        "logprobs_exact": bool(np.array_equal(restored.logprobs, base_greedy.logprobs)),
        "sync_s": engine.stats["last_sync_s"],
    }
    return out


def adapter_checks(engine, params, prompts, base_greedy) -> dict:
    """Adapter on through merged weights equals our sampler's adapter-on greedy; the base comes back after."""
    syncs = engine.stats["syncs"]
    adapter = engine.generate_arrays(params, prompts, lora_scale=1.0, **greedy_kw())
    adapter_jax = jax_greedy(params, prompts, lora_scale=1.0)
    out: dict = {"adapter_greedy": compare(adapter, adapter_jax)}
    out["adapter_greedy"]["differs_from_base"] = not np.array_equal(adapter.tokens, base_greedy.tokens)
    out["adapter_greedy"]["sync_s"] = engine.stats["last_sync_s"]
    out["adapter_greedy"]["sync_tensors"] = engine.stats["last_sync_tensors"]
    adapter_sampled = engine.generate_arrays(
        params, prompts, key=jax.random.key(3), max_new_tokens=NEW, temperature=T, n=2, lora_scale=1.0
    )
    out["adapter_sampled_logprobs"] = max_diff(
        adapter_sampled.logprobs,
        teacher_forced(params, prompts, adapter_sampled, temperature=T, lora_scale=1.0),
        valid(adapter_sampled),
    )
    after = engine.generate_arrays(params, prompts, **greedy_kw())
    out["after_adapter"] = {
        "tokens_equal": same_tokens(after, base_greedy),
        "logprobs_exact": bool(np.array_equal(after.logprobs, base_greedy.logprobs)),
        "sync_s": engine.stats["last_sync_s"],
        "sync_tensors": engine.stats["last_sync_tensors"],
        "syncs": engine.stats["syncs"] - syncs,  # merged in, base back: 2
    }
    return out


def sync_timings(engine, params) -> dict:
    """Warm timings: merged adapter in and base back again (the merge's programs are compiled by now)."""
    out = {
        "adapter_push_warm_s": engine.sync_weights(CONFIG, params, lora_scale=1.0),
        "base_restore_warm_s": engine.sync_weights(CONFIG, params),
    }
    t0 = time.perf_counter()
    out["forced_full_sync_s"] = engine.sync_weights(CONFIG, params, force=True)
    out["time_forced_sync_call"] = time.perf_counter() - t0
    return out


def main(workdir: str) -> dict:
    """The engine checks in order (each sync and the prefix cache's stats follow from the calls before it)."""
    engine, params, out = start_engine(workdir)
    out.update(pushed_tensors(engine, params))
    out["block_size"] = block = int(engine.llm.llm_engine.vllm_config.cache_config.block_size)
    prompts = check_prompts(block)
    out.update(sampled_checks(engine, params, prompts))
    base_greedy, greedy = greedy_checks(engine, params, prompts)
    out.update(greedy)
    out.update(update_checks(engine, params, prompts, base_greedy))
    out.update(adapter_checks(engine, params, prompts, base_greedy))
    out.update(sync_timings(engine, params))
    out["stats"] = dict(engine.stats)
    engine.close()  # before a run in the same process starts its own
    return out


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_CONFIG = os.path.join(ROOT, "configs", "demo.yaml")
TRAIN_OVERRIDES = ["steps=2", "rollout.engine=vllm", "eval.limit=4", "eval.n=1", "eval.ks=[1]", "reward.workers=0",
                   "rollout.prompts_per_step=8", "scaffold.min_cliff_bucket=8"]  # fmt: skip


def train(workdir: str) -> dict:
    """Two steps of the demo run with vLLM rollouts: its train records and whether the summary exists; then
    ``base_for_adapter`` on the same run (its engine still up: a second start costs tens of seconds)."""
    from lspo_jax.job.config import load_config
    from lspo_jax.job.run import Run

    out_dir = os.path.join(workdir, "run")
    job = Run(load_config(DEMO_CONFIG, TRAIN_OVERRIDES), out_dir)  # what train_run does, the run kept open
    try:
        job.train()
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
        return {
            "train_records": [r for r in records if r.get("kind") == "train"],
            "summary_exists": os.path.exists(os.path.join(out_dir, "summary.json")),
            "base_for_adapter": base_for_adapter(job),
            "stale_engine": stale_engine(job),
        }
    finally:
        job.close()


def base_for_adapter(job, tries: int = 3) -> dict:
    """Up to ``tries`` more steps of ``job`` with the engine's merged-adapter sync pushing the base weights (the
    merge replaced by the base: the engine then samples the re-rolls from the base) and every re-roll scored as
    passing (so each cliff splices rows): the adapter check's error message (None if no step raised it), the steps
    tried and the step the run is at after them."""
    from lspo_jax.rl.scaffold import AdapterNotOnError
    from lspo_jax.rollout import vllm_sampler

    learner, merge = job.learner, vllm_sampler.merge_lora
    real_score = learner.score

    def score(rows, golds, *, per_row=False):
        scored = real_score(rows, golds, per_row=per_row)
        return scored.replace(accuracy=np.ones_like(scored["accuracy"])) if per_row else scored  # re-rolls: per row

    vllm_sampler.merge_lora = lambda config, params, scale: params["base"]
    learner.score = score
    out: dict = {"error": None, "steps_tried": 0}
    try:
        while out["error"] is None and out["steps_tried"] < tries:
            out["steps_tried"] += 1
            try:
                job.one_step()
            except AdapterNotOnError as err:
                out["error"] = str(err)
    finally:
        vllm_sampler.merge_lora = merge
        del learner.score
    out["step_after"] = job.state.step
    return out


def stale_engine(job, tries: int = 3) -> dict:
    """Up to ``tries`` more steps of ``job`` with the engine's base syncs skipped (it keeps the weights it last got:
    the base before an update, or the merged adapter of the last re-rolls), each step's record put through the run's
    gap check as the loop does: the error (None if none came), the steps tried and each step's gap."""
    from lspo_jax.job.run import SamplerGapError
    from lspo_jax.rollout.vllm_sampler import VLLMSampler

    real = VLLMSampler.sync_weights

    def sync_weights(self, config, params, *, lora_scale=0.0, force=False):
        return 0.0 if not lora_scale else real(self, config, params, lora_scale=lora_scale, force=force)

    VLLMSampler.sync_weights = sync_weights
    out: dict = {"error": None, "steps_tried": 0, "gaps": []}
    try:
        while out["error"] is None and out["steps_tried"] < tries:
            out["steps_tried"] += 1
            metrics = job.one_step()
            out["gaps"].append(metrics["rollout/logprob_gap"])
            try:
                job._check_gap(metrics)
            except SamplerGapError as err:
                out["error"] = str(err)
    finally:
        VLLMSampler.sync_weights = real
    return out


PAPER_CONFIG = os.path.join(os.path.dirname(DEMO_CONFIG), "lspo_deepmath_r1_distill_qwen_1p5b.yaml")


def refusal(workdir: str) -> dict:
    """``lspo-train`` with ``rollout.engine=vllm`` on a model of head_dim 16: its exit status and stderr. Here, where
    vLLM is imported already: an import of its own costs a process tens of seconds."""
    import contextlib
    import dataclasses
    import io

    from lspo_jax.job import cli
    from lspo_jax.rollout import vllm_sampler

    config = dataclasses.replace(CONFIG, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16)
    model_dir = os.path.join(workdir, "head_dim_16")
    hf.save_pretrained(model_dir, config, random_params(config=config))
    toy.char_tokenizer().save_pretrained(model_dir)
    train_file = os.path.join(workdir, "train.jsonl")
    with open(train_file, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in toy.addition_rows(8, (2, 2), seed=0))
    argv = ["--config", PAPER_CONFIG, "--out", os.path.join(workdir, "refused"), f"model.path={model_dir}",
            f"data.train={train_file}", "data.instruction_position=none", "rollout.engine=vllm",
            "data.max_prompt_tokens=64", "rollout.max_new_tokens=64", "eval.max_new_tokens=64",
            "reward.overlong_buffer=16"]  # fmt: skip
    engine, vllm_sampler.VLLMSampler = vllm_sampler.VLLMSampler, None  # an engine start would fail loudly
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = cli.train_main(argv)
    finally:
        vllm_sampler.VLLMSampler = engine
    return {"code": code, "stderr": err.getvalue()}


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t_main = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="vllm_checks_")
    try:
        # One process for both: each start imports vLLM, torch and JAX again (tens of seconds on 2 cores).
        os.makedirs(os.path.join(workdir, "engine"))
        result = {**main(os.path.join(workdir, "engine")), "train": train(workdir), "refusal": refusal(workdir)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["time_total"] = time.perf_counter() - t_main
    sys.stdout.flush()
    print("VLLM_CHECKS_JSON " + json.dumps(result))
