"""One-shot GPU benchmark: our sampler and RL step beside transformers + torch at the same shapes, one LSPO step, and
vLLM engines, one per GPU, sampling the paper's step.

Random weights of the DeepSeek-R1-Distill-Qwen-1.5B shape, bfloat16 compute. Each section runs in its own
subprocess: a crash or an out-of-memory in one leaves the others and the JSON intact, and each starts with
the whole device memory (JAX's allocator keeps what it has taken, and torch must fit beside it).

sampler  ``sampler.generate_arrays`` and transformers ``generate()`` (torch, bf16 weights, sdpa attention):
         prompt 256 random ids, exactly 512 new tokens per row (our EOS set is empty; HF gets
         ``min_new_tokens = max_new_tokens``), batch 256, then 64. new tokens/s = batch x 512 / wall time of
         one call, prompt pass included: ours the best of ``--repeats`` calls after a compiling call, HF one
         call after a short warm-up call. Decode floor: a decode step must read, once, from HBM, the bf16
         weights it uses whole (every parameter but the input embedding table, of which it reads one row per
         sequence) and the KV cache up to its context:
             floor_s = sum_{i=1}^{N-1} (W + batch x kv_bytes_per_token x (P + i)) / HBM
         for P prompt and N new tokens, HBM = ``--hbm-tb-s`` (4.8 TB/s, the H200 data sheet; 4.23 TB/s was
         measured read+write). ``floor_fraction = floor_s / (call time - prompt pass time)``, 1 = the bound.
         HF has no separate prompt pass, so its fraction divides by the whole call (a slight underestimate).
         Then, at batch 256 (``sampler_mixed_b256``): every other row ends at a sixteenth of the new tokens (32),
         the rest at 512, as the rollouts of a step end at different lengths; ``sampler_mixed_vs_uniform_cost`` is
         its call time over the uniform one's (the sampler drops ended rows every ``compact_every`` steps: about
         0.53 when the cost follows the live rows). ``sampler_pallas_b256`` reruns the uniform batch with
         ``decode_attention: pallas`` (the Pallas GPU decode kernel), after checking it against ``einsum`` on one
         decode step's attention at the same cache shape, and ``sampler_pallas_speedup`` is the default's call
         time over it.
train    the learner's RL program (``distributed.sharded_rl_step``: ``optim.rl_step`` with the project's AdamW,
         ``optim.make_optimizer``), float32 master weights, bf16 compute, params and optimizer state donated, on
         8 x 2048 tokens, for each
         attention kernel of ``--attention`` (``cudnn``: the fused flash kernel; ``einsum``: the written-out
         path; on a backend without cuDNN ``cudnn`` runs as ``xla``). A fused kernel is first checked against
         einsum (log-probs and gradient, 2 layers at the model's widths, left- and right-padded rows) and is
         timed only if they agree. Remat policies (``--remat``, else none,dots,full fused and dots,full
         einsum) are tried in order until one fits; the headline is the fastest variant. Beside it transformers +
         torch at the same shape by the usual recipe: float32 weights, ``torch.autocast`` bf16, loss = mean next-token
         cross-entropy (``labels = input_ids``), global-norm clipping at 1.0 (as our optimizer), fused AdamW.
             MFU = tokens/s x (6 N + 6 L d_attn T) / peak
         N counts the weights of every matmul: all parameters but the input embedding table (a lookup; the LM
         head is counted). 12 L d_attn T per token is attention's QK^T and PV forward + backward (d_attn = heads
         x head_dim, T the sequence length), halved because the causal mask leaves half the score matrix
         useful. peak = ``--peak-tflops`` (989, dense bf16 of an H100/H200). Recomputation under remat is not
         counted: MFU counts the model's FLOPs, not the hardware's.
         Then the packed step (``train_packed``): rows of the paper's relative lengths (a ninth of the row for the
         prompt part, responses log-normal as ``tools/bench_packing.py``), padded with the fastest kernel and
         remat above, against the same rows packed into token buffers (``packing.pack_rows``) through ``pallas``
         (Pallas GPU attention with segment ids, first checked against einsum) and ``blocked``.
lspo     ``train.train_step`` at a reduced shape (4 prompts x 16 rollouts, 64 prompt + 512 new tokens, 512-token
         worked solutions): a warm-up step compiles every program, a timed LSPO step, then a timed DAPO step
         (``scaffold.enabled: false``, the same compiled programs). A fake verifier makes every other group a
         cliff and passes re-roll 1 of each cliff, so every step fits, re-rolls and splices the same rows.
         Rows never end early (no EOS): the longest step at this shape. The shape is reduced to keep compiling
         and running inside one call's budget; ``--shape lspo_prompts=8 --shape lspo_new_tokens=1024`` gives
         8 x 16 x 1024, the log-prob passes running in ``lspo_micro_batches`` groups of rows.
             scaffold_share = (time_sft + time_reroll + the LSPO step's reward and log-prob time beyond the DAPO
                               step's) / LSPO step time
         and ``scaffold_share_vs_dapo = 1 - DAPO step / LSPO step``. Without the DAPO step (time budget) the share
         is the lower bound (time_sft + time_reroll) / step time, and ``scaffold_share_method`` says so.
vllm     the layout of ``rollout.engine: vllm`` (``benchmarks/vllm_layout.py``): one worker process per visible GPU
         (``CUDA_VISIBLE_DEVICES`` one GPU each), joined by ``jax.distributed``, each with its own in-process engine
         (``vllm_sampler.VLLMSampler``) started from one Hugging Face directory of the random bf16 weights. Each
         times a full weight sync from params sharded over all the processes' devices (``vllm_sync_s``: the
         slowest engine's, after an untimed sync that compiles; ``vllm_sync_host_bytes``, 0 on the DLPack path),
         then samples its block (``prompt_share``) of the paper's step: 32 prompts of 256 random ids x 16
         rollouts, exactly 8,192 new tokens each (no EOS). ``vllm_sample_s`` = the slowest engine's own generate
         call, ``vllm_tokens_per_s`` = every engine's tokens / ``vllm_sample_s`` (``_per_gpu``: over the engines);
             vllm_step_sample_s = max_e |prompt_share(32, e, N)| x 16 x 8192 / (tokens_e / seconds_e)
         for N engines, each at its own rate: the measured slowest engine's seconds at the paper's shape, a linear
         projection at a smaller one (``--shape vllm_new_tokens=2048``: later tokens, over a longer context, cost
         more, so it is a lower bound). Without vLLM (the GPU machine's Python) the section is recorded as skipped.

Profiles: once their figures are recorded, ``sampler_b256`` (at the section's end) and each train kernel run once
more under ``jax.profiler``; the ops that took the device's time (self time on the busiest device timeline, top
15) are recorded as ``profile_<part>`` and printed. A profile that does not fit the budget is skipped, and one
that hangs ends its section after ``common.PROFILE_WATCHDOG_S`` (the later sections still run). ``--profile DIR``
keeps the traces (``python -m benchmarks.trace_summary DIR/PART`` prints the same table); ``--no-profile`` skips the
extra runs.

``--smoke`` shrinks every shape (tiny model preset, short prompts, few tokens, tiny batches) and runs the same
code, transformers on the CPU included; its numbers measure nothing. The ``_b256``/``_b64`` keys name the GPU
batches; ``shapes`` in the JSON holds the sizes used.

    python3 -m benchmarks.gpu --time-budget 450     # the H200; writes benchmarks/results/gpu.json
    JAX_PLATFORMS=cpu python -m benchmarks.gpu --smoke --out /tmp/gpu_smoke.json

Every part fits no single call of a few minutes: the estimates (``common.ESTIMATE_S``) add up to about 15 minutes with
the profiles, 7 more where vLLM is installed. Split over calls, each later call merges the sections it does not run
from the earlier JSON:

    python3 -m benchmarks.gpu --only sampler,train --time-budget 450 --out $OUT/gpu.json
    # copy that gpu.json to benchmarks/results/gpu.json, then
    python3 -m benchmarks.gpu --only lspo --time-budget 220 --merge benchmarks/results/gpu.json \
        --out $OUT/gpu.json
    python3 -m benchmarks.gpu --only vllm --merge benchmarks/results/gpu.json --out $OUT/gpu.json  # with vLLM

It runs from the root of a checkout (``-m``: the packages ``benchmarks`` and ``lspo_jax`` import from there), without
installing the package, on a Python that has jax, flax, optax, orbax-checkpoint, transformers and torch but not
math-verify, tensorboardX or vLLM (as on the GPU machine; the vllm section then records why it skipped);
``tests/test_gpu_bench.py`` runs the smoke shapes with those three hidden. With vLLM's CPU build, ``--smoke --only
vllm`` runs two CPU engines (``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` gives each model every core), in a minute or two.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import hf_baseline, vllm_layout
from benchmarks.common import SMOKE_SHAPES, Context, Recorder, Shapes, estimate_s, log, write_json
from lspo_jax.config import ATTENTION_IMPLS, ModelConfig
from lspo_jax.job import evaluation
from lspo_jax.models import sharding
from lspo_jax.models.attention import decode_attend
from lspo_jax.models.specs import count_params, init_params
from lspo_jax.rl import distributed, logprobs, losses, optim, packing, step_record, train
from lspo_jax.rl.learner import Learner
from lspo_jax.rl.phases import Phases
from lspo_jax.rl.prompts import Draw
from lspo_jax.rollout import sampler
from lspo_jax.rollout.generator import Policy
from lspo_jax.rollout.kv_cache import cache_nbytes
from lspo_jax.step_config import LossConfig, RewardConfig, RolloutConfig, ScaffoldConfig
from lspo_jax.tasks.data import Example
from lspo_jax.train_config import DataConfig, TrainConfig

SECTIONS = ("sampler", "train", "lspo", "vllm")
BATCH_LABELS = ("b256", "b64")
PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "nvidia-cudnn-cu13", "flax", "optax")
PACKAGES += ("orbax-checkpoint", "transformers", "torch", "numpy")
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu.json")

CORE_PARTS = {
    "sampler": ("sampler_b256", "hf_generate_b256"),
    "train": ("hf_train", "attention_check", "train"),
    "lspo": ("lspo",),
    "vllm": ("vllm",),
}


# ------------------------------------------------------------------------------------------ arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON file to write (default: benchmarks/results/gpu.json)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, transformers on CPU allowed: checks the code")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    p.add_argument("--time-budget", type=float, help="seconds for the whole run; sections that would not fit skip")
    p.add_argument(
        "--profile", metavar="DIR", help="keep the jax.profiler traces in DIR/PART (default: summaries only)"
    )
    p.add_argument("--no-profile", action="store_true", help="skip the profiled extra call of sampler_b256 and train")
    p.add_argument("--remat", help="train remat policies, tried in order until one fits (default: per kernel)")
    p.add_argument("--attention", default="cudnn,einsum", help="train attention kernels to time, in order")
    p.add_argument("--lspo-attention", default="einsum", choices=ATTENTION_IMPLS, help="the LSPO step's kernel")
    p.add_argument("--chunk-size", type=int, default=0, help="train LM-head chunk (0: whole logits)")
    p.add_argument("--repeats", type=int, default=2, help="timed calls of our sampler per batch (best reported)")
    p.add_argument("--cache-window", type=int, default=sampler.DEFAULT_CACHE_WINDOW)
    p.add_argument("--hbm-tb-s", type=float, default=4.8, help="HBM bandwidth for the decode floor, TB/s")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU, TFLOP/s")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=VALUE", help="override one of Shapes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--merge", metavar="JSON", help="an earlier run's JSON: its sections that are not run now are kept")
    # Set by the parent for the subprocess that runs one section.
    p.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)
    p.add_argument("--section-file", help=argparse.SUPPRESS)
    p.add_argument("--soft-deadline", type=float, help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(args.only) - set(SECTIONS))
    if unknown:
        p.error(f"--only: unknown section(s) {unknown}; known: {list(SECTIONS)}")
    args.remat = [r for r in args.remat.split(",") if r] if args.remat else None
    args.attention = [a for a in args.attention.split(",") if a]
    unknown = sorted(set(args.attention) - set(ATTENTION_IMPLS))
    if unknown:
        p.error(f"--attention: unknown kernel(s) {unknown}; known: {list(ATTENTION_IMPLS)}")
    args.t0 = args.t0 or time.time()
    return args


def shapes_of(args: argparse.Namespace) -> Shapes:
    shapes = SMOKE_SHAPES if args.smoke else Shapes()
    types = {f.name: type(getattr(shapes, f.name)) for f in dataclasses.fields(shapes)}
    overrides = {}
    for item in args.shape:
        name, _, value = item.partition("=")
        if name not in types:
            raise SystemExit(f"--shape {item!r}: unknown name; known: {sorted(types)}")
        overrides[name] = types[name](value)
    return dataclasses.replace(shapes, **overrides)


def section_need_s(section: str, smoke: bool) -> float:
    return estimate_s("startup", smoke) + sum(estimate_s(part, smoke) for part in CORE_PARTS[section])


# ------------------------------------------------------------------------------------------- helpers
def model_config(shapes: Shapes, param_dtype: str, remat: str = "none", attention: str = "einsum") -> ModelConfig:
    return ModelConfig.preset(
        shapes.preset, param_dtype=param_dtype, compute_dtype="bfloat16", remat=remat, attention=attention
    )


def committed(tree):
    """``tree`` placed on the first device. jit keys its cache on placement: arrays fresh from a jitted init are
    uncommitted, those out of an update step committed, and mixing the two would compile every program twice."""
    return jax.device_put(tree, jax.devices()[0])


def init_committed(config: ModelConfig, seed: int):
    return committed(jax.jit(init_params, static_argnums=0)(config, jax.random.key(seed)))


def random_ids(config: ModelConfig, rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Ids in [1, min(vocab, 30000)): never the pad id 0, and ordinary tokens for a real vocabulary."""
    return rng.integers(1, min(config.vocab_size, 30000), size=shape).astype(np.int32)


