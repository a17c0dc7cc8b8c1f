"""Lowers every program a training run compiles for a GPU (``cuda``) and a TPU, here on the CPU, for abstract inputs.

No program of the project has to run on an accelerator to be checked for one: ``jax.jit(f).trace(*args)`` with
``jax.ShapeDtypeStruct`` arguments (nothing allocated, the paper's 1.5B params included) followed by
``.lower(lowering_platforms=(platform,))`` builds the StableHLO module that platform would compile, with the Pallas
kernels lowered to their Triton (``__gpu$xla.gpu.triton``) or Mosaic (``tpu_custom_call``) calls and the shardings
of an abstract 8-device mesh. What only the accelerator's compiler checks (a kernel's register or shared-memory
budget, a fusion's layout) stays unchecked; what is refused while lowering (a kernel's block shapes, a sharding or
a primitive the platform lacks) is caught here.

The programs are those a run builds (``Learner``, ``sampler``, ``methods.l2rr``), from the project's own builders
and sharding rules (``distributed``, ``sharding``, ``axes.LOGICAL_RULES``), at the shape of ``--config`` (the paper's
recipe by default: R1-Distill-Qwen-1.5B, 32 x 16 rows of 1024 prompt + 8192 response tokens, bfloat16 compute):

    rl_packed, rl_padded   the RL update (``distributed.sharded_rl_step``) on packed token buffers and on padded rows
    logprobs_base          the old-log-prob pass of the rollouts, adapter off (``distributed.sharded_logprobs``); with
                           ``loss.kl_coef`` > 0 the frozen reference's too, its weights an argument beside the base's
    logprobs_adapter       the adapter-on pass of the scaffold's re-rolls (their importance-ratio denominators)
    sft                    the adapter's SFT step (``distributed.sharded_sft_step``)
    l2rr_target, l2rr_jvp  L2RR's target gradient and the directional derivatives of the batch
                           (``l2rr.target.sharded_target_gradient``, ``...sharded_directional_derivatives``)
    prefill, decode        the JAX sampler's prompt pass and decode segment, base alone (``lowering.trace_call``)
    prefill_adapter, decode_adapter   the same with the adapter on (the scaffold's re-rolls)

on one device and on abstract 8-device meshes (``fsdp8``: fsdp 8; ``fsdp4_tp2``: fsdp 4 x tp 2), with each
``model.attention`` meant for the platform (cuda: ``pallas``, ``blocked``, ``cudnn``; tpu: ``splash``, ``blocked``)
and, for the sampler, each ``model.decode_attention`` (cuda: ``pallas``, ``reduce``; tpu: ``reduce``). A cell that
needs what this machine lacks (cuDNN) is skipped with the reason. A program is traced once and lowered for each
platform its attention is meant for.

Usage:

    .venv/bin/python -m tools.lower_check                 # the paper's shape: minutes
    .venv/bin/python -m tools.lower_check --small         # a tiny model and short rows: seconds a program
    .venv/bin/python -m tools.lower_check --programs rl_packed,decode --meshes fsdp8 --platforms cuda --json out.json
    .venv/bin/python -m tools.lower_check --compile h100x8,v5p-16 [--config F] [key=value ...] [--json out.json]
    .venv/bin/python -m tools.lower_check --compile h100x8,v5p-16 --splits 4+4,2+6   # learner + sampler devices

``--compile`` goes further than lowering: it compiles the programs a run of ``--config`` compiles, at its own
attention, for each named target (``TARGETS``: 8 H100s, or a v5p-8, v5p-16, v6e-8 or v5e-8 slice) with the chips'
own compilers on this CPU, and prints per program and mesh the memory a device needs against its budget (see
"Does it fit the chips" in ``docs/performance.md``). ``--splits L+S,...`` compiles instead for the sampling on
devices of its own (``rollout.placement: split``): the learner's programs on a mesh of a target's first L devices,
the step's rollouts (``prefill``, ``decode``) on one of the other S, each against a device's budget. Exit status 1
when a cell does not fit or fails, 2 when the compilers are missing.

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
import importlib.util
import json
import math
import os
import re
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

from lspo_jax.config import HUB_PRESETS, ModelConfig
from lspo_jax.job.config import load_config
from lspo_jax.methods.l2rr import config as l2rr_config
from lspo_jax.methods.l2rr import target as l2rr_target
from lspo_jax.models import sharding, specs
from lspo_jax.models.axes import MESH_AXES
from lspo_jax.rl import distributed, losses, optim, packing
from lspo_jax.rl.learner import Learner, reference_dtype
from lspo_jax.rollout import lowering
from lspo_jax.train_config import ConfigError, TrainConfig

if not __package__:  # run by its path: the repository root, where the package ``tools`` is, is not on sys.path
    sys.exit("tools/lower_check.py: run it from the repository root as python -m tools.lower_check ...")
from tools import run_main  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "lspo_deepmath_r1_distill_qwen_1p5b.yaml"
PLATFORMS = ("cuda", "tpu")
ATTENTION = {"cuda": ("pallas", "blocked", "cudnn"), "tpu": ("splash", "blocked")}
DECODE_ATTENTION = {"cuda": ("pallas", "reduce"), "tpu": ("reduce",)}
MESHES = {"one": (1, 1, 1), "fsdp8": (1, 8, 1), "fsdp4_tp2": (1, 4, 2)}
# Compiling for a chip takes a mesh of its devices: the 8-device meshes, and a 4-chip slice's (v5p-8).
COMPILE_MESHES = {**MESHES, "fsdp4": (1, 4, 1), "fsdp2_tp2": (1, 2, 2)}
# Errors that say this machine lacks a library a cell needs (cuDNN is looked for when the program is traced): the
# cell is skipped with the error as its reason, not failed.
UNAVAILABLE = ("cuDNN is not detected", "needs a CUDA GPU")
# The custom call each kernel lowers to; a program lowered with that attention must hold it. The prompt pass
# attends with einsums whatever ``decode_attention`` says; L2RR's forward mode with what
# ``l2rr_target.FORWARD_MODE_ATTENTION`` puts in place of a kernel without a jvp rule.
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
def paper_shape(config: str | Path = RECIPE, overrides: Iterable[str] = ()) -> Shape:
    """The recipe's run at its model's shape, as ``run.load_policy`` sets it: the preset of ``model.path``'s hub name
    (``config.HUB_PRESETS``, published shapes: nothing is downloaded), R1-Distill-Qwen-1.5B's for any other path."""
    run = load_config(config, list(overrides))
    name = next((preset for hub, preset in HUB_PRESETS.items() if run.model.path.rstrip("/").endswith(hub)), None)
    return _shape(run, ModelConfig.preset(name or "deepseek-r1-distill-qwen-1.5b"))


