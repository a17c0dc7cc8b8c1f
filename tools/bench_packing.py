"""Padding paid by fixed ``[P | R]`` rows against packed token buffers: slots, FLOPs, and the CPU time of both.

Part 1, the paper's shape (counted, nothing run): B x K rows of ``P + R`` slots (32 x 16 of 1024 + 8192), prompt
lengths drawn from a benchmark file's R1 prompts in the real Qwen2 vocabulary (``qwen_vocab``), response lengths
from ``--responses`` (default: the log-normal with median 4.4k and p90 10k tokens reported for DeepMath's R1
traces, cut at R). For padded rows and for ``packing.pack_rows``' buffers (8 data-parallel devices, micro-batches of
16 rows as the recipe): token slots processed per real token, linear FLOPs (proportional to slots) and attention
score entries (einsum: every entry of each row's square; blocked: the 128 x 128 blocks it visits) against the
entries a causal segment needs.

Part 2, the same relative distribution at a reduced shape on this machine: ``--scale`` divides P, R and every
length; the RL step (gradient and AdamW update) and the log-prob pass, padded and packed, timed in one run (best of
``--repeats``, after one compiling call), on a Qwen2 of ``--model`` sizes.

    .venv/bin/python -m tools.bench_packing [--responses lognormal:4400:10000] [--prompts math500] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from lspo_jax.models import flash
from lspo_jax.rl import packing
from lspo_jax.train_config import ConfigError

if not __package__:  # run by its path: the repository root, where the package ``tools`` is, is not on sys.path
    sys.exit("tools/bench_packing.py: run it from the repository root as python -m tools.bench_packing ...")
from tools import SHARED_DATA, model_sizes, run_main, write_json  # noqa: E402

PAPER = dict(rows=32 * 16, prompt_slots=1024, new_tokens=8192, devices=8, rows_per_micro=16)
SMALL_MODEL = dict(vocab_size=32000, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=64)  # fmt: skip


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--responses", default="lognormal:4400:10000", help="lognormal:MEDIAN:P90 or uniform:LOW:HIGH")
    p.add_argument(
        "--prompts",
        default="math500",
        help="benchmark file in --data-dir (else the package's, for math500, aime24 "
        "and aime25) whose R1 prompts give P's lengths",
    )
    p.add_argument("--data-dir", default=str(SHARED_DATA))
    p.add_argument("--scale", type=int, default=16, help="part 2: P, R and lengths divided by this")
    p.add_argument("--cpu-rows", type=int, default=32, help="part 2: rows per step")
    p.add_argument("--model", action="append", default=[], metavar="FIELD=INT", help="part 2 model size override")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-timing", action="store_true", help="part 1 only")
    p.add_argument("--json", help="write the figures to this JSON file")
    return p.parse_args(argv)


def response_lengths(spec: str, n: int, cap: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` lengths in [1, cap] from ``lognormal:MEDIAN:P90`` or ``uniform:LOW:HIGH``."""
    kind, _, rest = spec.partition(":")
    try:
        a, b = (float(x) for x in rest.split(":"))
    except ValueError:
        raise ConfigError(f"--responses {spec!r}: expected lognormal:MEDIAN:P90 or uniform:LOW:HIGH") from None
    if kind == "lognormal" and 0 < a < b:
        return packing.lognormal_lengths(n, a, b, cap, rng)
    if kind == "uniform" and 0 < a <= b:
        return np.clip(np.round(rng.uniform(a, b, n)), 1, cap).astype(np.int64)
    raise ConfigError(f"--responses {spec!r}: expected lognormal:MEDIAN:P90 (0 < MEDIAN < P90) or uniform:LOW:HIGH")


def r1_prompt_lengths(data_dir: str, name: str) -> np.ndarray:
    """The R1 prompts' token counts of one benchmark file (the chat template and instruction included)."""
    from lspo_jax.tasks import benchmarks, templates
    from lspo_jax.train_config import DataConfig
    from tools import qwen_vocab

    path = os.path.join(data_dir, f"{name}.jsonl")
    here = any(os.path.exists(os.path.join(data_dir, f"{name}{suffix}")) for suffix in (".jsonl", ".parquet"))
    if not here and name in benchmarks.manifest():  # a clone without the data folder beside it
        path = str(benchmarks.packaged_file(name))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path}")
    try:
        tokenizer = qwen_vocab.r1_tokenizer()
    except ImportError as err:  # the vocabulary's package missing: one line, as a missing extra is
        raise ConfigError(str(err)) from err
    with open(path) as f:
        problems = [json.loads(line)["problem"] for line in f if line.strip()]
    render = lambda p: len(templates.render_prompt(tokenizer, templates.prompt_text(p, DataConfig())))
    return np.array([render(p) for p in problems], np.int64)


