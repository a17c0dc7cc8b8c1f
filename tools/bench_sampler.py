"""Sampler throughput: new tokens per second of ``lspo_jax.sampler`` at a fixed shape, random weights.

Every row generates exactly ``--new-tokens`` tokens (no EOS), prompts are ``--prompt-len`` random ids.
``--hf`` also times transformers ``generate()`` (torch, sdpa attention) at the same shape in the same run.
The decode floor is the time to read the weights plus the KV cache at the mean context once per step at
the H200's measured 4.23 TB/s; on CPU that number is only a reference.

    python tools/bench_sampler.py                      # CPU default: tiny model
    python tools/bench_sampler.py --hf --json out.json # on a GPU: the 1.5B shape, batch 64 and 256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

# JAX would otherwise take 75% of the GPU up front and leave torch too little for the --hf baseline.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from lspo_jax import sampler  # noqa: E402
from lspo_jax.config import ModelConfig  # noqa: E402
from lspo_jax.kv_cache import cache_nbytes  # noqa: E402
from lspo_jax.model import count_params, init_params  # noqa: E402

HBM_BYTES_PER_S = 4.23e12  # H200 device memory read+write, measured (DESIGN.md section 3)
GPU_DEFAULTS = dict(preset="deepseek-r1-distill-qwen-1.5b", batch="64,256", prompt_len=256, new_tokens=512)
CPU_DEFAULTS = dict(preset="tiny", batch="8", prompt_len=64, new_tokens=128)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", help="model shape (default: tiny on CPU, the 1.5B shape on GPU)")
    p.add_argument("--model", action="append", default=[], metavar="FIELD=INT", help="a preset size, e.g. num_layers=4")
    p.add_argument("--batch", help="comma-separated batch sizes (prompts per call, n = 1)")
    p.add_argument("--prompt-len", type=int)
    p.add_argument("--new-tokens", type=int)
    p.add_argument("--dtype", help="param and compute dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--hf", action="store_true", help="also time transformers generate() at the same shape")
    p.add_argument("--lora", action="store_true", help="also time with the adapter on (lora_scale = 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per setting (the best is reported)")
    p.add_argument("--cache-window", type=int, default=sampler.DEFAULT_CACHE_WINDOW)
    p.add_argument("--json", help="write the rows as JSON to this path")
    args = p.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    for name, value in (GPU_DEFAULTS if on_gpu else CPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    return args


def floor_step_s(config: ModelConfig, params, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Weights plus the KV cache at the mean context, read once, at the H200's bandwidth."""
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params["base"]))
    kv_bytes = cache_nbytes(config, batch, prompt_len + new_tokens // 2)
    return (weight_bytes + kv_bytes) / HBM_BYTES_PER_S


def time_jax(config, params, prompts, args, lora_scale: float) -> dict:
    kw = dict(max_new_tokens=args.new_tokens, eos_token_ids=(), lora_scale=lora_scale, cache_window=args.cache_window)
    t0 = time.perf_counter()
    out = sampler.generate_arrays(config, params, prompts, key=jax.random.key(0), **kw)
    first = time.perf_counter() - t0
    assert np.all(out.lengths == args.new_tokens)
    times = []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        sampler.generate_arrays(config, params, prompts, key=jax.random.key(i + 1), **kw)
        times.append(time.perf_counter() - t0)
    return dict(engine="jax" if lora_scale == 0 else "jax+lora", first_call_s=first, time_s=min(times))


def time_prefill(config, params, prompts, args) -> float:
    """The prompt pass of the same call alone (the same compiled program), to split off the decode time."""
    kw = dict(max_new_tokens=args.new_tokens, cache_window=args.cache_window)
    sampler.prefill_only(config, params, prompts, key=jax.random.key(0), **kw)
    t0 = time.perf_counter()
    sampler.prefill_only(config, params, prompts, key=jax.random.key(1), **kw)
    return time.perf_counter() - t0


def time_hf(config: ModelConfig, tokens: np.ndarray, args) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**config.to_hf_config(), attn_implementation="sdpa"))
    model = model.to(dtype).eval()
    ids = torch.from_numpy(tokens).long().to(device)
    gen = dict(
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,  # suppresses EOS: a fixed number of new tokens
        pad_token_id=0,
    )
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids[:, :8], **{**gen, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        sync()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, **gen)
        sync()
    assert out.shape[1] == tokens.shape[1] + args.new_tokens
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return dict(engine="hf", first_call_s=first, time_s=time.perf_counter() - t0)


def bench_batch(config, params, batch: int, args) -> list[dict]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, min(config.vocab_size, 30000), size=(batch, args.prompt_len)).astype(np.int32)
    prompts = tokens.tolist()
    rows = [time_jax(config, params, prompts, args, 0.0)]
    if args.lora:
        rows.append(time_jax(config, params, prompts, args, 1.0))
    prefill_s = time_prefill(config, params, prompts, args)
    if args.hf:
        rows.append(time_hf(config, tokens, args))
    floor = floor_step_s(config, params, batch, args.prompt_len, args.new_tokens)
    for row in rows:
        # transformers gives no separate prompt time: its step time includes its prefill.
        own_prefill_s = 0.0 if row["engine"] == "hf" else prefill_s
        step_s = (row["time_s"] - own_prefill_s) / max(args.new_tokens - 1, 1)
        row.update(
            batch=batch,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            new_tok_per_s=batch * args.new_tokens / row["time_s"],
            step_ms=1e3 * step_s,
            floor_step_ms=1e3 * floor,
            floor_fraction=floor / step_s,
        )
    return rows


def main() -> None:
    args = parse_args()
    sizes = {}
    for item in args.model:
        name, _, value = item.partition("=")
        if not value.isdigit():
            raise SystemExit(f"--model {item!r}: expected FIELD=INT, e.g. num_layers=4")
        sizes[name] = int(value)
    config = ModelConfig.preset(args.preset, param_dtype=args.dtype, compute_dtype=args.dtype, **sizes)
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    print(
        f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} jax={jax.__version__} "
        f"preset={args.preset}{''.join(f' {m}' for m in args.model)} params={count_params(params['base']):,} "
        f"dtype={args.dtype} "
        f"cache_window={args.cache_window} python={platform.python_version()}"
    )
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        rows += bench_batch(config, params, batch, args)
    header = ("engine", "batch", "prompt_len", "new_tokens", "time_s", "new_tok_per_s", "step_ms", "floor_step_ms")
    print(" ".join(f"{h:>13}" for h in (*header, "floor_frac", "first_call_s")))
    for r in rows:
        cells = [f"{r[h]:>13.4g}" if isinstance(r[h], float) else f"{r[h]:>13}" for h in header]
        print(" ".join(cells), f"{r['floor_fraction']:>13.3f}", f"{r['first_call_s']:>13.2f}")
    for batch in sorted({r["batch"] for r in rows}):
        by = {r["engine"]: r for r in rows if r["batch"] == batch}
        if "hf" in by:
            print(
                f"batch {batch}: jax / hf new tokens/s = {by['jax']['new_tok_per_s'] / by['hf']['new_tok_per_s']:.2f}"
            )
    if args.json:
        meta = dict(backend=jax.default_backend(), device=jax.devices()[0].device_kind, jax=jax.__version__)
        with open(args.json, "w") as f:
            json.dump({"meta": {**meta, **vars(args)}, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    jnp.zeros(())  # initialise the backend before timing anything
    main()