def small_shape(config: str | Path = RECIPE, overrides: Iterable[str] = ()) -> Shape:
    """The recipe's options at a tiny model and short rows (``SMALL_OVERRIDES``): seconds a program."""
    run = load_config(config, [*SMALL_OVERRIDES, *overrides])
    return _shape(run, ModelConfig.preset("tiny", head_dim=128))


def _shape(run: TrainConfig, base: ModelConfig) -> Shape:
    source = run.model
    policy = dataclasses.replace(base, compute_dtype=source.compute_dtype, remat=source.remat, lora=source.lora)
    if run.optim.train == "lora":  # LoRA RL, as ``build.load_policy`` sets it: the policy adapter, the base's dtype
        policy = dataclasses.replace(policy, policy_lora=source.policy_lora, param_dtype=source.param_dtype)
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
    floats = {"old_logp": (length,), "ref_logp": (length,), "advantages": (length,), "weight": ()}
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
    state = jax.eval_shape(tx.init, specs.abstract_params(config))
    return _abstract(specs.abstract_params(config), params_sh), _abstract(state, state_sh)


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
    """The update; with a KL term in the loss (``loss.kl_coef``, ``kl_in: loss``) its batch carries ``ref_logp``."""
    run, spec = shape.run, losses.LossSpec.of(shape.run)
    batch, micro = _rollout_rows(shape, mesh, layout, (*LOSS_KEYS, *(("ref_logp",) if spec.kl_coef else ())))
    step = distributed.sharded_rl_step(
        config, mesh, rl=run.optim, sft=run.scaffold.sft, spec=spec, num_micro_batches=micro, skip_nonfinite=True,
    )  # fmt: skip
    return step.trace(*_train_state(config, mesh, run), batch)


