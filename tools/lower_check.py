"""Lowers every program a training run compiles for a GPU (``cuda``) and a TPU, here on the CPU, for abstract inputs.

No program of the project has to run on an accelerator to be checked for one: ``jax.jit(f).trace(*args)`` with
``jax.ShapeDtypeStruct`` arguments (nothing allocated, the paper's 1.5B params included) followed by
``.lower(lowering_platforms=(platform,))`` builds the StableHLO module that platform would compile, with the Pallas
kernels lowered to their Triton (``__gpu$xla.gpu.triton``) or Mosaic (``tpu_custom_call``) calls and the shardings
of an abstract 8-device mesh. What only the accelerator's compiler checks (a kernel's register or shared-memory
budget, a fusion's layout) stays unchecked; what is refused while lowering (a kernel's block shapes, a sharding or
a primitive the platform lacks) is caught here.

The programs are those a run builds (``learner.Learner``, ``sampler``, ``reweight``), from the project's own builders
and sharding rules (``distributed``, ``sharding``, ``axes.LOGICAL_RULES``), at the shape of ``--config`` (the paper's
recipe by default: R1-Distill-Qwen-1.5B, 32 x 16 rows of 1024 prompt + 8192 response tokens, bfloat16 compute):

    rl_packed, rl_padded   the RL update (``distributed.sharded_rl_step``) on packed token buffers and on padded rows
    logprobs_base          the old-log-prob pass of the rollouts, adapter off (``distributed.sharded_logprobs``)
    logprobs_adapter       the adapter-on pass of the scaffold's re-rolls (their importance-ratio denominators)
    sft                    the adapter's SFT step (``distributed.sharded_sft_step``)
    l2rr_target, l2rr_jvp  L2RR's target gradient and the directional derivatives of the batch
                           (``l2rr.sharded_target_gradient``, ``l2rr.sharded_directional_derivatives``)
    prefill, decode        the JAX sampler's prompt pass and decode segment, base alone (``sampler.trace_call``)
    prefill_adapter, decode_adapter   the same with the adapter on (the scaffold's re-rolls)

on one device and on abstract 8-device meshes (``fsdp8``: fsdp 8; ``fsdp4_tp2``: fsdp 4 x tp 2), with each
``model.attention`` meant for the platform (cuda: ``pallas``, ``blocked``, ``cudnn``; tpu: ``splash``, ``blocked``)
and, for the sampler, each ``model.decode_attention`` (cuda: ``pallas``, ``reduce``; tpu: ``reduce``). A cell that
needs what this machine lacks (cuDNN) is skipped with the reason. A program is traced once and lowered for each
platform its attention is meant for.

Usage:

    .venv/bin/python tools/lower_check.py                 # the paper's shape: minutes
    .venv/bin/python tools/lower_check.py --small         # a tiny model and short rows: seconds a program
    .venv/bin/python tools/lower_check.py --programs rl_packed,decode --meshes fsdp8 --platforms cuda --json out.json

It prints one line per cell: ``lowered``, ``skipped: reason`` or ``FAILED: reason`` (one line, never a traceback),
the seconds of its trace (shared by the platforms of one program) and of its lowering, and two FLOP figures of the
program, all devices together. ``TFLOP`` counts the matrix products of the traced program, each loop body times its
trip count (layer scan, micro-batches, LM-head chunks, attention blocks; a block pair the blocked attention skips is
counted as computed), a ``while`` loop once (``decode``: one generated token of every row, at the largest cache);
the Pallas and splash kernels' own products are not counted (the ``blocked`` row shows attention's share).
``XLA TFLOP`` is XLA's cost analysis of the lowered module, which counts a loop body once whatever its trip count.
A decode cell lowers one program per cache window and reports the largest. Exit status: 0 when every cell lowers or
is skipped, 1 when one fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import resource
import sys
import time
import types
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import jaxprs_in_params
from jax.sharding import AbstractMesh, AxisType, NamedSharding

from lspo_jax import distributed, l2rr, losses, model, optim, packing, reweight, sampler, sharding
from lspo_jax.axes import MESH_AXES
from lspo_jax.config import ModelConfig
from lspo_jax.learner import Learner
from lspo_jax.train_config import TrainConfig, load_config

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "lspo_deepmath_r1_distill_qwen_1p5b.yaml"
PLATFORMS = ("cuda", "tpu")
ATTENTION = {"cuda": ("pallas", "blocked", "cudnn"), "tpu": ("splash", "blocked")}
DECODE_ATTENTION = {"cuda": ("pallas", "reduce"), "tpu": ("reduce",)}
MESHES = {"one": (1, 1, 1), "fsdp8": (1, 8, 1), "fsdp4_tp2": (1, 4, 2)}
# Errors that say this machine lacks a library a cell needs (cuDNN is looked for when the program is traced): the
# cell is skipped with the error as its reason, not failed.
UNAVAILABLE = ("cuDNN is not detected", "needs a CUDA GPU")
# The custom call each kernel lowers to; a program lowered with that attention must hold it. The prompt pass
# attends with einsums whatever ``decode_attention`` says; L2RR's forward mode with what
# ``reweight.FORWARD_MODE_ATTENTION`` puts in place of a kernel without a jvp rule.
KERNEL_CALLS = {"pallas": "__gpu$xla.gpu.triton", "splash": "tpu_custom_call"}
EINSUM_PROGRAMS = ("prefill", "prefill_adapter")
FORWARD_MODE_PROGRAMS = ("l2rr_jvp",)
# The reduced shape: the tiny model with the paper's head dim (the kernels' block limits depend on it), rows of
# 32 + 96 tokens (the kernels pad them to one 128-token block), 4 x 4 rows in 2 micro-batches of 8 (one per device).
SMALL_OVERRIDES = (
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "data.max_prompt_tokens=32",
    "rollout.max_new_tokens=96",
    "data.max_solution_tokens=96",
    "reward.overlong_buffer=16",
    "loss.micro_batches=2",
    "loss.chunk_size=64",
    "l2rr.target_limit=8",
)


@dataclasses.dataclass(frozen=True)
class Shape:
    """The run (its config's step sizes and options) and the model whose programs are lowered."""

    run: TrainConfig
    model: ModelConfig


# What a program's builder returns: its trace, or one per shape a run compiles it at, by label (the decode step: one
# per cache window). Every builder traces under the mesh as the run does (the project's builders enter it themselves).
Built = jax.stages.Traced | dict[str, jax.stages.Traced]


@dataclasses.dataclass
class Cell:
    """One program on one platform, mesh and attention: its status, the reason when not lowered, FLOPs, seconds."""

    program: str
    platform: str
    mesh: str
    attention: str
    status: str = "lowered"  # "lowered", "skipped" or "failed"
    reason: str = ""
    tflop: float | None = None
    xla_tflop: float | None = None
    trace_s: float = 0.0
    lower_s: float = 0.0


# ------------------------------------------------------------------------------------------------ shapes
def paper_shape(config: str | Path = RECIPE) -> Shape:
    """The recipe's run at R1-Distill-Qwen-1.5B's shape (``config.py``'s preset), as ``run.load_policy`` sets it."""
    return _shape(load_config(config), ModelConfig.preset("deepseek-r1-distill-qwen-1.5b"))


def small_shape(config: str | Path = RECIPE) -> Shape:
    """The recipe's options at a tiny model and short rows (``SMALL_OVERRIDES``): seconds a program."""
    return _shape(load_config(config, list(SMALL_OVERRIDES)), ModelConfig.preset("tiny", head_dim=128))


def _shape(run: TrainConfig, base: ModelConfig) -> Shape:
    source = run.model
    policy = dataclasses.replace(base, compute_dtype=source.compute_dtype, remat=source.remat, lora=source.lora)
    return Shape(run, policy)


def abstract_mesh(name: str) -> AbstractMesh:
    """The ``("data", "fsdp", "tp")`` mesh of ``MESHES[name]``: axis sizes only, no devices (``Auto`` axes, as
    ``sharding.make_mesh``)."""
    return AbstractMesh(MESHES[name], MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def _rows(count: int, length: int, keys: Iterable[str], sharded: NamedSharding | None) -> dict[str, Any]:
    """A batch of ``count`` rows of ``length`` slots as ``packing`` makes them: int32 tokens, layouts and masks,
    float32 log-probs, advantages and weights (``advantages`` per token: LSPO's spliced rows carry token weights)."""
    floats = {"old_logp": (length,), "advantages": (length,), "weight": ()}
    shapes = {key: (jnp.float32, floats[key]) if key in floats else (jnp.int32, (length,)) for key in keys}
    return {k: jax.ShapeDtypeStruct((count, *shape), dt, sharding=sharded) for k, (dt, shape) in shapes.items()}


def _per_micro(shape: Shape, mesh: AbstractMesh, length: int) -> int:
    # The learner's own rule for rows of a pass per micro-batch; it reads only the run and the mesh.
    return Learner.rows_per_micro(types.SimpleNamespace(run=shape.run, mesh=mesh), length)


# ------------------------------------------------------------------------------------- learner's programs
RL_KEYS = {"packed": ("segment_ids", "positions"), "padded": ("attention_mask",)}
LOSS_KEYS = ("mask", "old_logp", "advantages")


def _train_state(config: ModelConfig, mesh: AbstractMesh, run: TrainConfig) -> tuple[Any, Any]:
    tx = optim.make_optimizer(run.optim, run.scaffold.sft)
    params_sh, state_sh, _ = distributed.step_shardings(config, mesh, tx)
    state = jax.eval_shape(tx.init, model.abstract_params(config))
    return _abstract(model.abstract_params(config), params_sh), _abstract(state, state_sh)


def _rollout_rows(shape: Shape, mesh: AbstractMesh, layout: str, keys: Iterable[str]) -> tuple[dict, int]:
    """The step's ``prompts x group`` rows and their micro-batch count: padded rows in ``loss.micro_batches``, or
    packed buffers as ``Learner.place_rows`` sizes them (every rollout full length: one to a buffer row)."""
    run = shape.run
    count, length = run.rollout.prompts_per_step * run.rollout.group_size, _length(run)
    if layout == "packed":
        count, micro = packing.micro_batching(count, sharding.batch_shards(mesh), _per_micro(shape, mesh, length))
    else:
        micro = run.loss.micro_batches
    rows = _rows(count, length, ("tokens", *RL_KEYS[layout], *keys), sharding.batch_sharding(mesh, count))
    return rows, micro


def _length(run: TrainConfig) -> int:
    return run.data.max_prompt_tokens + run.rollout.max_new_tokens


def rl_program(layout: str, shape: Shape, config: ModelConfig, mesh: AbstractMesh) -> Built:
    run = shape.run
    batch, micro = _rollout_rows(shape, mesh, layout, LOSS_KEYS)
    step = distributed.sharded_rl_step(
        config, mesh, rl=run.optim, sft=run.scaffold.sft, spec=losses.LossSpec.of(run), num_micro_batches=micro,
        skip_nonfinite=True,
    )  # fmt: skip
    return step.trace(*_train_state(config, mesh, run), batch)


def logprobs_program(adapter: bool, shape: Shape, config: ModelConfig, mesh: AbstractMesh) -> Built:
    """The rollouts' pass (adapter off, the rollout's temperature) or the re-rolls' (the scaffold's scale and
    temperature), on packed buffers (``loss.packing``, the recipe's layout)."""
    run = shape.run
    rows, micro = _rollout_rows(shape, mesh, "packed", ())
    scale = run.scaffold.reroll_scale if adapter else 0.0
    temperature = (run.scaffold.reroll_temperature if adapter else None) or run.rollout.temperature
    spec = dataclasses.replace(losses.LossSpec.of(run), temperature=temperature)
    program = distributed.sharded_logprobs(config, mesh, lora_scale=scale, spec=spec, num_micro_batches=micro)
    return program.trace(sharding.abstract_params(config, mesh), rows)


def sft_program(shape: Shape, config: ModelConfig, mesh: AbstractMesh) -> Built:
    """One SFT step on every prompt's worked solution (each a cliff), packed into buffers of prompt + solution."""
    run = shape.run
    length = run.data.max_prompt_tokens + run.data.max_solution_tokens
    shards = sharding.batch_shards(mesh)
    count, micro = packing.micro_batching(run.rollout.prompts_per_step, shards, _per_micro(shape, mesh, length))
    rows = _rows(count, length, ("tokens", *RL_KEYS["packed"], "mask"), sharding.batch_sharding(mesh, count))
    step = distributed.sharded_sft_step(
        config, mesh, rl=run.optim, sft=run.scaffold.sft, num_micro_batches=micro, chunk_size=run.loss.chunk_size
    )
    return step.trace(*_train_state(config, mesh, run), rows)


# ------------------------------------------------------------------------------------------------- L2RR
def l2rr_target_program(shape: Shape, config: ModelConfig, mesh: AbstractMesh) -> Built:
    """``l2rr.sharded_target_gradient`` over ``l2rr.target_limit`` target rows, split over the data axes as
    ``TargetSide`` places them."""
    run = shape.run
    options = {"num_micro_batches": run.l2rr.target_micro_batches, "chunk_size": run.loss.chunk_size}
    length = run.data.max_prompt_tokens + run.data.max_solution_tokens
    count = -(-(run.l2rr.target_limit or 1) // options["num_micro_batches"]) * options["num_micro_batches"]
    rows = _rows(count, length, ("tokens", "attention_mask", "mask", "weight"), sharding.batch_sharding(mesh, count))
    base = sharding.abstract_params(config, mesh)["base"]
    return l2rr.sharded_target_gradient(config, mesh, **options).trace(base, rows)


def l2rr_jvp_program(shape: Shape, config: ModelConfig, mesh: AbstractMesh) -> Built:
    """The directional derivatives of the step's padded rows along ``g_tgt`` (laid out as the base), through the
    per-prompt losses the run's ``reweight.TargetScorer`` builds (its attention for forward mode included), the rows
    split over the data axes as the scorer places them."""
    run = shape.run
    prompt_losses = reweight.TargetScorer(run, config, None).losses
    count = run.rollout.prompts_per_step * run.rollout.group_size
    keys = ("tokens", "attention_mask", *LOSS_KEYS)
    batch = _rows(count, _length(run), keys, sharding.batch_sharding(mesh, count))
    base = sharding.abstract_params(config, mesh)["base"]
    program = l2rr.sharded_directional_derivatives(config, mesh)
    return program.trace(jax.tree_util.Partial(prompt_losses, batch=batch), base, base)


# ---------------------------------------------------------------------------------------------- sampler
def _sampler_call(adapter: bool, shape: Shape, config: ModelConfig, mesh: AbstractMesh, decode: bool) -> dict:
    """``sampler.trace_call`` for a step's rollouts (the base alone) or the scaffold's re-rolls (the adapter on):
    ``prompts_per_step`` prompts of ``max_prompt_tokens``, ``group_size`` samples each, ``max_new_tokens`` new."""
    run = shape.run
    return sampler.trace_call(
        config, prompts=run.rollout.prompts_per_step, prompt_tokens=run.data.max_prompt_tokens,
        max_new_tokens=run.rollout.max_new_tokens, n=run.rollout.group_size, adapter=adapter, mesh=mesh, decode=decode,
    )  # fmt: skip


def prefill_program(adapter: bool, shape: Shape, config: ModelConfig, mesh: AbstractMesh) -> Built:
    return _sampler_call(adapter, shape, config, mesh, decode=False)["prefill"]


def decode_program(adapter: bool, shape: Shape, config: ModelConfig, mesh: AbstractMesh) -> Built:
    """The decode segments of every cache window the sampler grows through, one program each."""
    traced = _sampler_call(adapter, shape, config, mesh, decode=True)
    return {label: one for label, one in traced.items() if label != "prefill"}


# Each traces a program, or one per shape a run compiles it at (``Built``).
PROGRAMS: dict[str, Callable[[Shape, ModelConfig, AbstractMesh], Built]] = {
    "rl_packed": functools.partial(rl_program, "packed"),
    "rl_padded": functools.partial(rl_program, "padded"),
    "logprobs_base": functools.partial(logprobs_program, False),
    "logprobs_adapter": functools.partial(logprobs_program, True),
    "sft": sft_program,
    "l2rr_target": l2rr_target_program,
    "l2rr_jvp": l2rr_jvp_program,
    "prefill": functools.partial(prefill_program, False),
    "decode": functools.partial(decode_program, False),
    "prefill_adapter": functools.partial(prefill_program, True),
    "decode_adapter": functools.partial(decode_program, True),
}
SAMPLER_PROGRAMS = ("prefill", "decode", "prefill_adapter", "decode_adapter")


def attentions(program: str, platform: str) -> tuple[str, ...]:
    """The attention implementations of ``program`` meant for ``platform`` (the sampler's: its decode step's)."""
    return (DECODE_ATTENTION if program in SAMPLER_PROGRAMS else ATTENTION)[platform]


def model_config(shape: Shape, program: str, attention: str) -> ModelConfig:
    field = "decode_attention" if program in SAMPLER_PROGRAMS else "attention"
    return dataclasses.replace(shape.model, **{field: attention})


# ------------------------------------------------------------------------------------------------ FLOPs
def dot_flops(jaxpr: Any) -> float:
    """FLOPs of the matrix products of a traced program (2 per multiply-add, the program's global shapes), each
    loop body times its trip count; a ``cond`` counts its costliest branch, a ``while`` loop one iteration."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
        elif name != "pallas_call":  # a kernel's body is a block's program over a grid: not counted
            inner = [dot_flops(sub) for sub in jaxprs_in_params(eqn.params)]
            total += (max(inner, default=0.0) if name == "cond" else sum(inner)) * _trips(eqn)
    return total


def _trips(eqn: Any) -> int:
    if eqn.primitive.name == "scan":
        return eqn.params["length"]
    if eqn.primitive.name == "shard_map":  # its body is one shard's
        return math.prod(eqn.params["mesh"].shape[a] for a in eqn.params["newly_manual_axes"])
    return 1


# ---------------------------------------------------------------------------------------------- lowering
def one_line(error: BaseException) -> str:
    """The error as one line: its type and first non-empty line, cut at 240 characters."""
    text = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {text}"[:240]


def kernel_call(program: str, attention: str) -> str | None:
    """The custom call a module of ``program`` lowered with ``attention`` must hold, if any (``KERNEL_CALLS``)."""
    if program in EINSUM_PROGRAMS:
        return None
    if program in FORWARD_MODE_PROGRAMS:
        attention = reweight.FORWARD_MODE_ATTENTION.get(attention, attention)
    return KERNEL_CALLS.get(attention)


def lower(traced: Any, cell: Cell, label: str = "") -> None:
    """Lower ``traced`` for ``cell.platform`` and read XLA's FLOP count. A refusal marks the cell failed, as does a
    module without the kernel's call where the cell's attention is a kernel (its interpreter was lowered instead)."""
    start = time.perf_counter()
    try:
        lowered = traced.lower(lowering_platforms=(cell.platform,))
        target = kernel_call(cell.program, cell.attention)
        if target is not None and f"@{target}(" not in lowered.as_text():
            raise AssertionError(f"the lowered module holds no {target} call: the kernel's interpreter was lowered")
        cost = lowered.cost_analysis() or {}
        cell.xla_tflop = cost["flops"] / 1e12 if cost.get("flops", -1) >= 0 else None
    except Exception as error:  # any refusal is the cell's result, reported as one line
        cell.status, cell.reason = "failed", (f"{label}: " if label else "") + one_line(error)
    cell.lower_s += time.perf_counter() - start


def check_program(shape: Shape, name: str, mesh_name: str, attention: str, platforms: Iterable[str]) -> list[Cell]:
    """The cells of one program, mesh and attention: traced once (each of its shapes), lowered for each platform."""
    cells = [Cell(name, platform, mesh_name, attention) for platform in platforms]
    mesh, start = abstract_mesh(mesh_name), time.perf_counter()
    try:
        built = PROGRAMS[name](shape, model_config(shape, name, attention), mesh)
        traced = list(built.items()) if isinstance(built, dict) else [("", built)]
        flops = dot_flops(traced[-1][1].jaxpr.jaxpr) / 1e12
    except Exception as error:  # a refusal while tracing is every platform's
        status = "skipped" if any(s in str(error) for s in UNAVAILABLE) else "failed"
        reason = one_line(error)
        for cell in cells:
            cell.status, cell.reason, cell.trace_s = status, reason, time.perf_counter() - start
        return cells
    seconds = time.perf_counter() - start
    for cell in cells:
        cell.trace_s, cell.tflop = seconds, flops
        for label, one in traced:  # stops at the first shape that fails
            if cell.status == "lowered":
                lower(one, cell, label)
    return cells


def check(
    shape: Shape,
    programs: Iterable[str] = PROGRAMS,
    meshes: Iterable[str] = MESHES,
    platforms: Iterable[str] = PLATFORMS,
    attention: Iterable[str] | None = None,
) -> Iterator[Cell]:
    """Every cell of ``programs`` x ``meshes`` x ``platforms`` x their attention implementations (those in
    ``attention`` when given), as each is done."""
    platforms, wanted = tuple(platforms), None if attention is None else set(attention)
    for name in programs:
        for mesh_name in meshes:
            impls = dict.fromkeys(a for p in platforms for a in attentions(name, p))
            for impl in (a for a in impls if wanted is None or a in wanted):
                meant = [p for p in platforms if impl in attentions(name, p)]
                yield from check_program(shape, name, mesh_name, impl, meant)


# --------------------------------------------------------------------------------------------- printing
HEADER = (
    f"{'program':<17} {'platform':<8} {'mesh':<10} {'attention':<9} {'TFLOP':>10} {'XLA TFLOP':>10} trace_s lower_s"
)


def row(cell: Cell) -> str:
    figure = lambda x: f"{x:10.4g}" if x is not None else f"{'-':>10}"
    status = cell.status if cell.status == "lowered" else f"{cell.status.upper()}: {cell.reason}"
    return (
        f"{cell.program:<17} {cell.platform:<8} {cell.mesh:<10} {cell.attention:<9} {figure(cell.tflop)} "
        f"{figure(cell.xla_tflop)} {cell.trace_s:7.1f} {cell.lower_s:7.1f}  {status}"
    )


def summary(cells: list[Cell], seconds: float) -> str:
    counts = {s: sum(c.status == s for c in cells) for s in ("lowered", "skipped", "failed")}
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kilobytes on Linux
    return (
        f"{len(cells)} cells: {counts['lowered']} lowered, {counts['skipped']} skipped, {counts['failed']} failed "
        f"in {seconds:.0f} s (peak resident memory {peak_gb:.1f} GB)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="a tiny model and short rows (SMALL_OVERRIDES)")
    parser.add_argument("--config", default=str(RECIPE), help="the run's YAML (default: the paper's recipe)")
    parser.add_argument("--programs", default=",".join(PROGRAMS), help=f"comma-separated, from {list(PROGRAMS)}")
    parser.add_argument("--meshes", default=",".join(MESHES), help=f"comma-separated, from {list(MESHES)}")
    parser.add_argument("--platforms", default=",".join(PLATFORMS), help="comma-separated: cuda, tpu")
    parser.add_argument("--attention", default=None, help="only these implementations (comma-separated)")
    parser.add_argument("--json", default=None, help="also write the cells to this JSON file")
    args = parser.parse_args(argv)
    shape = (small_shape if args.small else paper_shape)(args.config)
    print(f"jax {jax.__version__}; {model.count_params(model.abstract_params(shape.model)['base']):,} base params")
    print(HEADER, flush=True)
    start, cells = time.perf_counter(), []
    only = None if args.attention is None else args.attention.split(",")
    split = lambda text: text.split(",")
    for cell in check(shape, split(args.programs), split(args.meshes), split(args.platforms), only):
        cells.append(cell)
        print(row(cell), flush=True)
    print(summary(cells, time.perf_counter() - start))
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(c) for c in cells], indent=1) + "\n")
    return int(any(c.status == "failed" for c in cells))


if __name__ == "__main__":
    sys.exit(main())
