"""The vLLM weight sync's handover, timed: one full set of Hugging Face tensors built from the JAX params by
``vllm_weights.hf_tensors``, through the host (a numpy copy per tensor, the path before DLPack) and through DLPack (the
JAX array's own buffer), on JAX's CPU device.

Random params of ``--shape`` are built directly in ``--dtype`` (leaf by leaf, never a float32 copy of the whole model:
the R1-1.5B shape is 3.6 GB in bfloat16, 7.1 GB in float32). One untimed sync per path comes first (it compiles the
slicing and transposing programs), then ``--repeats`` timed syncs per path, interleaved (host, dlpack, host, ...) so
that the machine's drift reaches both alike. Each tensor is held, as the engine's reload would take it, and dropped
(nothing reads it: no compute of ours is timed). Printed and written to ``--json``: seconds per full sync per path
(median, min, each), the host/DLPack ratio of the medians, the bytes that went through the host per path, and the
tensor counts.

Not timed: vLLM's reload copying the tensors into its own parameters (the same for both paths), the prefix-cache
reset; on a GPU the host path also crosses PCIe twice (device to host, host to device), which this CPU run does not.

    .venv/bin/python -m tools.bench_sync [--shape r1-1.5b|tiny] [--dtype bfloat16|float32] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

from lspo_jax.config import ModelConfig
from lspo_jax.models.specs import ParamSpec, abstract_params, param_specs
from lspo_jax.rollout import vllm_weights
from lspo_jax.train_config import ConfigError

if not __package__:  # run by its path: the repository root, where the package ``tools`` is, is not on sys.path
    sys.exit("tools/bench_sync.py: run it from the repository root as python -m tools.bench_sync ...")
from tools import run_main, write_json  # noqa: E402

SHAPES = {"r1-1.5b": "deepseek-r1-distill-qwen-1.5b", "tiny": "tiny"}
PATHS = ("host", "dlpack")
# The engine device each path's ``Handover`` is told: the params sit on JAX's CPU device, so "cpu" hands them over by
# DLPack and any other device ("cuda:0": where a GPU engine would be) sends every tensor through a host numpy copy.
ENGINE_DEVICE = {"host": "cuda:0", "dlpack": "cpu"}
PARTS = {"outer", "layers"}  # a full sync: embeddings, final norm and head; every decoder layer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="r1-1.5b")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--repeats", type=int, default=3, help="timed full syncs per path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures to this JSON file")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux counts KiB


def random_base(config: ModelConfig, seed: int) -> dict[str, Any]:
    """Random base params (N(0, 0.02^2) weights, norms 1, biases 0) in ``config.param_dtype``, each leaf drawn in that
    dtype by its own compiled program, so no float32 copy of a leaf (let alone of the model) is ever held."""
    specs = param_specs(config)["base"]
    leaves, treedef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    def one(spec: ParamSpec, key: jax.Array) -> jax.Array:
        if spec.init == "ones":
            return jnp.ones(spec.shape, spec.dtype)
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, spec.dtype)
        draw = jax.jit(lambda k: spec.init_scale * jax.random.normal(k, spec.shape, spec.dtype))
        return jax.block_until_ready(draw(key))

    return jax.tree.unflatten(treedef, [one(s, k) for s, k in zip(leaves, keys, strict=True)])


def one_sync(config: ModelConfig, base: dict[str, Any], dtype: str, path: str, torch: Any) -> dict[str, Any]:
    """Seconds, tensors and bytes of one full set of HF tensors handed over by ``path``; each tensor is held, as the
    engine's reload takes it, until the next one comes, then dropped."""
    handover = vllm_weights.Handover(torch, ENGINE_DEVICE[path])
    tensors = tensor_bytes = 0
    start = time.perf_counter()
    for _name, tensor in vllm_weights.hf_tensors(config, base, PARTS, dtype=dtype, handover=handover):
        tensors += 1
        tensor_bytes += tensor.numel() * tensor.element_size()
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "tensors": tensors,
        "tensor_bytes": tensor_bytes,
        "host_bytes": handover.host_bytes,
        "by_path": dict(handover.tensors),
        "fallback": handover.fallback,
    }


def main(argv: list[str] | None = None) -> int:
    return run_main("bench_sync", _bench, argv)