def logprobs_program(adapter: bool, shape: Shape, config: ModelConfig, mesh: AbstractMesh) -> Built:
    """The rollouts' pass (adapter off, the rollout's temperature) or the re-rolls' (the scaffold's scale and
    temperature), on packed buffers (``loss.packing``, the recipe's layout). With a KL penalty (``loss.kl_coef``) the
    rollouts' pass is the learner's: the frozen reference's weights are an argument beside the base's
    (``reference_params``) and its log-probs an output beside theirs."""
    run = shape.run
    rows, micro = _rollout_rows(shape, mesh, "packed", ())
    scale = run.scaffold.reroll_scale if adapter else 0.0
    temperature = (run.scaffold.reroll_temperature if adapter else None) or run.rollout.temperature
    spec = dataclasses.replace(losses.LossSpec.of(run), temperature=temperature)
    reference = not adapter and run.loss.kl_coef > 0
    program = distributed.sharded_logprobs(
        config, mesh, lora_scale=scale, spec=spec, num_micro_batches=micro, reference=reference
    )
    params = sharding.abstract_params(config, mesh)
    if reference:
        params["ref"] = reference_params(config, mesh)
    return program.trace(params, rows)


def reference_params(config: ModelConfig, mesh: AbstractMesh) -> Any:
    """The KL penalty's frozen reference as the learner holds it: the base's layout, in ``learner.reference_dtype``."""
    base = sharding.abstract_params(config, mesh)["base"]
    dtype = lambda a: reference_dtype(config, a.dtype)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype(a), sharding=a.sharding), base)