def rows_of(prompt: np.ndarray, response: np.ndarray, prompt_slots: int) -> dict[str, np.ndarray]:
    """Left-padded prompts and right-padded responses, as ``packing.pack_samples`` lays out a rollout batch."""
    slots = np.arange(prompt_slots + response.max())[None, :]
    real = (slots >= prompt_slots - prompt[:, None]) & (slots < prompt_slots + response[:, None])
    return {"attention_mask": real.astype(np.int32), "mask": (real & (slots >= prompt_slots)).astype(np.int32)}


def blocked_entries(segment_ids: np.ndarray, block: int = flash.DEFAULT_BLOCK) -> int:
    """Score entries the blocked attention computes: ``block**2`` per (query block, key block) pair it visits."""
    pairs = 0
    for row in segment_ids:
        visited = set()
        for seg in np.unique(row[row > 0]):
            where = np.flatnonzero(row == seg)
            first, last = where[0] // block, where[-1] // block
            visited.update((q, k) for q in range(first, last + 1) for k in range(first, q + 1))
        pairs += len(visited)
    return pairs * block * block


def counts(prompt: np.ndarray, response: np.ndarray, prompt_slots: int, new_tokens: int, devices: int, per_micro: int):
    """Slots, linear FLOP ratio and attention entries of padded rows and packed buffers for one step's lengths."""
    length = prompt_slots + new_tokens
    real_lengths = prompt + response
    real = int(real_lengths.sum())
    causal = int(np.sum(real_lengths * (real_lengths + 1) // 2))
    row, offset, needed = packing.plan_rows(real_lengths, length)
    buffers, micro = packing.micro_batching(needed, devices, per_micro)
    segment_ids = np.zeros((buffers, length), np.int32)
    for i, (r, o, n) in enumerate(zip(row, offset, real_lengths, strict=True)):
        segment_ids[r, o : o + n] = i + 1
    padded_rows = len(prompt)
    out = {
        "real_tokens": real,
        "padded": {"rows": padded_rows, "slots_per_real_token": padded_rows * length / real,
                   "einsum_entries_per_causal": padded_rows * length**2 / causal},
        "packed": {"rows": buffers, "rows_needed": needed, "micro_batches": micro,
                   "slots_per_real_token": buffers * length / real,
                   "einsum_entries_per_causal": buffers * length**2 / causal,
                   "blocked_entries_per_causal": blocked_entries(segment_ids) / causal},
    }  # fmt: skip
    out["linear_flops_padded_over_packed"] = padded_rows / buffers
    return out


def paper_shape(args, prompt_pool: np.ndarray, rng: np.random.Generator) -> dict:
    n, p, r = PAPER["rows"], PAPER["prompt_slots"], PAPER["new_tokens"]
    prompt = np.minimum(rng.choice(prompt_pool, n), p)
    response = response_lengths(args.responses, n, r, rng)
    out = counts(prompt, response, p, r, PAPER["devices"], PAPER["rows_per_micro"])
    out["at_cap"] = float(np.mean(response == r))
    out["response_median"], out["prompt_median"] = float(np.median(response)), float(np.median(prompt))
    return out


def cpu_shape(args, prompt_pool: np.ndarray, rng: np.random.Generator) -> dict:
    import dataclasses

    import jax

    from lspo_jax.config import ModelConfig
    from lspo_jax.models import specs

    sizes = dict(SMALL_MODEL)
    sizes.update(model_sizes(args.model))
    try:
        config = ModelConfig.preset("tiny", **sizes)
    except ValueError as err:  # a size the model refuses
        raise ConfigError(f"--model: {err}") from err
    n, p, r = args.cpu_rows, PAPER["prompt_slots"] // args.scale, PAPER["new_tokens"] // args.scale
    prompt = np.clip(np.round(rng.choice(prompt_pool, n) / args.scale), 1, p).astype(np.int64)
    response = np.clip(np.round(response_lengths(args.responses, n, PAPER["new_tokens"], rng) / args.scale), 1, r)
    rows = rows_of(prompt, response.astype(np.int64), p)
    rows["attention_mask"] = np.pad(rows["attention_mask"], ((0, 0), (0, p + r - rows["attention_mask"].shape[1])))
    rows["mask"] = np.pad(rows["mask"], ((0, 0), (0, p + r - rows["mask"].shape[1])))
    rows["tokens"] = np.where(rows["attention_mask"] > 0, rng.integers(1, config.vocab_size, rows["mask"].shape), 0)
    rows["tokens"] = rows["tokens"].astype(np.int32)
    rows["old_logp"] = np.where(rows["mask"] > 0, -np.log(config.vocab_size), 0.0).astype(np.float32)
    rows["advantages"] = np.where(np.arange(n) % 2 == 0, 1.0, -1.0).astype(np.float32)
    packed = packing.pack_rows(rows, ("mask", "old_logp", "advantages"), p + r)
    padded = {k: rows[k] for k in ("tokens", "attention_mask", "mask", "old_logp", "advantages")}
    params = jax.jit(specs.init_params, static_argnums=0)(config, jax.random.key(0))
    out = {"model_params": specs.count_params(params["base"]), "shape": f"{n} rows of {p} + {r}",
           "real_tokens": packed.real_tokens, "padded_slots": padded["tokens"].size,
           "packed_slots": packed.slots}  # fmt: skip
    variants = {"padded": ("einsum", padded), "packed": ("einsum", packed.arrays),
                "packed_blocked": ("blocked", packed.arrays)}  # fmt: skip
    passes = {name: passes_of(dataclasses.replace(config, attention=a), params, b) for name, (a, b) in variants.items()}
    firsts = {f"{name}/{kind}": timed_once(run) for name, runs in passes.items() for kind, run in runs.items()}
    best = dict.fromkeys(firsts, float("inf"))
    for _ in range(args.repeats):  # interleaved: the machine's speed drifts between runs
        for name, runs in passes.items():
            for kind, run in runs.items():
                best[f"{name}/{kind}"] = min(best[f"{name}/{kind}"], timed_once(run))
    for name in passes:
        out[name] = {f"{kind}_s": best[f"{name}/{kind}"] for kind in ("rl_step", "logprob")}
        out[name].update({f"{kind}_first_s": firsts[f"{name}/{kind}"] for kind in ("rl_step", "logprob")})
    for name in ("packed", "packed_blocked"):
        out[f"rl_speedup_{name}"] = out["padded"]["rl_step_s"] / out[name]["rl_step_s"]
        out[f"logprob_speedup_{name}"] = out["padded"]["logprob_s"] / out[name]["logprob_s"]
    return out


def passes_of(config, params, batch) -> dict:
    """``{"rl_step": fn, "logprob": fn}``, each running its compiled program once on fresh inputs."""
    import jax

    from lspo_jax.models import sharding
    from lspo_jax.rl import distributed, losses, optim

    mesh, tx, spec = sharding.local_mesh(), optim.make_optimizer(), losses.LossSpec(chunk_size=256)
    step = distributed.sharded_rl_step(config, mesh, spec=spec)
    logprob = distributed.sharded_logprobs(config, mesh, spec=spec)

    def rl_step():
        # The step donates params and state: each call gets its own copies, made before its clock starts.
        fresh = jax.tree.map(lambda x: x.copy(), params)
        state = jax.block_until_ready((fresh, tx.init(fresh)))
        return lambda: step(*state, batch)

    return {"rl_step": rl_step, "logprob": lambda: lambda: logprob(params, batch)}


def timed_once(prepare) -> float:
    """Seconds of one call of ``prepare()``'s function, its result waited for."""
    import jax

    run = prepare()
    start = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    return run_main("bench_packing", _bench, argv)


def _bench(argv: list[str] | None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    prompt_pool = r1_prompt_lengths(args.data_dir, args.prompts)
    result = {
        "responses": args.responses,
        "prompts": args.prompts,
        "seed": args.seed,
        "paper": paper_shape(args, prompt_pool, rng),
    }
    paper = result["paper"]
    print(f"paper shape {PAPER}: real tokens {paper['real_tokens']}, response median {paper['response_median']:g}, "
          f"{paper['at_cap']:.1%} at the cap, prompt median {paper['prompt_median']:g}")  # fmt: skip
    for kind in ("padded", "packed"):
        print(f"  {kind:<7} " + ", ".join(f"{k} {v:.4g}" for k, v in paper[kind].items()))
    if not args.skip_timing:
        import jax

        result["cpu"] = cpu_shape(args, prompt_pool, rng)
        result["versions"] = {"jax": jax.__version__, "python": platform.python_version(),
                              "load": os.getloadavg()[0]}  # fmt: skip
        cpu = result["cpu"]
        print(f"cpu {cpu['shape']}, {cpu['model_params']:,} params: slots padded {cpu['padded_slots']}, "
              f"packed {cpu['packed_slots']}, real {cpu['real_tokens']}")  # fmt: skip
        for name in ("padded", "packed", "packed_blocked"):
            print(f"  {name:<14} " + ", ".join(f"{k} {v:.3f}" for k, v in cpu[name].items()))
        print("  speedups " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items() if "speedup" in k))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