def matmul_params(config: ModelConfig) -> int:
    """Weights of every matmul a token goes through: all base parameters but the input embedding table."""
    base = jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))["base"]
    lookup = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return count_params(base) - lookup


def train_flops_per_token(config: ModelConfig, seq: int) -> float:
    """6 N + 6 L d_attn T: dense matmuls plus causal attention, forward and backward (module docstring)."""
    return 6.0 * matmul_params(config) + 6.0 * config.num_layers * config.num_heads * config.head_dim * seq


def hf_device(ctx: Context) -> tuple[str | None, str]:
    """('cuda' | 'cpu', '') where transformers can run, else (None, why not); records torch's versions."""
    device, why_not, versions = hf_baseline.device(allow_cpu=ctx.args.smoke)
    ctx.rec.set(**versions)
    return device, why_not


def jax_peak_gb() -> float | None:
    stats = jax.devices()[0].memory_stats() or {}
    return round(stats["peak_bytes_in_use"] / 1e9, 2) if "peak_bytes_in_use" in stats else None


# ----------------------------------------------------------------------------------- section: sampler
def decode_floor_s(config: ModelConfig, params, batch: int, prompt_len: int, new_tokens: int, hbm: float) -> float:
    """``sum_{i=1}^{N-1} (W + batch x kv_per_token x (P + i)) / HBM`` (module docstring)."""
    base = params["base"]
    weights = sum(x.nbytes for x in jax.tree.leaves(base))
    if not config.tie_word_embeddings:
        weights -= base["embed"].nbytes
    kv_per_token = cache_nbytes(config, 1, 1)
    steps = new_tokens - 1
    context_sum = steps * prompt_len + steps * (steps + 1) // 2
    return (steps * weights + batch * kv_per_token * context_sum) / hbm


