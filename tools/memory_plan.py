"""Per-device memory of the paper's RL step, log-prob pass and sampler decode on 8 devices.

Compiles the real programs (``distributed.sharded_rl_step``, ``sharded_logprobs``, ``sampler.lower_decode``)
for abstract inputs only, nothing allocated, on 8 CPU devices unless 8 accelerators are present, and prints
XLA's buffer assignment per device (``memory_analysis``): arguments, outputs, temporaries, the bytes an
output reuses of a donated argument (alias), and peak = arguments + outputs - alias + temporaries.
An analytic line per layout counts what any layout must hold: params, AdamW state and gradients.

Defaults are the paper's step: DeepSeek-R1-Distill-Qwen-1.5B shape, float32 master weights, bfloat16
compute, 32 prompts x 16 rollouts = 512 rows of 1024 prompt + 8192 response tokens, 32 micro-batches
(16 rows each), log-probs in 1024-position chunks; decode of 512 rows with a 9216-slot cache.

    python tools/memory_plan.py [--layouts fsdp8,fsdp4_tp2] [--remat none,full,dots] [--budget-gb 80]
    python tools/memory_plan.py --packed --rows 288 --micro-batches 18 --attention blocked   # packed buffers
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from lspo_jax import distributed, losses, model, optim, sampler, sharding
from lspo_jax.config import ModelConfig

LAYOUTS = {"fsdp8": (1, 8, 1), "fsdp4_tp2": (1, 4, 2), "fsdp2_tp4": (1, 2, 4), "data2_fsdp4": (2, 4, 1)}
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Plan:
    rows: int
    prompt_tokens: int
    response_tokens: int
    micro_batches: int
    logprob_micro_batches: int
    chunk: int | None
    decode_rows: int
    budget_gb: float
    packed: bool = False

    @property
    def length(self) -> int:
        return self.prompt_tokens + self.response_tokens


def _devices() -> list[jax.Device]:
    accelerators = [d for d in jax.devices() if d.platform != "cpu"]
    return accelerators if len(accelerators) >= 8 else jax.devices("cpu")[:8]


def _shard_bytes(tree) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _abstract(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def _batch(plan: Plan, mesh, rows: int) -> dict:
    """Padded rows (an attention mask, one advantage a row) or, with ``plan.packed``, token buffers as
    ``packing.pack_rows`` makes them (segment ids and positions, advantages per token)."""
    by_rows = sharding.batch_sharding(mesh, rows)
    row = lambda dt, *shape: jax.ShapeDtypeStruct((rows, *shape), dt, sharding=by_rows)
    layout = ("segment_ids", "positions") if plan.packed else ("attention_mask",)
    batch = {k: row(jnp.int32, plan.length) for k in ("tokens", "mask", *layout)}
    advantages = row(jnp.float32, plan.length) if plan.packed else row(jnp.float32)
    return {**batch, "old_logp": row(jnp.float32, plan.length), "advantages": advantages}


def _stats(compiled) -> dict[str, float]:
    m = compiled.memory_analysis()
    if m is None:
        raise RuntimeError("this backend gives no memory_analysis; fall back to the analytic line")
    out = {
        "args": m.argument_size_in_bytes / GB,
        "outputs": m.output_size_in_bytes / GB,
        "alias": m.alias_size_in_bytes / GB,
        "temps": m.temp_size_in_bytes / GB,
    }
    out["peak"] = out["args"] + out["outputs"] - out["alias"] + out["temps"]
    return out


def _row(program: str, layout: str, remat: str, stats: dict[str, float], budget: float, seconds: float) -> str:
    fits = "yes" if stats["peak"] <= budget else "NO"
    cells = [f"{stats[k]:8.2f}" for k in ("args", "outputs", "alias", "temps", "peak")]
    return f"{program:<9} {layout:<10} {remat:<5} {' '.join(cells)}  {fits:<4} {seconds:6.1f}"


def train_step(config: ModelConfig, mesh, plan: Plan):
    tx = optim.make_optimizer()
    params_sh, state_sh, _ = distributed.step_shardings(config, mesh, tx)
    params = _abstract(model.abstract_params(config), params_sh)
    state = _abstract(jax.eval_shape(tx.init, model.abstract_params(config)), state_sh)
    spec = losses.LossSpec(chunk_size=plan.chunk)
    step = distributed.sharded_rl_step(config, mesh, spec=spec, num_micro_batches=plan.micro_batches)
    return step.lower(params, state, _batch(plan, mesh, plan.rows)).compile()


def logprob_pass(config: ModelConfig, mesh, plan: Plan):
    params = _abstract(model.abstract_params(config), sharding.param_shardings(config, mesh))
    batch = _batch(plan, mesh, plan.rows)
    logprobs = distributed.sharded_logprobs(
        config, mesh, spec=losses.LossSpec(chunk_size=plan.chunk), num_micro_batches=plan.logprob_micro_batches
    )
    return logprobs.lower(params, batch).compile()


def decode(config: ModelConfig, mesh, plan: Plan):
    return sampler.lower_decode(
        config,
        rows=plan.decode_rows,
        prompt_slots=plan.prompt_tokens,
        cache_slots=plan.length,
        total_new=plan.response_tokens,
        mesh=mesh,
    ).compile()


def analytic(config: ModelConfig, mesh, plan: Plan) -> str:
    """What the step holds whatever XLA does: sharded params, AdamW moments, float32 gradients (base)."""
    tx = optim.make_optimizer()
    params_sh, state_sh, _ = distributed.step_shardings(config, mesh, tx)
    params = _shard_bytes(_abstract(model.abstract_params(config), params_sh)) / GB
    state = _shard_bytes(_abstract(jax.eval_shape(tx.init, model.abstract_params(config)), state_sh)) / GB
    grads = _shard_bytes(_abstract(model.abstract_params(config)["base"], params_sh["base"])) / GB
    decode_weights = _shard_bytes(
        _abstract(
            jax.tree.map(lambda a: a.update(dtype=config.compute_dtype), model.abstract_params(config)["base"]),
            sharding.param_shardings(config, mesh, gather_fsdp=True)["base"],
        )
    )
    cache_sh = sharding.kv_cache_sharding(config, mesh, plan.decode_rows)
    layer_shape = (plan.decode_rows, config.num_kv_heads, plan.length, config.head_dim)
    itemsize = jnp.dtype(config.compute_dtype).itemsize
    cache = 2 * config.num_layers * math.prod(cache_sh.shard_shape(layer_shape)) * itemsize
    return (
        f"params {params:.2f} + AdamW state {state:.2f} + grads {grads:.2f} = {params + state + grads:.2f} GB; "
        f"decode: bf16 weights {decode_weights / GB:.2f} + KV cache {cache / GB:.2f} GB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default="fsdp8,fsdp4_tp2", help=f"comma-separated, from {sorted(LAYOUTS)}")
    parser.add_argument("--remat", default="none,full,dots", help="train-step remat policies to compile")
    parser.add_argument("--rows", type=int, default=512, help="RL batch rows (prompts x rollouts)")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--response-tokens", type=int, default=8192)
    parser.add_argument("--micro-batches", type=int, default=32)
    parser.add_argument("--logprob-micro-batches", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=1024, help="log-prob chunk (0: whole logits)")
    parser.add_argument("--decode-rows", type=int, default=512)
    parser.add_argument("--budget-gb", type=float, default=80.0)
    parser.add_argument("--programs", default="train,logprob,decode")
    parser.add_argument("--attention", default="einsum", help="model.attention of the train and log-prob programs")
    parser.add_argument(
        "--packed",
        action="store_true",
        help="token buffers (segment ids, positions) instead of padded rows; pair with the packed row count and "
        "micro-batches of tools/bench_packing.py (e.g. --rows 288 --micro-batches 18)",
    )
    args = parser.parse_args()
    plan = Plan(
        args.rows,
        args.prompt_tokens,
        args.response_tokens,
        args.micro_batches,
        args.logprob_micro_batches,
        args.chunk or None,
        args.decode_rows,
        args.budget_gb,
        args.packed,
    )
    base = ModelConfig.preset(
        "deepseek-r1-distill-qwen-1.5b", param_dtype="float32", compute_dtype="bfloat16", attention=args.attention
    )
    devices = _devices()
    print(
        f"jax {jax.__version__} on {len(devices)} x {devices[0].device_kind} ({platform.machine()}), "
        f"numpy {np.__version__}; {model.count_params(model.abstract_params(base)['base']):,} base params"
    )
    print(f"plan: {plan}")
    print(f"{'program':<9} {'layout':<10} {'remat':<5}     args  outputs    alias    temps     peak  fits   compile_s")
    programs = args.programs.split(",")
    for layout in args.layouts.split(","):
        mesh = sharding.make_mesh(sharding.MeshConfig(*LAYOUTS[layout]), devices)
        for remat in args.remat.split(",") if "train" in programs else ():
            start = time.perf_counter()
            stats = _stats(train_step(dataclasses.replace(base, remat=remat), mesh, plan))
            print(_row("train", layout, remat, stats, plan.budget_gb, time.perf_counter() - start), flush=True)
        for name, build in (("logprob", logprob_pass), ("decode", decode)):
            if name in programs:
                start = time.perf_counter()
                stats = _stats(build(base, mesh, plan))
                print(_row(name, layout, "-", stats, plan.budget_gb, time.perf_counter() - start), flush=True)
        print(f"analytic  {layout:<10} {analytic(base, mesh, plan)}", flush=True)


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)  # before the first use of JAX; ignored where 8 GPUs exist
    main()