def _bench(argv: list[str] | None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError as err:
        raise ConfigError("bench_sync needs torch (the vLLM extra's CPU wheel: tools/setup.sh installs it)") from err
    config = ModelConfig.preset(SHAPES[args.shape], param_dtype=args.dtype, compute_dtype=args.dtype)
    abstract = abstract_params(config)["base"]
    params = sum(x.size for x in jax.tree.leaves(abstract))
    param_bytes = _check_memory(args, abstract)
    device = jax.devices("cpu")[0]
    load_before = os.getloadavg()[0]
    print(
        f"shape {args.shape} ({params:,} params, {args.dtype}, {param_bytes / 1e9:.2f} GB) on {device}; jax "
        f"{jax.__version__}, torch {torch.__version__}, {os.cpu_count()} cores, load {load_before:.2f}"
    )
    start = time.perf_counter()
    with jax.default_device(device):
        base = random_base(config, args.seed)
    build_s = time.perf_counter() - start
    build_rss = _peak_rss()
    print(f"params built in {build_s:.1f} s (peak resident memory so far {build_rss / 1e9:.2f} GB)")

    warmup, runs = _timed_syncs(config, base, args, torch)
    result: dict[str, Any] = {
        "shape": args.shape,
        "preset": SHAPES[args.shape],
        "dtype": args.dtype,
        "params": params,
        "param_bytes": param_bytes,
        "repeats": args.repeats,
        "build_s": build_s,
        "warmup_s": {p: w["seconds"] for p, w in warmup.items()},
        "versions": {"jax": jax.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "machine": {"cores": os.cpu_count(), "arch": platform.machine(), "load_before": load_before},
        "paths": {path: _path_figures(path, runs[path]) for path in PATHS},
    }
    extra = _compare_paths(result)
    result["machine"]["load_after"] = os.getloadavg()[0]
    result["peak_rss_after_build_bytes"] = build_rss
    result["peak_rss_bytes"] = _peak_rss()
    _print_result(result, extra)
    write_json(args.json, result)
    return 0


def _check_memory(args: argparse.Namespace, abstract: dict[str, Any]) -> int:
    """The params' bytes, refused up front where they and the sync would not fit in the memory available."""
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    available = _available_bytes()
    # The params, plus the largest tensor twice over (its transposed copy and, on the host path, its numpy copy).
    largest = max(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract) if x.ndim == 2)
    if available is not None and param_bytes + 2 * largest > 0.9 * available:
        raise ConfigError(
            f"--shape {args.shape} --dtype {args.dtype}: the params take {param_bytes / 1e9:.1f} GB and the sync up to "
            f"{2 * largest / 1e9:.1f} GB more; {available / 1e9:.1f} GB is available (try --dtype bfloat16)"
        )
    return param_bytes


def _timed_syncs(config: ModelConfig, base: dict[str, Any], args: argparse.Namespace, torch: Any):
    """One untimed sync per path, then ``--repeats`` timed ones, the paths interleaved: (warm-up, runs) by path."""
    warmup = {path: one_sync(config, base, args.dtype, path, torch) for path in PATHS}
    print("warm-up: " + ", ".join(f"{p} {w['seconds']:.3f} s" for p, w in warmup.items()))
    runs: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
    for repeat in range(args.repeats):
        for path in PATHS:
            run = one_sync(config, base, args.dtype, path, torch)
            runs[path].append(run)
            print(f"repeat {repeat + 1} {path:<6} {run['seconds']:.3f} s, {run['host_bytes'] / 1e6:.1f} MB via host")
    return warmup, runs


def _path_figures(path: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One path's timed syncs: their seconds (median, min, each) and the last one's tensor counts and bytes."""
    seconds = [r["seconds"] for r in runs]
    last = runs[-1]
    return {
        "engine_device": ENGINE_DEVICE[path],
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "seconds": seconds,
        "host_bytes": last["host_bytes"],
        "tensor_bytes": last["tensor_bytes"],
        "tensors": last["tensors"],
        "tensors_by_path": last["by_path"],
        "fallback": last["fallback"],
    }


def _compare_paths(result: dict[str, Any]) -> float:
    """The host/DLPack ratios into ``result``; returns the host path's extra median seconds."""
    host, dlpack = result["paths"]["host"], result["paths"]["dlpack"]
    result["host_over_dlpack_median"] = host["median_s"] / dlpack["median_s"]
    result["host_over_dlpack_min"] = host["min_s"] / dlpack["min_s"]
    extra = host["median_s"] - dlpack["median_s"]
    # What the host copies cost beyond the common work (casting, slicing layers, transposing), per byte copied.
    result["host_copy_gb_per_s"] = host["host_bytes"] / extra / 1e9 if extra > 0 else None
    return extra


def _print_result(result: dict[str, Any], extra: float) -> None:
    for path in PATHS:
        r = result["paths"][path]
        print(
            f"{path:<6} median {r['median_s']:.3f} s, min {r['min_s']:.3f} s per full sync; {r['tensors']} tensors, "
            f"{r['tensor_bytes'] / 1e6:.1f} MB handed over, {r['host_bytes'] / 1e6:.1f} MB through the host "
            f"(tensors by path {r['tensors_by_path']})"
        )
    rate = result["host_copy_gb_per_s"]
    print(
        f"host / dlpack: {result['host_over_dlpack_median']:.2f}x (medians), {result['host_over_dlpack_min']:.2f}x "
        f"(mins); the host copies' extra time {extra:.3f} s"
        + (f", {rate:.2f} GB/s of host copy" if rate is not None else "")
    )
    print(f"peak resident memory {result['peak_rss_bytes'] / 1e9:.2f} GB")


if __name__ == "__main__":
    raise SystemExit(main())
