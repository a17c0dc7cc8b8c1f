"""Sampler throughput: new tokens per second of ``lspo_jax.rollout.sampler`` at a fixed shape, random weights.

Prompts are ``--prompt-len`` random ids; no EOS, so each row generates exactly its stated number of new tokens.
``--lengths`` states those numbers per row (``uniform``: all ``--new-tokens``; ``mixed`` and ``r1``: uneven,
see ``--help``), the same for every engine; the throughput counts only those tokens (useful tokens per second).
``--vllm`` also times vLLM on the same weights (written to a temporary Hugging Face directory), prompts, lengths
and dtype; ``--hf`` times transformers ``generate()`` (torch, sdpa attention), for ``uniform`` only (it cannot
stop rows at different lengths). All engines run in the same process; the JAX and vLLM calls take turns
(``time_interleaved``), so that drift of a shared machine reaches both alike.
The decode floor is the time to read the weights plus the KV cache at the mean context once per step at
the H200's measured 4.23 TB/s; on CPU that number is only a reference.

    python -m tools.bench_sampler                      # CPU default: tiny model
    python -m tools.bench_sampler --hf --json out.json # on a GPU: the 1.5B shape, batch 64 and 256

JAX against vLLM on CPU (a 56.4M-parameter Qwen2; vLLM's CPU attention needs head_dim 64 or 32)::

    python -m tools.bench_sampler --vllm --lengths uniform,mixed --batch 32 --prompt-len 128 --new-tokens 128 \\
        --model vocab_size=32000 --model hidden_size=512 --model intermediate_size=1408 --model num_layers=8 \\
        --model num_heads=8 --model num_kv_heads=4 --model head_dim=64 --model max_position_embeddings=2048
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import tempfile
import time

# JAX would otherwise take 75% of the GPU up front and leave torch too little for the --hf baseline.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# vLLM on CPU keeps a core for its scheduler when its engine runs in a process of its own, which would leave it one
# of a small machine's two against JAX's all; none is kept for it here. Read when vLLM is imported.
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

if not __package__:  # run by its path: the repository root, where the package ``benchmarks`` is, is not on sys.path
    raise SystemExit("tools/bench_sampler.py: run it from the repository root as python -m tools.bench_sampler ...")
from benchmarks import hf_baseline  # noqa: E402
from lspo_jax.config import DECODE_ATTENTION, ModelConfig  # noqa: E402
from lspo_jax.models import hf  # noqa: E402
from lspo_jax.models.specs import count_params, init_params  # noqa: E402
from lspo_jax.rollout import sampler  # noqa: E402
from lspo_jax.rollout.kv_cache import cache_nbytes  # noqa: E402
from lspo_jax.train_config import ConfigError  # noqa: E402
from tools import model_sizes, run_main  # noqa: E402

HBM_BYTES_PER_S = 4.23e12  # H200 device memory read+write, measured (DESIGN.md section 3)
GPU_DEFAULTS = dict(preset="deepseek-r1-distill-qwen-1.5b", batch="64,256", prompt_len=256, new_tokens=512)
CPU_DEFAULTS = dict(preset="tiny", batch="8", prompt_len=64, new_tokens=128)
LENGTH_CASES = ("uniform", "mixed", "r1")
MIXED_SHORT = 16  # new tokens of mixed's short rows
R1_MEDIAN, R1_P90 = 0.25, 0.9  # r1's lognormal: median and 90th percentile, as fractions of --new-tokens
Z90 = 1.2816  # the standard normal's 90th percentile
LENGTHS_HELP = (
    "comma-separated cases of per-row new-token counts (default: uniform). uniform: every row --new-tokens. "
    f"mixed: rows 0, 2, 4, ... min({MIXED_SHORT}, --new-tokens), the others --new-tokens. r1 (a skewed, "
    "reasoning-like spread): lognormal with median --new-tokens/4 and 90th percentile 0.9 * --new-tokens, "
    "i.e. mu = ln(new_tokens / 4), sigma = ln(3.6) / 1.2816 = 0.9995, drawn with np.random.default_rng(0) per "
    "batch size, rounded and clipped to [1, --new-tokens] (about 8 percent of rows land on the cap)"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", help="model shape (default: tiny on CPU, the 1.5B shape on GPU)")
    p.add_argument("--model", action="append", default=[], metavar="FIELD=INT", help="a preset size, e.g. num_layers=4")
    p.add_argument("--batch", help="comma-separated batch sizes (prompts per call, n = 1)")
    p.add_argument("--prompt-len", type=int)
    p.add_argument("--new-tokens", type=int, help="the most new tokens of a row")
    p.add_argument("--lengths", default="uniform", help=LENGTHS_HELP)
    p.add_argument("--dtype", help="param and compute dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--hf", action="store_true", help="also time transformers generate() at the same shape")
    p.add_argument("--vllm", action="store_true", help="also time vLLM on the same weights, prompts and lengths")
    p.add_argument("--kv-cache-gib", type=int, default=2, help="vLLM's KV cache on CPU (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--lora", action="store_true", help="also time with the adapter on (lora_scale = 1)")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="also time the JAX sampler with one setting changed, in the same interleaved rounds: "
        "decode_attention=einsum|reduce|xla|pallas or compact_every=INT (0: never drop ended rows); repeatable",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed calls per setting (the best is reported)")
    p.add_argument("--cache-window", type=int, default=sampler.DEFAULT_CACHE_WINDOW)
    p.add_argument(
        "--json",
        help="write the rows as JSON to this path, with jax_vs_vllm_ratio_<case> (one batch size; with several, "
        "jax_vs_vllm_ratio_<case>_batch<B>) and <engine>_mixed_vs_uniform_cost (time of mixed / time of uniform)",
    )
    args = p.parse_args(argv)
    args.lengths = parse_lengths(args.lengths)
    check_variants(args.variant)
    on_gpu = jax.default_backend() == "gpu"
    for name, value in (GPU_DEFAULTS if on_gpu else CPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    return args


def check_variants(variants: list[str]) -> None:
    for variant in variants:
        name, _, value = variant.partition("=")
        ok = (name == "decode_attention" and value in DECODE_ATTENTION) or (name == "compact_every" and value.isdigit())
        if not ok:
            raise ConfigError(
                f"--variant {variant!r}: expected decode_attention={'|'.join(DECODE_ATTENTION)} or compact_every=INT"
            )


def parse_lengths(text: str) -> list[str]:
    cases = [c.strip() for c in text.split(",")]
    for case in cases:
        if case not in LENGTH_CASES:
            raise ConfigError(f"--lengths: unknown case {case!r}; expected a comma-separated list of {LENGTH_CASES}")
    return list(dict.fromkeys(cases))  # in the order given, each once


def row_lengths(case: str, batch: int, new_tokens: int) -> np.ndarray:
    """The stated new-token count of each row (see LENGTHS_HELP)."""
    lengths = np.full(batch, new_tokens, np.int32)
    if case == "mixed":
        lengths[::2] = min(MIXED_SHORT, new_tokens)
    elif case == "r1":
        sigma = np.log(R1_P90 / R1_MEDIAN) / Z90
        draws = np.random.default_rng(0).lognormal(np.log(R1_MEDIAN * new_tokens), sigma, size=batch)
        lengths = np.clip(np.rint(draws), 1, new_tokens).astype(np.int32)
    return lengths


def floor_step_s(config: ModelConfig, params, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Weights plus the KV cache at the mean context, read once, at the H200's bandwidth."""
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params["base"]))
    kv_bytes = cache_nbytes(config, batch, prompt_len + new_tokens // 2)
    return (weight_bytes + kv_bytes) / HBM_BYTES_PER_S


def jax_call(config, params, prompts, lengths: np.ndarray, args, lora_scale: float, variant: str = ""):
    """One timed sampler call per seed (its seconds), checking that every row got its stated length."""
    # Equal lengths take the int form, the call the trainer makes; uneven ones one limit per prompt.
    limit = int(lengths[0]) if np.all(lengths == lengths[0]) else lengths.tolist()
    kw = dict(max_new_tokens=limit, eos_token_ids=(), lora_scale=lora_scale, cache_window=args.cache_window)
    name, _, value = variant.partition("=")
    if name == "decode_attention":
        config = dataclasses.replace(config, decode_attention=value)
    elif name == "compact_every":
        kw["compact_every"] = int(value)

    def call(seed: int) -> float:
        t0 = time.perf_counter()
        out = sampler.generate_arrays(config, params, prompts, key=jax.random.key(seed), **kw)
        elapsed = time.perf_counter() - t0
        assert np.array_equal(out.lengths, lengths), (out.lengths.tolist(), lengths.tolist())
        return elapsed

    return call


def time_interleaved(calls: dict, repeats: int) -> dict:
    """Each call once untimed (compiles, warm-up), then ``repeats`` rounds of every call in turn; the best of each.

    Interleaved so that every engine meets the same machine: on a shared virtual machine the same call's time
    drifts by tens of percent over minutes, which timing one engine after the other would put into the ratio.
    """
    first = {name: call(0) for name, call in calls.items()}
    times = {name: [] for name in calls}
    for i in range(repeats):
        for name, call in calls.items():
            times[name].append(call(i + 1))
    return {name: dict(first_call_s=first[name], time_s=min(times[name]), times_s=times[name]) for name in calls}


def time_prefill(config, params, prompts, args) -> float:
    """The prompt pass of the same call alone (the same compiled program), to split off the decode time."""
    kw = dict(max_new_tokens=args.new_tokens, cache_window=args.cache_window)
    sampler.prefill_only(config, params, prompts, key=jax.random.key(0), **kw)
    t0 = time.perf_counter()
    sampler.prefill_only(config, params, prompts, key=jax.random.key(1), **kw)
    return time.perf_counter() - t0


def time_hf(config: ModelConfig, tokens: np.ndarray, args) -> dict:
    """transformers ``generate()`` at the same shape (``benchmarks.hf_baseline``, as the GPU benchmark times it)."""
    device, why_not, _ = hf_baseline.device(allow_cpu=True)
    if why_not:
        raise ConfigError(f"--hf: {why_not}")
    model = hf_baseline.model(config, device, args.dtype).eval()
    timed = hf_baseline.time_generate(model, device, tokens, args.new_tokens)
    del model
    hf_baseline.release(device)
    return dict(engine="hf", first_call_s=timed["warmup_s"], time_s=timed["time_s"])


def start_vllm(config: ModelConfig, params, args, model_dir: str):
    """A vLLM engine on the same weights as ``params``, saved to ``model_dir``; started and warmed up."""
    from lspo_jax.rollout.vllm_sampler import VLLMSampler

    hf.save_pretrained(model_dir, config, params)
    engine = VLLMSampler(
        model_dir,
        config,
        kv_cache_space_gib=args.kv_cache_gib,
        dtype=args.dtype,
        max_model_len=args.prompt_len + args.new_tokens,
        seed=0,
        skip_tokenizer_init=True,  # prompts go in as ids and tokens come back as ids: no tokenizer saved
        # The timed calls repeat their prompts; with the prefix cache on they would skip the prompt pass
        # that the JAX sampler repeats every call.
        enable_prefix_caching=False,
    )
    engine.warmup()
    return engine


def check_vllm(config: ModelConfig) -> None:
    """Refuse a shape vLLM cannot run before anything is timed, in one line."""
    from lspo_jax.rollout.vllm_setup import check_model

    try:
        check_model(config)
    except ValueError as e:
        raise ConfigError(f"--vllm: {str(e).split('; ')[0]}; set one with --model head_dim=64") from None


def vllm_call(engine, prompts, lengths: np.ndarray):
    """One timed vLLM call per seed (its seconds), checking that every row got its stated length."""
    from vllm import SamplingParams

    requests = [{"prompt_token_ids": p} for p in prompts]

    def call(seed: int) -> float:
        # Seeded per request, as VLLMSampler samples; min_tokens with ignore_eos forces exactly L new tokens.
        sp = [
            SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=1.0, top_p=1.0, top_k=-1,
                           logprobs=0, detokenize=False, seed=seed * len(prompts) + i)
            for i, n in enumerate(lengths.tolist())
        ]  # fmt: skip
        t0 = time.perf_counter()
        outputs = engine.llm.generate(requests, sp, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        got = [len(o.outputs[0].token_ids) for o in outputs]
        assert got == lengths.tolist(), (got, lengths.tolist())
        return elapsed

    return call


def finish(row: dict, batch: int, case: str, lengths: np.ndarray, prefill_s: float, floor_s: float, args) -> dict:
    # Only the JAX sampler has a separate prompt pass to subtract: the others' step time includes theirs.
    own_prefill_s = prefill_s if row["engine"].startswith("jax") else 0.0
    step_s = (row["time_s"] - own_prefill_s) / max(int(lengths.max()) - 1, 1)
    return dict(
        row,
        lengths=case,
        batch=batch,
        prompt_len=args.prompt_len,
        new_tokens=int(lengths.max()),
        useful_tokens=int(lengths.sum()),
        new_tok_per_s=int(lengths.sum()) / row["time_s"],
        step_ms=1e3 * step_s,
        floor_step_ms=1e3 * floor_s,
        floor_fraction=floor_s / step_s,
    )


def prompt_tokens(config: ModelConfig, batch: int, args) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(3, min(config.vocab_size, 30000), size=(batch, args.prompt_len)).astype(np.int32)


def bench_batch(config, params, batch: int, args, engine=None) -> list[dict]:
    """Every engine's row of one batch size and every lengths case, the calls interleaved (``time_interleaved``)."""
    tokens = prompt_tokens(config, batch, args)
    prompts = tokens.tolist()
    prefill_s = time_prefill(config, params, prompts, args)
    floor_s = floor_step_s(config, params, batch, args.prompt_len, args.new_tokens)
    calls, lengths = {}, {}
    for case in args.lengths:
        lengths[case] = row_lengths(case, batch, args.new_tokens)
        calls["jax", case] = jax_call(config, params, prompts, lengths[case], args, 0.0)
        if args.lora:
            calls["jax+lora", case] = jax_call(config, params, prompts, lengths[case], args, 1.0)
        for variant in args.variant:
            calls[f"jax[{variant}]", case] = jax_call(config, params, prompts, lengths[case], args, 0.0, variant)
        if engine is not None:
            calls["vllm", case] = vllm_call(engine, prompts, lengths[case])
    timed = time_interleaved(calls, args.repeats)
    rows = [finish(dict(r, engine=e), batch, c, lengths[c], prefill_s, floor_s, args) for (e, c), r in timed.items()]
    if args.hf and "uniform" in args.lengths:
        rows.append(finish(time_hf(config, tokens, args), batch, "uniform", lengths["uniform"], 0.0, floor_s, args))
    return rows


def bench(config, params, batches: list[int], args) -> tuple[list[dict], dict]:
    """The rows of every batch size; with ``--vllm`` from one engine, started first, and its start-up times.

    transformers runs before the engine starts: the engine runs in this process and changes process-wide state
    (the memory policy, torch's thread setter, the global seeds), and its threads stay until it is closed.
    """
    if not args.vllm:
        return [row for batch in batches for row in bench_batch(config, params, batch, args)], {}
    hf_rows = []
    if args.hf:  # transformers first, then the engine
        hf_rows = [r for b in batches for r in bench_batch(config, params, b, args) if r["engine"] == "hf"]
        args.hf = False
    model_dir = tempfile.mkdtemp(prefix="bench_sampler_vllm_")
    engine = None
    try:
        engine = start_vllm(config, params, args, model_dir)
        rows = [row for batch in batches for row in bench_batch(config, params, batch, args, engine)]
        return rows + hf_rows, {"vllm_start_s": engine.stats["start_s"], "vllm_warmup_s": engine.stats["warmup_s"]}
    finally:
        if engine is not None:
            engine.close()
        shutil.rmtree(model_dir, ignore_errors=True)


def summary(rows: list[dict], cases: list[str]) -> dict:
    """jax / vllm throughput per lengths case, and each engine's time of mixed over uniform."""
    batches = sorted({r["batch"] for r in rows})
    by = {(r["engine"], r["lengths"], r["batch"]): r for r in rows}
    out = {}
    for batch in batches:
        tag = "" if len(batches) == 1 else f"_batch{batch}"
        for case in cases:
            if ("vllm", case, batch) in by:
                jax_, vllm_ = by["jax", case, batch], by["vllm", case, batch]
                out[f"jax_vs_vllm_ratio_{case}{tag}"] = jax_["new_tok_per_s"] / vllm_["new_tok_per_s"]
        for engine in ("jax", "vllm"):
            if (engine, "mixed", batch) in by and (engine, "uniform", batch) in by:
                cost = by[engine, "mixed", batch]["time_s"] / by[engine, "uniform", batch]["time_s"]
                out[f"{engine}_mixed_vs_uniform_cost{tag}"] = cost
    return out


def print_table(rows: list[dict]) -> None:
    header = ("engine", "lengths", "batch", "prompt_len", "new_tokens", "useful_tokens", "time_s", "new_tok_per_s",
              "step_ms", "floor_step_ms")  # fmt: skip
    print(" ".join(f"{h:>13}" for h in (*header, "floor_frac", "first_call_s")))
    for r in sorted(rows, key=lambda r: (r["batch"], row_order(r))):
        cells = [f"{r[h]:>13.4g}" if isinstance(r[h], float) else f"{r[h]:>13}" for h in header]
        print(" ".join(cells), f"{r['floor_fraction']:>13.3f}", f"{r['first_call_s']:>13.2f}")
    print("new_tokens: the longest row's; new_tok_per_s: the stated (useful) tokens over time_s; step_ms includes")
    print("the prompt pass except for jax; first_call_s: jax's compile, vllm's first call at the shape, hf's warm-up")
    for batch in sorted({r["batch"] for r in rows}):
        by = {(r["engine"], r["lengths"]): r for r in rows if r["batch"] == batch}
        for (engine, case), r in by.items():
            if engine in ("vllm", "hf") and ("jax", case) in by:
                ratio = by["jax", case]["new_tok_per_s"] / r["new_tok_per_s"]
                print(f"batch {batch} lengths={case}: jax / {engine} new tokens/s = {ratio:.2f}")


def row_order(row: dict) -> tuple[int, int]:
    engines = ("jax", "jax+lora", "hf", "vllm")
    engine = row["engine"]
    return LENGTH_CASES.index(row["lengths"]), engines.index(engine) if engine in engines else 1


def model_config(args) -> ModelConfig:
    sizes = model_sizes(args.model)
    try:
        return ModelConfig.preset(args.preset, param_dtype=args.dtype, compute_dtype=args.dtype, **sizes)
    except ValueError as err:  # an unknown preset, or a size the model refuses
        raise ConfigError(f"--preset, --model: {err}") from err


def main(argv: list[str] | None = None) -> int:
    return run_main("bench_sampler", _bench, argv)


def _bench(argv: list[str] | None) -> None:
    args = parse_args(argv)
    config = model_config(args)
    if args.vllm:
        check_vllm(config)
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    print(
        f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} jax={jax.__version__} "
        f"preset={args.preset}{''.join(f' {m}' for m in args.model)} params={count_params(params['base']):,} "
        f"dtype={args.dtype} lengths={','.join(args.lengths)} "
        f"cache_window={args.cache_window} python={platform.python_version()} loadavg={os.getloadavg()}"
    )
    batches = [int(b) for b in args.batch.split(",")]
    for batch in batches:
        for case in args.lengths:
            n = row_lengths(case, batch, args.new_tokens)
            print(f"lengths={case} batch={batch}: {n.sum()} new tokens, mean {n.mean():.1f}, {n.min()} to {n.max()}")
    if args.hf and args.lengths != ["uniform"]:
        print("hf: uniform only (transformers generate() cannot stop rows at different lengths)")
    rows, meta = bench(config, params, batches, args)
    if args.vllm:
        print(f"vllm: engine start {meta['vllm_start_s']:.1f} s, warm-up {meta['vllm_warmup_s']:.1f} s")
    meta["loadavg_end"] = os.getloadavg()
    print_table(rows)
    ratios = summary(rows, args.lengths)
    for name, value in ratios.items():
        if "mixed_vs_uniform" in name:  # the ratios were printed with the table
            print(f"{name} (time of mixed / time of uniform) = {value:.3f}")
    print(f"loadavg at the end: {meta['loadavg_end']}")
    if args.json:
        meta.update(backend=jax.default_backend(), device=jax.devices()[0].device_kind, jax=jax.__version__)
        with open(args.json, "w") as f:
            json.dump({"meta": {**meta, **vars(args)}, "rows": rows, **ratios}, f, indent=2)


if __name__ == "__main__":
    jnp.zeros(())  # initialise the backend before timing anything
    raise SystemExit(main())