def sampler_kwargs(ctx: Context, lengths: list[int] | None = None) -> dict:
    n_new = ctx.shapes.sampler_new_tokens if lengths is None else lengths
    return dict(max_new_tokens=n_new, eos_token_ids=(), cache_window=ctx.args.cache_window)


def mixed_lengths(batch: int, new_tokens: int) -> list[int]:
    """Every other row ends at a sixteenth of ``new_tokens``, the rest at ``new_tokens``."""
    return [new_tokens if row % 2 else max(1, new_tokens // 16) for row in range(batch)]


def time_our_sampler(ctx: Context, config: ModelConfig, params, prompts: np.ndarray, lengths=None) -> dict:
    expected = np.full(len(prompts), ctx.shapes.sampler_new_tokens) if lengths is None else np.asarray(lengths)
    kw = sampler_kwargs(ctx, lengths)
    rows = prompts.tolist()
    start = time.perf_counter()
    out = sampler.generate_arrays(config, params, rows, key=jax.random.key(0), **kw)
    first_s = time.perf_counter() - start
    if not np.array_equal(out.lengths, expected):
        raise RuntimeError(f"rows ended early: lengths {sorted(set(out.lengths.tolist()))}")
    times = []
    for i in range(ctx.args.repeats):
        start = time.perf_counter()
        # generate_arrays fetches tokens to the host: the call returns only when the device is done.
        jax.block_until_ready(sampler.generate_arrays(config, params, rows, key=jax.random.key(i + 1), **kw))
        times.append(time.perf_counter() - start)
    prefill_times = []  # the prompt pass of the same call alone (its compiled program), to split off the decode
    for i in range(ctx.args.repeats):
        start = time.perf_counter()
        sampler.prefill_only(config, params, rows, key=jax.random.key(i + 1), **kw)
        prefill_times.append(time.perf_counter() - start)
    return {"first_call_s": first_s, "time_s": min(times), "times_s": times, "prefill_s": min(prefill_times)}


def section_sampler(ctx: Context) -> None:
    shapes, args, rec = ctx.shapes, ctx.args, ctx.rec
    config = model_config(shapes, "bfloat16")
    params = init_committed(config, args.seed)
    device, why_not = hf_device(ctx)
    hbm = args.hbm_tb_s * 1e12
    hf = {}  # the bf16 transformers model, built at first use and kept for the second batch
    profile_rows = None  # b256's prompts, profiled once every figure is recorded
    rng = np.random.default_rng(args.seed)
    for label in BATCH_LABELS:
        batch = getattr(shapes, f"sampler_batch_{label}")
        prompts = random_ids(config, rng, batch, shapes.sampler_prompt_len)
        floor_s = decode_floor_s(config, params, batch, shapes.sampler_prompt_len, shapes.sampler_new_tokens, hbm)
        new_tokens = batch * shapes.sampler_new_tokens
        ours = None
        part = f"sampler_{label}"
        skip = None if label == "b256" else ctx.room_for(part)
        if skip:
            rec.skip(part, skip)
        else:
            with rec.part(part):
                ours = time_our_sampler(ctx, config, params, prompts)
                decode_s = ours["time_s"] - ours["prefill_s"]
                ours.update(new_tokens_per_s=new_tokens / ours["time_s"], floor_s=floor_s, decode_s=decode_s)
                # None when timing noise makes the prompt pass look longer than the call (tiny smoke shapes).
                ours["floor_fraction"] = floor_s / decode_s if decode_s > 0 else None
                rec.set(**{part: ours})
                if label == "b256":
                    profile_rows = prompts.tolist()
                rec.headline(
                    **{f"sampler_tokens_per_s_{label}": ours["new_tokens_per_s"]},
                    **{f"sampler_floor_fraction_{label}": ours["floor_fraction"]},
                )
        part = f"hf_generate_{label}"
        skip = why_not or (None if label == "b256" else ctx.room_for(part))
        if skip:
            rec.skip(part, skip)
            continue
        with rec.part(part):
            if "model" not in hf:
                hf["model"] = hf_baseline.model(config, device, "bfloat16").eval()
            theirs = hf_baseline.time_generate(hf["model"], device, prompts, shapes.sampler_new_tokens)
            theirs.update(new_tokens_per_s=new_tokens / theirs["time_s"], floor_fraction=floor_s / theirs["time_s"])
            rec.set(**{part: theirs})
            rec.headline(**{f"hf_generate_tokens_per_s_{label}": theirs["new_tokens_per_s"]})
            if ours is not None:
                rec.headline(**{f"sampler_ratio_vs_hf_{label}": ours["new_tokens_per_s"] / theirs["new_tokens_per_s"]})
    if hf:
        hf.clear()
        hf_baseline.release(device)
    if profile_rows is not None:
        sampler_variants(ctx, config, params, np.asarray(profile_rows))
    rec.set(jax_peak_gb=jax_peak_gb())
    if profile_rows is not None:
        kw = sampler_kwargs(ctx)
        ctx.profile_call(
            "sampler_b256", lambda: sampler.generate_arrays(config, params, profile_rows, key=jax.random.key(0), **kw)
        )


def sampler_variants(ctx: Context, config: ModelConfig, params, prompts: np.ndarray) -> None:
    """The mixed-length batch and the Pallas decode kernel, each against the uniform batch-256 call."""
    rec, uniform_s = ctx.rec, rec_time(ctx.rec, "sampler_b256")
    part = "sampler_mixed_b256"
    lengths = mixed_lengths(len(prompts), ctx.shapes.sampler_new_tokens)
    skip = ctx.room_for(part)
    if skip:
        rec.skip(part, skip)
    else:
        with rec.part(part):
            mixed = time_our_sampler(ctx, config, params, prompts, lengths)
            mixed.update(new_tokens_per_s=sum(lengths) / mixed["time_s"], lengths=sorted(set(lengths)))
            rec.set(**{part: mixed})
            rec.headline(sampler_mixed_tokens_per_s_b256=mixed["new_tokens_per_s"])
            if uniform_s:
                rec.headline(sampler_mixed_vs_uniform_cost=mixed["time_s"] / uniform_s)
    part = "sampler_pallas_b256"
    skip = ctx.room_for(part)
    if skip:
        rec.skip(part, skip)
        return
    with rec.part(part):
        pallas = dataclasses.replace(config, decode_attention="pallas")
        check = check_decode_attention(pallas, len(prompts), prompts.shape[1], ctx.shapes.sampler_new_tokens)
        rec.set(sampler_pallas_check=check)
        timed = time_our_sampler(ctx, pallas, params, prompts)
        rec.set(**{part: timed})
        if uniform_s:
            rec.headline(sampler_pallas_speedup=uniform_s / timed["time_s"])


def rec_time(rec: Recorder, part: str) -> float | None:
    return (rec.data.get(part) or {}).get("time_s")


def check_decode_attention(config: ModelConfig, rows: int, prompt_len: int, new_tokens: int) -> dict:
    """``decode_attention: pallas`` against ``einsum`` on one decode step's attention at the benchmark's cache
    shape (bf16 keys and values, rows seeing ranges of different lengths); raises when they disagree."""
    slots = prompt_len + new_tokens
    keys = jax.random.split(jax.random.key(0), 3)
    dt = jnp.dtype(config.compute_dtype)
    q = jax.random.normal(keys[0], (rows, 1, config.num_heads, config.head_dim), dt)
    k, v = (jax.random.normal(x, (rows, config.num_kv_heads, slots, config.head_dim), dt) for x in keys[1:])
    start = jnp.arange(rows) % prompt_len
    end = prompt_len + 1 + jnp.arange(rows) % new_tokens
    mask = ((jnp.arange(slots) >= start[:, None]) & (jnp.arange(slots) < end[:, None]))[:, None]
    run = jax.jit(decode_attend, static_argnums=0)
    ref, out = (np.asarray(run(impl, q, k, v, mask), np.float32) for impl in ("einsum", config.decode_attention))
    error = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    if not error < 2e-2:  # bf16 inputs and outputs: 2^-8 per element, summed in other orders
        raise RuntimeError(f"decode_attention {config.decode_attention} is off einsum by {error:.3g} (relative)")
    return {"relative_error": error}


# ------------------------------------------------------------------------------------- section: train
def synthetic_rl_batch(config: ModelConfig, rows: int, seq: int, seed: int) -> dict:
    """Random tokens, every position but the first a response token, ``old_logp`` at the uniform policy's
    ``-log V`` (importance ratios near 1 for random weights), advantages +-1."""
    rng = np.random.default_rng(seed)
    mask = np.ones((rows, seq), np.int32)
    mask[:, 0] = 0
    batch = {
        "tokens": random_ids(config, rng, rows, seq),
        "attention_mask": np.ones((rows, seq), np.int32),
        "mask": mask,
        "old_logp": np.full((rows, seq), -math.log(config.vocab_size), np.float32),
        "advantages": np.where(np.arange(rows) % 2 == 0, 1.0, -1.0).astype(np.float32),
    }
    return committed(batch)


def time_rl_update(ctx: Context, config: ModelConfig, loss: LossConfig, batch: dict | None = None) -> tuple[dict, Any]:
    """The RL step on ``batch`` (default: ``synthetic_rl_batch``, every slot a real token), timed."""
    shapes = ctx.shapes
    mesh, tx = sharding.local_mesh(), optim.make_optimizer()
    params = sharding.shard_params(init_committed(config, ctx.args.seed), sharding.param_shardings(config, mesh))
    opt_state = jax.jit(tx.init, out_shardings=sharding.opt_state_shardings(config, mesh, tx))(params)
    if batch is None:
        batch = synthetic_rl_batch(config, shapes.train_rows, shapes.train_seq, ctx.args.seed)
    step = distributed.sharded_rl_step(
        config, mesh, spec=losses.LossSpec(loss.eps_low, loss.eps_high, loss.clip_c, chunk_size=loss.chunk_size),
        num_micro_batches=loss.micro_batches, skip_nonfinite=True,
    )  # fmt: skip
    start = time.perf_counter()
    params, opt_state, metrics = jax.block_until_ready(step(params, opt_state, batch))
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(shapes.train_steps):
        # Dispatch runs ahead of the device, as in a training loop; the last result is waited for.
        params, opt_state, metrics = step(params, opt_state, batch)
    jax.block_until_ready((params, opt_state, metrics))
    step_s = (time.perf_counter() - start) / shapes.train_steps
    if not bool(metrics["finite"]):
        raise RuntimeError(f"non-finite loss or gradient: {jax.device_get(metrics)}")
    record = {"first_step_s": first_s, "step_s": step_s, "loss": float(metrics["loss"])}
    # peak_bytes_in_use cannot be reset: the process's peak so far, earlier parts and failed attempts included.
    record["process_peak_gb"] = jax_peak_gb()
    # One more step for the profiler, once the figures are recorded. It consumes the donated params and state.
    return record, lambda: step(params, opt_state, batch)


def section_train(ctx: Context) -> None:
    shapes, args, rec = ctx.shapes, ctx.args, ctx.rec
    tokens = shapes.train_rows * shapes.train_seq
    flops_per_token = train_flops_per_token(model_config(shapes, "float32"), shapes.train_seq)
    peak = args.peak_tflops * 1e12
    rec.set(flops_per_token=flops_per_token, matmul_params=matmul_params(model_config(shapes, "float32")))
    # transformers first: torch returns its cache to the device afterwards, JAX would keep its pool.
    device, why_not = hf_device(ctx)
    if why_not:
        rec.skip("hf_train", why_not)
    else:
        with rec.part("hf_train"):
            config = model_config(shapes, "float32")
            ids = random_ids(config, np.random.default_rng(args.seed), shapes.train_rows, shapes.train_seq)
            hf = hf_baseline.time_train(config, device, ids, shapes.train_steps)
            hf.update(tokens_per_s=tokens / hf["step_s"])
            rec.set(hf_train=hf)
            rec.headline(
                hf_train_tokens_per_s=hf["tokens_per_s"],
                hf_train_mfu=hf["tokens_per_s"] * flops_per_token / peak,
                hf_train_step_seconds=hf["step_s"],
            )
        hf_baseline.release(device)  # also after a failure (out of memory): JAX's steps need the memory next
    loss = LossConfig(chunk_size=args.chunk_size or None)
    variants: dict[str, dict] = {}
    for attention in train_kernels(args):
        # Until one kernel has a figure the next is core work (a failed cudnn check falls back to einsum).
        why = ctx.room_for("train") if variants else None
        if why:
            rec.skip(f"train_{attention}", why)
            continue
        with rec.part(f"train_{attention}"):
            if attention != "einsum":
                check = attention_check(model_config(shapes, "float32", attention=attention), args.seed)
                rec.set(**{f"attention_check_{attention}": check})
                if not check["ok"]:
                    raise RuntimeError(f"attention {attention!r} disagrees with einsum: {check}")
            ours, profile = time_train_variant(ctx, attention, loss)
            ours.update(tokens_per_s=tokens / ours["step_s"])
            ours.update(mfu=ours["tokens_per_s"] * flops_per_token / peak)
            variants[attention] = ours
            record_best_train(rec, variants)
        if attention in variants:
            ctx.profile_call(f"train_{attention}", profile)
            del profile  # the variant's params and optimizer state, before the next variant
    if variants:
        section_train_packed(ctx, max(variants.values(), key=lambda v: v["tokens_per_s"]), loss)


def length_distributed_rows(config: ModelConfig, rows: int, seq: int, seed: int) -> dict:
    """Rollout rows of ``seq`` slots with the paper's relative lengths (``tools/bench_packing.py``'s default): the
    prompt part a ninth of the row with prompts of about 7% of it, responses log-normal with median 4400/8192 and
    p90 10000/8192 of the response part, cut at its end."""
    rng = np.random.default_rng(seed)
    prompt_slots = seq // 9
    response = packing.lognormal_lengths(rows, 4400 / 8192 * (seq - prompt_slots), 10000 / 8192 * (seq - prompt_slots),
                                         seq - prompt_slots, rng)  # fmt: skip
    prompt = np.clip(np.round(rng.uniform(0.04, 0.1, rows) * prompt_slots), 1, prompt_slots).astype(np.int64)
    slots = np.arange(seq)[None, :]
    real = (slots >= prompt_slots - prompt[:, None]) & (slots < prompt_slots + response[:, None])
    mask = real & (slots >= prompt_slots)
    return {
        "tokens": np.where(real, random_ids(config, rng, rows, seq), 0).astype(np.int32),
        "attention_mask": real.astype(np.int32),
        "mask": mask.astype(np.int32),
        "old_logp": np.where(mask, -math.log(config.vocab_size), 0.0).astype(np.float32),
        "advantages": np.where(np.arange(rows) % 2 == 0, 1.0, -1.0).astype(np.float32),
    }


def packed_kernels() -> list[str]:
    """Attentions of the packed step: the Pallas kernel (checked against einsum first) and the blocked one on a
    GPU; einsum elsewhere (the smoke run: Pallas's interpreter is for the tests, not for timing)."""
    return ["pallas", "blocked"] if jax.default_backend() == "gpu" else ["einsum"]


def section_train_packed(ctx: Context, best: dict, loss: LossConfig) -> None:
    """The RL step on rows of the paper's relative lengths: padded (the fastest kernel above, its remat) against
    packed token buffers (``packing.pack_rows``) through each packing attention, in one run."""
    shapes, rec = ctx.shapes, ctx.rec
    why = ctx.room_for("train_packed")
    if why:
        rec.skip("train_packed", why)
        return
    with rec.part("train_packed"):
        config = model_config(shapes, "float32", best["remat"], best["attention"])
        rows = length_distributed_rows(config, shapes.train_rows, shapes.train_seq, ctx.args.seed)
        packed = packing.pack_rows(rows, ("mask", "old_logp", "advantages"), shapes.train_seq)
        result = {"real_tokens": packed.real_tokens, "padded_slots": rows["tokens"].size, "packed_slots": packed.slots}
        padded, _ = time_rl_update(ctx, config, loss, committed(rows))
        result["padded"] = {**padded, "attention": best["attention"], "remat": best["remat"]}
        for attention in packed_kernels():
            cfg = dataclasses.replace(config, attention=attention)
            if attention == "pallas":  # over packed buffers: several segments a row, as the step runs it
                check = attention_check(cfg, ctx.args.seed, packed=True)
                result["attention_check_pallas"] = check
                if not check["ok"]:
                    result["pallas"] = {"skipped": f"disagrees with einsum: {check}"}
                    continue
            timed, _ = time_rl_update(ctx, cfg, loss, committed(packed.arrays))
            result[attention] = {**timed, "speedup": padded["step_s"] / timed["step_s"]}
        rec.set(train_packed=result)
        speedups = [v["speedup"] for v in result.values() if isinstance(v, dict) and "speedup" in v]
        rec.headline(train_packed_speedup=max(speedups))


def record_best_train(rec: Recorder, variants: dict[str, dict]) -> None:
    """Every variant so far, and the fastest as the headline."""
    best = max(variants.values(), key=lambda v: v["tokens_per_s"])
    rec.set(train_variants=variants, train=best)
    rec.headline(
        train_tokens_per_s=best["tokens_per_s"],
        train_mfu=best["mfu"],
        train_step_seconds=best["step_s"],
        train_remat=best["remat"],
        train_attention=best["attention"],
    )


def train_kernels(args: argparse.Namespace) -> list[str]:
    """``--attention`` in order, ``cudnn`` as ``xla`` where JAX has no GPU (the same code path, checked)."""
    on_gpu = jax.default_backend() == "gpu"
    kernels = ["xla" if a == "cudnn" and not on_gpu else a for a in args.attention]
    return list(dict.fromkeys(kernels))


def out_of_memory(err: BaseException) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def time_train_variant(ctx: Context, attention: str, loss: LossConfig) -> tuple[dict, Any]:
    """The RL step with ``attention`` under the first remat policy that fits, and a call that runs it once more.

    Only an out-of-memory error moves on to the next policy: any other failure would repeat under each.
    """
    # A fused kernel never holds the [B, H, T, T] scores, so no remat may fit; einsum's scores need remat at 8 x 2048.
    remats = ctx.args.remat or (["dots", "full"] if attention == "einsum" else ["none", "dots", "full"])
    failed = {}
    for remat in remats:
        gc.collect()  # the arrays of a failed attempt, freed with its traceback
        try:
            ours, profile = time_rl_update(ctx, model_config(ctx.shapes, "float32", remat, attention), loss)
        except Exception as err:
            if not out_of_memory(err):
                raise
            failed[remat] = f"{type(err).__name__}: {err}"[:2000]
            ctx.rec.log(f"train {attention}: remat={remat} out of memory; trying the next policy")
            continue
        record = {**ours, "attention": attention, "remat": remat, "chunk_size": loss.chunk_size, "failed": failed}
        return record, profile
    raise RuntimeError(f"every remat policy failed: {failed}")


def attention_check(config: ModelConfig, seed: int, *, packed: bool = False) -> dict:
    """``config.attention`` against the einsum path: log-probs, and the gradient of their sum, on padded rows (or,
    ``packed``, the same rows packed into token buffers: several segments a row) against einsum on the padded rows.

    Two layers at the model's widths (head dim, GQA, bf16) keep the compile short. Rows: a full one, a
    left-padded prompt with a right-padded response, a short run in the middle, and an empty row (mesh padding).
    """
    small = dataclasses.replace(config, num_layers=2, remat="none")
    rows, seq = 4, 256
    tokens = random_ids(small, np.random.default_rng(seed), rows, seq)
    mask = np.zeros((rows, seq), bool)
    for row, (start, stop) in enumerate([(0, seq), (37, seq), (11, 180), (0, 0)]):
        mask[row, start:stop] = True
    scored = np.pad(mask[:, 1:] & mask[:, :-1], ((0, 0), (1, 0)))  # token t predicted from a real t - 1
    padded = {"tokens": tokens, "attention_mask": mask.astype(np.int32), "mask": scored.astype(np.int32)}
    buffers = packing.pack_rows(padded, ("mask",), seq) if packed else None

    def logp_sum(cfg: ModelConfig, base, rows):
        logp = logprobs.sequence_logprobs(cfg, {"base": base}, rows["tokens"], **logprobs.layout(rows))[0]
        logp = jnp.where(rows["mask"] > 0, logp, 0.0)
        return jnp.sum(logp), logp

    grad = jax.jit(jax.grad(logp_sum, argnums=1, has_aux=True), static_argnums=0)
    base = init_committed(small, seed)["base"]
    want_grad, want = grad(dataclasses.replace(small, attention="einsum"), base, padded)
    got_grad, got = grad(small, base, buffers.arrays if packed else padded)
    got = buffers.unpack(np.asarray(got)) if packed else got
    flat = lambda tree: jnp.concatenate([x.ravel() for x in jax.tree.leaves(tree)])
    grad_rel = float(jnp.linalg.norm(flat(got_grad) - flat(want_grad)) / jnp.linalg.norm(flat(want_grad)))
    logp_diff = float(jnp.max(jnp.abs(got - want)))
    # bf16 rounding differs between kernels by ~1e-3; a wrong mask or layout moves log-probs by whole nats.
    ok = math.isfinite(grad_rel) and logp_diff < 0.05 and grad_rel < 0.05
    return {"logp_max_abs_diff": logp_diff, "grad_rel_diff": grad_rel, "ok": ok}


# -------------------------------------------------------------------------------------- section: lspo
class IdTokenizer:
    """Decodes ids to their decimal text: the verifier below reads only the row's place in its group."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, np.asarray(ids).tolist()))


class HalfCliffVerifier:
    """A verifier with fixed outcomes, in place of math-verify (so ``time_reward`` is decoding and bookkeeping).

    Groups whose gold is in ``cliff_golds`` fail in every rollout; each other group passes in its first rollout
    only. A call holding only cliff golds is the scaffold's re-roll: there rollout 1 of each group passes, so
    every cliff is surpassed and one row per cliff is spliced.
    """

    def __init__(self, cliff_golds: set[str], group_size: int):
        self.cliff_golds, self.group_size = cliff_golds, group_size

    def score(self, texts: list[str], golds: list[str]) -> np.ndarray:
        reroll = all(g in self.cliff_golds for g in golds)
        slot = np.arange(len(golds)) % self.group_size
        if reroll:
            return (slot == 1).astype(np.float32)
        cliff = np.array([g in self.cliff_golds for g in golds])
        return ((slot == 0) & ~cliff).astype(np.float32)


def lspo_setup(ctx: Context):
    """The learner (with its fake verifier) and the examples of the LSPO section."""
    shapes, args = ctx.shapes, ctx.args
    config = model_config(shapes, "float32", (args.remat or ["dots"])[0], args.lspo_attention)
    run = TrainConfig(
        data=DataConfig(max_prompt_tokens=shapes.lspo_prompt_len, max_solution_tokens=shapes.lspo_solution_len),
        rollout=RolloutConfig(
            prompts_per_step=shapes.lspo_prompts, group_size=shapes.lspo_group, max_new_tokens=shapes.lspo_new_tokens
        ),
        reward=RewardConfig(overlong_buffer=max(1, shapes.lspo_new_tokens // 4), workers=0),
        loss=LossConfig(micro_batches=shapes.lspo_micro_batches, chunk_size=args.chunk_size or None),
        scaffold=ScaffoldConfig(sft_steps=shapes.lspo_sft_steps),
    )
    rng = np.random.default_rng(args.seed)
    examples = [
        Example(
            id=f"p{i}",
            answer=str(i),
            prompt_ids=tuple(random_ids(config, rng, shapes.lspo_prompt_len).tolist()),
            solution_ids=tuple(random_ids(config, rng, shapes.lspo_solution_len).tolist()),
        )
        for i in range(shapes.lspo_prompts)
    ]
    policy = Policy(config=config, tokenizer=IdTokenizer(), eos_ids=())
    verifier = HalfCliffVerifier({ex.answer for ex in examples[::2]}, shapes.lspo_group)
    return Learner(run, policy, {"base": init_committed(config, args.seed)["base"]}, verifier=verifier), examples


def timed_step(learner: Learner, examples, seed: int) -> tuple[float, dict]:
    draw = Draw(examples, jax.random.fold_in(jax.random.key(seed), learner.state.step))
    start = time.perf_counter()
    metrics = train.train_step(learner, draw).metrics
    return time.perf_counter() - start, {**metrics, **step_record.step_rates(metrics)}


def scaffold_share(lspo: dict, dapo: dict | None) -> tuple[float, str]:
    """The scaffold's share of the LSPO step (module docstring): phases, with the DAPO step when there is one."""
    seconds = lspo["time_sft"] + lspo["time_reroll"]
    method = "(time_sft + time_reroll) / step: a lower bound, no DAPO step"
    if dapo is not None:
        for phase in ("time_reward", "time_logprob"):
            seconds += max(0.0, lspo[phase] - dapo[phase])
        method = "(time_sft + time_reroll + reward and logprob time beyond the DAPO step's) / step"
    return min(1.0, max(0.0, seconds / lspo["step_s"])), method


def section_lspo(ctx: Context) -> None:
    shapes, args, rec = ctx.shapes, ctx.args, ctx.rec
    phase_keys = [f"time_{name}" for name in Phases.NAMES]
    scaffold_keys = ("cliff_groups", "surpassed_groups", "spliced_rows", "rescue_pass_rate", "sft_loss")
    lspo = None
    with rec.part("lspo"):
        learner, examples = lspo_setup(ctx)
        first_s, _ = timed_step(learner, examples, args.seed)  # compiles every program
        rec.set(lspo_first_step_s=first_s)
        with ctx.profile("lspo"):
            step_s, metrics = timed_step(learner, examples, args.seed)
        lspo = {"step_s": step_s, **{k: metrics[k] for k in phase_keys}, **{k: metrics.get(k) for k in scaffold_keys}}
        lspo.update(process_peak_gb=jax_peak_gb(), rows=shapes.lspo_prompts * shapes.lspo_group)
        share, method = scaffold_share(lspo, None)
        rec.set(lspo=lspo, scaffold_share_method=method)
        rec.headline(lspo_step_seconds=step_s, scaffold_share=share, lspo_phases={k: lspo[k] for k in phase_keys})
    if lspo is None:
        return
    skip = ctx.room_for("dapo_step")
    if skip:
        rec.skip("dapo_step", skip)
        return
    with rec.part("dapo_step"):
        # The DAPO arm differs in scaffold.enabled alone, which no compiled program reads: the same programs run.
        run = learner.run
        learner.run = dataclasses.replace(run, scaffold=dataclasses.replace(run.scaffold, enabled=False))
        step_s, metrics = timed_step(learner, examples, args.seed)
        dapo = {"step_s": step_s, **{k: metrics[k] for k in phase_keys}}
        share, method = scaffold_share(lspo, dapo)
        rec.set(dapo=dapo, scaffold_share_method=method)
        rec.headline(
            scaffold_share=share, dapo_step_seconds=step_s, scaffold_share_vs_dapo=1.0 - step_s / lspo["step_s"]
        )


# ------------------------------------------------------------------------------------- child process
SECTION_FUNCTIONS = {
    "sampler": section_sampler,
    "train": section_train,
    "lspo": section_lspo,
    "vllm": vllm_layout.section,
}


def run_section(args: argparse.Namespace) -> None:
    """The subprocess side: run one section, leaving its record in ``args.section_file``."""
    # These are read when the backend starts, below. JAX would otherwise take 75% of the GPU up front and leave
    # torch too little; on a CPU smoke run compiling dominates, and LLVM's optimisation of tiny programs is waste.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    # Without preallocation JAX still stops at 75% of the device by default; the train step may need more.
    # Torch runs before JAX in the train section, and after it in the sampler section where JAX holds ~20 GB.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    flags = os.environ.get("XLA_FLAGS", "")
    if args.smoke and os.environ.get("JAX_PLATFORMS") == "cpu" and "optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()
    rec = Recorder(args.section_file, args.section, args.t0)
    try:
        if args.section != "vllm":  # that section's workers need the whole devices: no backend starts here
            device = jax.devices()[0]
            rec.set(backend=jax.default_backend(), jax_device=device.device_kind, jax_device_count=jax.device_count())
            rec.log(f"{jax.default_backend()} {device.device_kind}")
        SECTION_FUNCTIONS[args.section](Context(args=args, shapes=shapes_of(args), rec=rec))
    except BaseException as err:  # outside any part (set-up, a kill): recorded, then the process fails
        rec.data["errors"]["section"] = f"{type(err).__name__}: {err}"[:4000]
        rec.flush()
        raise


# -------------------------------------------------------------------------------------- parent process
HEADLINE_KEYS = (
    *(
        f"{name}_{label}"
        for label in BATCH_LABELS
        for name in (
            "sampler_tokens_per_s",
            "hf_generate_tokens_per_s",
            "sampler_ratio_vs_hf",
            "sampler_floor_fraction",
        )
    ),
    "train_tokens_per_s",
    "train_mfu",
    "train_step_seconds",
    "train_remat",
    "train_attention",
    "hf_train_tokens_per_s",
    "hf_train_mfu",
    "hf_train_step_seconds",
    "lspo_step_seconds",
    "scaffold_share",
    "dapo_step_seconds",
    "scaffold_share_vs_dapo",
    "lspo_phases",
    *vllm_layout.HEADLINE_KEYS,
)
SETTINGS = ("time_budget", "remat", "attention", "lspo_attention", "chunk_size", "repeats", "cache_window")
SETTINGS += ("hbm_tb_s", "peak_tflops")
FORMULAS = {
    "new_tokens_per_s": "batch x new tokens / wall time of one generate call, prompt pass included",
    "floor_fraction": "sum_{i=1}^{N-1} (W + batch x kv_bytes_per_token x (P + i)) / HBM over (call - prompt pass) "
    "time; W = bf16 bytes of every weight but the input embedding table",
    "mfu": "tokens/s x (6 N + 6 L heads head_dim T) / peak; N = every parameter but the input embedding table; "
    "attention's 12 L d_attn T per token halved for the causal mask; remat recomputation not counted",
    "scaffold_share": "(time_sft + time_reroll + LSPO step's reward and logprob time beyond the DAPO step's) / "
    "LSPO step time",
    "vllm_step_sample_s": vllm_layout.STEP_FORMULA,
}


def run_child(args: argparse.Namespace, section: str, soft_deadline: float | None, timeout: float | None) -> dict:
    """Run ``section`` in a subprocess; its record, with ``status`` and the process's failure if any."""
    fd, path = tempfile.mkstemp(prefix=f"gpu_bench_{section}_", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "benchmarks.gpu", *args.argv, "--section", section, "--section-file", path]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where the package ``benchmarks`` is
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    cmd += ["--t0", repr(args.t0)] + ([] if soft_deadline is None else ["--soft-deadline", repr(soft_deadline)])
    start, failure = time.time(), None
    try:
        code = subprocess.run(cmd, timeout=timeout, env=env).returncode
        failure = None if code == 0 else f"section process exited with code {code}"
    except subprocess.TimeoutExpired:
        failure = f"section process killed after {timeout:.0f} s (time budget)"
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        record = {"headline": {}, "errors": {}, "skipped": {}, "record_error": str(err)}
    finally:
        for leftover in (path, f"{path}.tmp"):
            with contextlib.suppress(OSError):
                os.remove(leftover)
    record["seconds"] = round(time.time() - start, 1)
    if failure:
        record["error"] = failure
    record["status"] = "failed" if failure or record.get("errors") else record.get("status", "ok")  # or skipped
    return record


def new_result(args: argparse.Namespace) -> dict:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", sys.argv[0], *args.argv]),
        "smoke": args.smoke,
        **dict.fromkeys(HEADLINE_KEYS),
        "jax_device": None,
        "torch_device": None,
        "backend": None,
        "versions": evaluation.package_versions(PACKAGES),
        "python": platform.python_version(),
        "host": platform.node(),
        "shapes": dataclasses.asdict(shapes_of(args)),
        "settings": {k: getattr(args, k) for k in SETTINGS},
        "formulas": FORMULAS,
        "sections": {},
    }


def orchestrate(args: argparse.Namespace) -> dict:
    """Run the selected sections one subprocess each, writing ``args.out`` after every section."""
    result = new_result(args)
    end = None if args.time_budget is None else args.t0 + args.time_budget
    margin = 2.0 if args.smoke else 10.0  # left to the parent after a killed section, to write the JSON
    selected = [s for s in SECTIONS if s in args.only]
    log(args.t0, "main", f"sections {selected}, budget {args.time_budget} s, writing {args.out}")
    for i, section in enumerate(SECTIONS):
        if section not in selected:
            result["sections"][section] = {"status": "skipped", "reason": "not in --only"}
            continue
        left = math.inf if end is None else end - time.time()
        need = section_need_s(section, args.smoke)
        if left < need:
            reason = f"time budget: {left:.0f} s left, the section needs ~{need:.0f} s"
            result["sections"][section] = {"status": "skipped", "reason": reason}
            log(args.t0, "main", f"{section}: skipped ({reason})")
        else:
            later = sum(section_need_s(s, args.smoke) for s in selected[selected.index(section) + 1 :])
            soft = None if end is None else end - later
            timeout = None if end is None else max(1.0, left - margin)
            log(args.t0, "main", f"{section}: start ({i + 1}/{len(SECTIONS)})")
            record = run_child(args, section, soft, timeout)
            take_section(result, section, record, record)
            log(args.t0, "main", f"{section}: {record['status']} in {record['seconds']} s")
        write_json(args.out, result)
    if args.merge:
        merge_earlier(result, args.merge)
        write_json(args.out, result)
    return result


def take_section(result: dict, name: str, record: dict, devices: dict) -> None:
    """``record`` as section ``name`` of ``result``: its headline figures, and the device names from ``devices``
    where ``result`` has none yet."""
    result["sections"][name] = record
    result.update(record.get("headline", {}))
    for key in ("jax_device", "torch_device", "backend"):
        result[key] = result[key] or devices.get(key)


def merge_earlier(result: dict, path: str) -> None:
    """Fill the sections that did not run now (not selected, or skipped for time) from an earlier run's JSON,
    headline figures included, so that a benchmark split over several device calls ends in one file."""
    with open(path) as f:
        earlier = json.load(f)
    merged = []
    for name, section in earlier.get("sections", {}).items():
        if result["sections"].get(name, {}).get("status") == "skipped" and section.get("status") != "skipped":
            origin = {"date": earlier["date"], "command": earlier["command"]}
            take_section(result, name, {**section, "merged_from": origin}, earlier)
            merged.append(name)
    result["merged"] = merged


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def print_table(result: dict) -> None:
    print(f"\n{'':<32} {result['jax_device']} / {result['torch_device']} ({result['backend']})")
    for key in HEADLINE_KEYS:
        if key != "lspo_phases":
            print(f"{key:<32} {fmt(result[key])}")
    phases = result.get("lspo_phases") or {}
    print(f"{'lspo_phases':<32} " + " ".join(f"{k.removeprefix('time_')}={v:.3g}s" for k, v in phases.items()))
    for name, section in result["sections"].items():
        problems = {**section.get("errors", {}), **section.get("skipped", {})}
        why = section.get("error") or section.get("reason") or ""
        detail = "; ".join([why, *(f"{k}: {v[:160]}" for k, v in problems.items())]).strip("; ")
        if "merged_from" in section:
            detail = f"from the run of {section['merged_from']['date']}; {detail}".strip("; ")
        print(f"section {name:<8} {section['status']:<8} {fmt(section.get('seconds'))} s  {detail}")


def jax_backend() -> str:
    """JAX's default backend, asked in a process of its own: JAX in this one would hold the accelerator's memory
    (it preallocates) that each section's process needs."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    asked = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], env=env,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    return asked.stdout.strip().splitlines()[-1] if asked.returncode == 0 and asked.stdout.strip() else "unknown"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.argv = list(argv)
    if args.section:
        run_section(args)
        return
    if not args.smoke and jax_backend() == "cpu":
        print(
            "benchmarks.gpu: JAX finds no GPU here (its backend is cpu): the full shapes time an accelerator, and "
            "would run for hours on CPU cores; pass --smoke to check the code with tiny shapes",
            file=sys.stderr,
        )
        raise SystemExit(2)
    result = orchestrate(args)
    print_table(result)
    log(args.t0, "main", f"wrote {args.out}")


if __name__ == "__main__":
    main()