def resident_gib(tree: Any) -> float:
    """GiB a device holds of ``tree``'s abstract arrays (each leaf's shard)."""
    shard = lambda a: math.prod(a.sharding.shard_shape(a.shape)) * jnp.dtype(a.dtype).itemsize
    return sum(shard(a) for a in jax.tree.leaves(tree)) / GIB


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
    limit = run.l2rr.target_limit or 1
    options = {"num_micro_batches": l2rr_config.target_micro_batches(run, limit), "chunk_size": run.loss.chunk_size}
    length = run.data.max_prompt_tokens + run.data.max_solution_tokens
    count = -(-limit // options["num_micro_batches"]) * options["num_micro_batches"]
    rows = _rows(count, length, ("tokens", "attention_mask", "mask", "weight"), sharding.batch_sharding(mesh, count))
    base = sharding.abstract_params(config, mesh)["base"]
    return l2rr_target.sharded_target_gradient(config, mesh, **options).trace(base, rows)


def l2rr_jvp_program(shape: Shape, config: ModelConfig, mesh: AbstractMesh) -> Built:
    """The directional derivatives of the step's padded rows along ``g_tgt`` (laid out as the base), through the
    per-prompt losses the run's ``l2rr_target.TargetScorer`` builds (its attention for forward mode included), the rows
    split over the data axes as the scorer places them."""
    run = shape.run
    prompt_losses = l2rr_target.TargetScorer(run, config, None).losses
    count = run.rollout.prompts_per_step * run.rollout.group_size
    keys = ("tokens", "attention_mask", *LOSS_KEYS)
    batch = _rows(count, _length(run), keys, sharding.batch_sharding(mesh, count))
    base = sharding.abstract_params(config, mesh)["base"]
    program = l2rr_target.sharded_directional_derivatives(config, mesh)
    return program.trace(jax.tree_util.Partial(prompt_losses, batch=batch), base, base)


# ---------------------------------------------------------------------------------------------- sampler
def _sampler_call(adapter: bool, shape: Shape, config: ModelConfig, mesh: AbstractMesh, decode: bool) -> dict:
    """``lowering.trace_call`` for a step's rollouts (the base alone) or the scaffold's re-rolls (the adapter on):
    ``prompts_per_step`` prompts of ``max_prompt_tokens``, ``group_size`` samples each, ``max_new_tokens`` new."""
    run, mesh = shape.run, sharding.sampling_mesh(mesh)  # as the run's ``Generator`` samples
    return lowering.trace_call(
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
        attention = l2rr_target.FORWARD_MODE_ATTENTION.get(attention, attention)
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


# ------------------------------------------------------------------------------------------------ compiling
# Deviceless compilation: the chips' own compilers (libtpu; XLA's CUDA backend with ptxas from the nvcc wheel) run
# here on compile-only devices of a named topology (``tools/setup.sh test`` installs them into ``.venv/chips``), and
# the executable's memory analysis says what a device needs. TPU budgets are what the compiler enforces (arguments +
# outputs - aliased + temporaries, read off its refusals with libtpu 0.0.42); an H100 program's is the device's
# memory (its target config) times JAX's allocator fraction for the run (``accelerator.memory_fraction``: XLA
# compiles for CUDA without a memory check). Speed is not known this way: nothing is autotuned.
TARGET_CONFIGS = Path(__file__).resolve().parent / "targets"
# Where ``tools/setup.sh test`` installs the compilers (the ``compile`` extra) apart from the environment, and the
# jaxlib they and the H100 target config are for.
CHIPS = Path(__file__).resolve().parents[1] / ".venv" / "chips"
COMPILE_JAXLIB = "0.10.2"
# libtpu away from a TPU VM: no metadata server to ask, one host (else it logs an error looking for both), and no
# lock on the chips it would otherwise take (compiling beside another process that compiles, a test worker's).
LIBTPU_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Target:
    """A chip and topology to compile for: ``jax.experimental.topologies.get_topology_desc``'s arguments."""

    platform: str
    topology: str
    chip_config: str = "default"
    host_bounds: tuple[int, int, int] | None = None
    hbm_gib: float | None = None  # TPU: the budget its compiler enforces; CUDA: from the target config

    def devices(self) -> list[Any]:
        from jax.experimental import topologies

        for name, value in LIBTPU_ENV.items():
            os.environ.setdefault(name, value)

        if self.platform == "cuda":
            config = (TARGET_CONFIGS / "h100_sxm.txtpb").read_text()
            desc = topologies.get_topology_desc(platform="cuda", target_config=config, topology=self.topology)
        else:
            desc = topologies.get_topology_desc(
                platform="tpu", topology_name=self.topology, chip_config_name=self.chip_config,
                chips_per_host_bounds=self.host_bounds, num_slices=1, wrap=(False, False, False),
            )  # fmt: skip
        return list(desc.devices)

    def budget_gib(self, run: TrainConfig) -> float:
        if self.platform == "tpu":
            return self.hbm_gib
        return h100_memory_gib() * run.mesh.memory_fractions(run.rollout.engine)[0]


TARGETS = {
    "h100x8": Target("cuda", "1x1x8"),
    "h100x1": Target("cuda", "1x1x1"),
    "v5p-8": Target("tpu", "v5:2x2x1", "megacore", (2, 2, 1), 95.74),
    "v5p-16": Target("tpu", "v5:2x2x2", "megacore", (2, 2, 1), 95.74),
    "v6e-8": Target("tpu", "v6e:2x4", "default", (2, 4, 1), 31.25),
    "v5e-8": Target("tpu", "v5e:2x4", "default", (2, 4, 1), 15.75),
}


def h100_memory_gib() -> float:
    """``device_memory_size`` of the shipped H100 target config, in GiB."""
    text = (TARGET_CONFIGS / "h100_sxm.txtpb").read_text()
    return int(re.search(r"device_memory_size:\s*(\d+)", text).group(1)) / GIB


@dataclasses.dataclass
class Fit:
    """One program compiled for one target and mesh: the executable's memory per device (GiB), its budget, whether
    it fits; ``shape`` names the decode window with the largest peak; ``error`` is a refusal or failure in one line.
    ``resident_gib``: what the run keeps on the device beside the program's own arguments and counts against the
    same budget, the KL penalty's frozen reference (``loss.kl_coef``) on every program of the learner's devices but
    the log-prob pass, whose arguments hold it."""

    target: str
    program: str
    mesh: str
    attention: str
    argument_gib: float | None = None
    output_gib: float | None = None
    alias_gib: float | None = None
    temp_gib: float | None = None
    peak_gib: float | None = None
    resident_gib: float | None = None
    budget_gib: float = 0.0
    fits: bool = False
    shape: str = ""
    compile_s: float = 0.0
    error: str | None = None

    def record(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def memory_gib(compiled: Any) -> dict[str, float]:
    stats = compiled.memory_analysis()
    sizes = {
        "argument_gib": stats.argument_size_in_bytes, "output_gib": stats.output_size_in_bytes,
        "alias_gib": stats.alias_size_in_bytes, "temp_gib": stats.temp_size_in_bytes,
    }  # fmt: skip
    gib = {k: v / GIB for k, v in sizes.items()}
    gib["peak_gib"] = gib["argument_gib"] + gib["output_gib"] - gib["alias_gib"] + gib["temp_gib"]
    return gib


# libtpu's refusal names what the program needs (arguments, outputs and temporaries, though it says temporaries)
# and the HBM it has: "... the total memory required for HLO temporaries (41.77G) exceeds available HBM (31.25G)."
REFUSAL = re.compile(r"memory required for [^(]*\(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)")


def refusal(error: BaseException) -> tuple[float, float] | None:
    """``(needed, available)`` GiB of a TPU compiler's out-of-memory refusal; None for any other error."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    gib = lambda size, unit: float(size) * 2 ** (10 * "KMGT".index(unit) + 10) / GIB  # binary units
    if found := REFUSAL.search(text):
        return gib(*found.group(1, 2)), gib(*found.group(3, 4))
    return math.nan, math.nan


def compile_fit(fit: Fit, built: Built) -> None:
    """Compile ``built`` and read its memory; of a decode step's windows, the largest (the largest cache: the
    largest peak; every window's lowering is the lowering check's). A refusal or failure is the cell's error."""
    label, one = list(built.items())[-1] if isinstance(built, dict) else ("", built)
    fit.shape = label
    try:
        vars(fit).update(memory_gib(one.lower().compile()))
        fit.fits = fit.peak_gib + (fit.resident_gib or 0.0) <= fit.budget_gib
    except Exception as error:  # any refusal is the cell's result, reported as one line
        refused = refusal(error)
        where = f"{label}: " if label else ""
        if refused is None:
            fit.error = where + one_line(error)
        else:
            fit.peak_gib, fit.fits = refused[0], False
            fit.error = where + f"refused by the compiler: needs {refused[0]:.2f} GiB of {refused[1]:.2f}"


def run_programs(run: TrainConfig) -> list[str]:
    """The programs a run of ``run`` compiles: the update on its layout, the log-prob pass and the sampler; the
    scaffold's adapter-on passes and SFT step when it is on; L2RR's two when it is on."""
    names = ["rl_packed" if run.loss.packing else "rl_padded", "logprobs_base", "prefill", "decode"]
    if run.scaffold.enabled:
        names += ["sft", "logprobs_adapter", "prefill_adapter", "decode_adapter"]
    if run.l2rr.enabled:
        names += ["l2rr_target", "l2rr_jvp"]
    return [name for name in PROGRAMS if name in names]


def target_meshes(devices: int) -> list[str]:
    """The meshes of ``COMPILE_MESHES`` that span ``devices`` devices."""
    return [name for name, sizes in COMPILE_MESHES.items() if math.prod(sizes) == devices]


# With the sampling on devices of its own (``rollout.placement: split``) the step's rollouts are sampled there, base
# alone; the adapter's programs (its SFT, the re-rolls with it on) and everything else stay on the learner's.
SAMPLER_SIDE = ("prefill", "decode")
SPLIT = re.compile(r"(\d+)\+(\d+)")


def parse_splits(text: str | None) -> list[tuple[int, int]] | None:
    """``--splits 4+4,2+6`` as ``[(4, 4), (2, 6)]`` (learner devices + sampler devices); a ``ConfigError`` naming a
    piece that is not two positive counts."""
    if text is None:
        return None
    pieces = [(piece, SPLIT.fullmatch(piece.strip())) for piece in text.split(",")]
    bad = [piece for piece, found in pieces if not found or 0 in map(int, found.groups())]
    if bad:
        raise ConfigError(f"--splits {bad[0]!r}: write LEARNER+SAMPLER device counts, e.g. 4+4,2+6")
    return [(int(found[1]), int(found[2])) for _, found in pieces]


def layouts(devices: list[Any], meshes: Iterable[str] | None, splits: list[tuple[int, int]] | None):
    """``(label, mesh of a program's name)`` per layout to compile on: each of ``COMPILE_MESHES`` (``meshes``: these)
    that spans the devices, every program on it; or each split of ``splits`` that adds up to the devices, the
    learner's programs on a mesh of the first devices (fsdp) and ``SAMPLER_SIDE``'s on a mesh of the rest."""
    if splits is None:
        for name in [m for m in (meshes or COMPILE_MESHES) if m in target_meshes(len(devices))]:
            mesh = sharding.make_mesh(sharding.MeshConfig(*COMPILE_MESHES[name]), devices)
            yield name, lambda program, mesh=mesh: mesh
        return
    for learner, sampler in [(a, b) for a, b in splits if a + b == len(devices)]:
        learn = sharding.make_mesh(sharding.MeshConfig(1, learner, 1), devices[:learner])
        sample = sharding.make_mesh(sharding.MeshConfig(1, sampler, 1), devices[learner:])
        yield f"{learner}+{sampler}", lambda program, a=learn, b=sample: b if program in SAMPLER_SIDE else a


def compile_check(
    shape: Shape, targets: Iterable[str], programs: Iterable[str] | None = None, meshes: Iterable[str] | None = None,
    splits: list[tuple[int, int]] | None = None,
) -> Iterator[Fit]:  # fmt: skip
    """Every program a run compiles (``programs``: these), compiled for each target on each of its meshes
    (``meshes``: these, where they span its devices) or, with ``splits``, on each split of its devices between
    learner and sampler (``layouts``; the mesh column says the split and the side), at the run's own attention, as
    each is done."""
    model_cfg = dataclasses.replace(
        shape.model, attention=shape.run.model.attention, decode_attention=shape.run.model.decode_attention
    )
    attention = lambda name: model_cfg.decode_attention if name in SAMPLER_PROGRAMS else model_cfg.attention
    for target_name in targets:
        target = TARGETS[target_name]
        try:
            devices = target.devices()
        except Exception as error:  # the target's compiler would not start: every cell of it says why
            for name in programs or run_programs(shape.run):
                yield Fit(target_name, name, "-", attention(name), error=f"no {target_name} devices: {one_line(error)}")
            continue
        budget = target.budget_gib(shape.run)
        if splits is not None and not any(a + b == len(devices) for a, b in splits):
            given = ",".join(f"{a}+{b}" for a, b in splits)
            yield Fit(target_name, "-", "-", "-", error=f"--splits {given}: none adds up to its {len(devices)} devices")
            continue
        for label, mesh_of in layouts(devices, meshes, splits):
            for name in programs or run_programs(shape.run):
                mesh = mesh_of(name)
                side = "" if splits is None else (" sample" if name in SAMPLER_SIDE else " learn")
                fit = Fit(target_name, name, label + side, attention(name), budget_gib=budget)
                if shape.run.loss.kl_coef and name != "logprobs_base" and side != " sample":
                    fit.resident_gib = resident_gib(reference_params(model_cfg, mesh_of("logprobs_base")))
                start = time.perf_counter()
                try:
                    built = PROGRAMS[name](shape, model_cfg, mesh)
                except Exception as error:  # a refusal while tracing is the cell's result
                    fit.error = one_line(error)
                else:
                    compile_fit(fit, built)
                fit.compile_s = time.perf_counter() - start
                yield fit


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


FIT_HEADER = (
    f"{'target':<7} {'program':<17} {'mesh':<10} {'attention':<9} {'args':>6} {'out':>6} {'alias':>6} {'temp':>6} "
    f"{'peak':>6} {'budget':>6} {'s':>5}  GiB per device"
)


def fit_row(fit: Fit) -> str:
    gib = lambda x: f"{x:6.1f}" if x is not None else f"{'-':>6}"
    sizes = " ".join(gib(getattr(fit, k)) for k in ("argument_gib", "output_gib", "alias_gib", "temp_gib", "peak_gib"))
    verdict = "fits" if fit.fits else ("DOES NOT FIT" if fit.error is None else f"FAILED: {fit.error}")
    if fit.error and "refused by the compiler" in fit.error:
        verdict = f"DOES NOT FIT: {fit.error}"
    # Counted in the verdict, not in the peak column (the compiler's figure for the program).
    resident = f" (peak + {fit.resident_gib:.2f} reference resident)" if fit.resident_gib else ""
    return (
        f"{fit.target:<7} {fit.program:<17} {fit.mesh:<10} {fit.attention:<9} {sizes} {gib(fit.budget_gib)} "
        f"{fit.compile_s:5.0f}  {verdict}{f' ({fit.shape})' if fit.shape else ''}{resident}"
    )


def summary(cells: list[Cell], seconds: float) -> str:
    counts = {s: sum(c.status == s for c in cells) for s in ("lowered", "skipped", "failed")}
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kilobytes on Linux
    return (
        f"{len(cells)} cells: {counts['lowered']} lowered, {counts['skipped']} skipped, {counts['failed']} failed "
        f"in {seconds:.0f} s (peak resident memory {peak_gb:.1f} GB)"
    )


def main(argv: list[str] | None = None) -> int:
    return run_main("lower_check", _check, argv)


def _check(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="a tiny model and short rows (SMALL_OVERRIDES)")
    parser.add_argument("--config", default=str(RECIPE), help="the run's YAML (default: the paper's recipe)")
    parser.add_argument("--compile", default=None, help=f"compile for these targets (comma-separated, {list(TARGETS)})")
    parser.add_argument("--programs", default=None, help=f"comma-separated, from {list(PROGRAMS)}")
    parser.add_argument("--meshes", default=None, help=f"comma-separated, from {list(COMPILE_MESHES)}")
    parser.add_argument("--splits", default=None, help="with --compile: learner+sampler device counts (rollout."
                        "placement split), comma-separated, e.g. 4+4,2+6, instead of the meshes")  # fmt: skip
    parser.add_argument("--platforms", default=",".join(PLATFORMS), help="comma-separated: cuda, tpu")
    parser.add_argument("--attention", default=None, help="only these implementations (comma-separated)")
    parser.add_argument("--json", default=None, help="also write the cells to this JSON file")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the config, as lspo-train takes")
    args = parser.parse_args(argv)
    split = lambda text: None if text is None else text.split(",")
    unknown = [t for t in split(args.compile) or () if t not in TARGETS]
    if unknown:
        raise ConfigError(f"unknown target(s) {unknown}; choose from {list(TARGETS)}")
    if args.splits is not None and (not args.compile or args.meshes):
        raise ConfigError("--splits is a layout of --compile's targets, in place of --meshes: give it with --compile "
                          "and without --meshes")  # fmt: skip
    if args.compile:
        use_chip_compilers()
    shape = (small_shape if args.small else paper_shape)(args.config, args.overrides)
    print(f"jax {jax.__version__}; {specs.count_params(specs.abstract_params(shape.model)['base']):,} base params")
    if args.compile:
        splits = parse_splits(args.splits)
        return compile_main(shape, split(args.compile), split(args.programs), split(args.meshes), args.json, splits)
    print(HEADER, flush=True)
    start, cells = time.perf_counter(), []
    programs, meshes = split(args.programs) or list(PROGRAMS), split(args.meshes) or list(MESHES)
    for cell in check(shape, programs, meshes, split(args.platforms), split(args.attention)):
        cells.append(cell)
        print(row(cell), flush=True)
    print(summary(cells, time.perf_counter() - start))
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(c) for c in cells], indent=1) + "\n")
    return int(any(c.status == "failed" for c in cells))


def use_chip_compilers() -> None:
    """Make the chips' compilers visible to JAX, whose backends are still to start: ``CHIPS`` on the path when it
    exists, the CPU as JAX's own platform (the plugins are for compiling, not running). What is missing is a
    ``ConfigError`` naming ``--compile`` and how to install it, with JAX's platform left as it was."""
    import jaxlib

    if jaxlib.__version__ != COMPILE_JAXLIB:
        what = "libtpu, the CUDA plugin and the H100 target config"
        raise ConfigError(f"--compile is set up for jaxlib {COMPILE_JAXLIB} ({what}); this is jaxlib "
                          f"{jaxlib.__version__}")  # fmt: skip
    if CHIPS.is_dir() and str(CHIPS) not in sys.path:
        sys.path.append(str(CHIPS))
    missing = [name for name in ("libtpu", "jax_plugins.xla_cuda12") if not _importable(name)]
    if missing:
        raise ConfigError(f"--compile needs {missing}: bash tools/setup.sh test installs them into {CHIPS}")
    jax.config.update("jax_platforms", "cpu")


def _importable(name: str) -> bool:
    """Whether module ``name`` can be imported; ``find_spec`` raises for a dotted name whose parent is absent
    (``jax_plugins`` without any plugin installed)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def compile_main(
    shape: Shape, targets: list[str], programs: list[str] | None, meshes: list[str] | None, out: str | None,
    splits: list[tuple[int, int]] | None = None,
) -> int:  # fmt: skip
    """Print a line per compiled cell and a summary; exit status 1 when a cell fails to compile or does not fit."""
    print(FIT_HEADER, flush=True)
    start, fits = time.perf_counter(), []
    for fit in compile_check(shape, targets, programs, meshes, splits):
        fits.append(fit)
        print(fit_row(fit), flush=True)
        if out:  # written as each cell is done: a long check interrupted keeps what it found
            Path(out).write_text(json.dumps([f.record() for f in fits], indent=1) + "\n")
    fitting, seconds = sum(f.fits for f in fits), time.perf_counter() - start
    print(f"{len(fits)} cells: {fitting} fit, {len(fits) - fitting} do not fit or failed, in {seconds:.0f} s")
    return int(fitting < len(fits))


if __name__ == "__main__":
    raise SystemExit(main())
