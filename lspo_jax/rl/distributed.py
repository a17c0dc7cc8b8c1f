"""The compiled programs of a run: the update steps and the log-prob pass, jitted for a device mesh.

Every program runs on a mesh: a run on one device uses ``sharding.local_mesh()`` (1 x 1 x 1), so there is one
program per pass whatever the device count. Each builder returns a function of arrays only (the config bound),
built once per argument set (cached: a second run in the same process reuses the compiled programs):

    rl  = sharded_rl_step(config, mesh, rl=..., spec=..., num_micro_batches=...)   # (params, opt_state, batch)
          (``skip_nonfinite=True``: ``optim.keep_if_finite``, as the training loop runs it)
    mix = sharded_mixed_rl_step(config, mesh, ...)                                  # the RL batch + an SFT term
    sft = sharded_sft_step(config, mesh, sft=...)                                   # (params, opt_state, batch)
    lp  = sharded_logprobs(config, mesh, lora_scale=0.0, spec=...)                  # (params, rows)
          (``reference=True``: the frozen reference's log-probs too, ``params["ref"]``, for a KL penalty)

``spec`` is the run's ``losses.LossSpec`` (clip, temperature, LM-head chunk, regularizers), one for all of them.

Params and optimizer state are split as ``sharding.param_shardings`` / ``opt_state_shardings`` say (FSDP over
``fsdp``, tensor parallel over ``tp``) and donated, so a step updates them in place; batch rows are split over
``data`` and ``fsdp`` (the row count must divide by their product). Arrays already on the mesh in these
layouts pass through untouched; host arrays are placed on the way in. On several devices the numbers equal
one device's up to the order of floating-point sums. A method's own programs are built alike (``in_mesh``), on
the mesh of the params they are given (``mesh_of``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding

from lspo_jax.config import ModelConfig
from lspo_jax.models import sharding
from lspo_jax.models.specs import Params
from lspo_jax.rl import logprobs, losses, optim
from lspo_jax.rl.optim import RLOptimConfig, SFTOptimConfig

_RL, _SFT, _LOSS = RLOptimConfig(), SFTOptimConfig(), losses.LossSpec()


def step_shardings(
    config: ModelConfig, mesh: Mesh, tx: optax.GradientTransformation
) -> tuple[Params, optax.OptState, jax.sharding.NamedSharding]:
    """``(params, optimizer state, batch)`` shardings of an update step of ``tx`` on ``mesh``."""
    return (
        sharding.param_shardings(config, mesh),
        sharding.opt_state_shardings(config, mesh, tx),
        sharding.batch_sharding(mesh),
    )


def mesh_of(tree: Any) -> Mesh:
    """The mesh ``tree``'s arrays are laid out on (their ``NamedSharding``'s), or the 1 x 1 x 1 mesh of the one device
    they are on: a program built for it takes them as they are. Host arrays give ``sharding.local_mesh()``."""
    placed = getattr(jax.tree.leaves(tree)[0], "sharding", None)
    if isinstance(placed, NamedSharding):
        return placed.mesh
    if placed is None:
        return sharding.local_mesh()
    if len(placed.device_set) != 1:
        raise ValueError(f"arrays laid out by {placed} are on no mesh: lay them out with a NamedSharding")
    return sharding.make_mesh(sharding.MeshConfig(1, 1, 1), list(placed.device_set))


def in_mesh(mesh: Mesh, fn: Callable) -> Callable:
    """``fn`` traced with ``mesh`` as the context mesh, so the model's ``axes.constrain`` calls apply."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return traced


def jit_step(
    config: ModelConfig, mesh: Mesh, tx: optax.GradientTransformation, step: Callable, batch_sh: Any = None
) -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, metrics)`` jitted on ``mesh`` with donation; the batch
    laid out by ``batch_sh`` (a sharding or a pytree prefix of them; None: its rows split as every pass's)."""
    params_sh, state_sh, rows_sh = step_shardings(config, mesh, tx)
    batch_sh = rows_sh if batch_sh is None else batch_sh
    if optim.POLICY in params_sh:
        return _frozen_base_step(mesh, step, params_sh, state_sh, batch_sh)
    return jax.jit(
        in_mesh(mesh, step),
        in_shardings=(params_sh, state_sh, batch_sh),
        out_shardings=(params_sh, state_sh, sharding.replicated(mesh)),
        donate_argnums=(0, 1),
    )


def _frozen_base_step(mesh: Mesh, step: Callable, params_sh: Params, state_sh: Any, batch_sh: Any) -> Callable:
    """``jit_step`` of LoRA RL, whose base is frozen: the base is an argument of the program, neither donated nor
    returned, and the step hands back the very arrays it was given. A program that donated and returned it would
    give new array objects of the same bytes every step, and whatever keys on the arrays' identity (the vLLM sync,
    which pushes only what changed) would take the base for changed."""

    def split_step(base: Params, rest: Params, opt_state: Any, batch: Any):
        params, opt_state, metrics = step({optim.BASE: base, **rest}, opt_state, batch)
        return {k: v for k, v in params.items() if k != optim.BASE}, opt_state, metrics

    rest_sh = {k: v for k, v in params_sh.items() if k != optim.BASE}
    jitted = jax.jit(
        in_mesh(mesh, split_step),
        in_shardings=(params_sh[optim.BASE], rest_sh, state_sh, batch_sh),
        out_shardings=(rest_sh, state_sh, sharding.replicated(mesh)),
        donate_argnums=(1, 2),
    )
    split = lambda params: (params[optim.BASE], {k: params[k] for k in rest_sh})

    def run(params: Params, opt_state: Any, batch: Any):
        rest, opt_state, metrics = jitted(*split(params), opt_state, batch)
        return {optim.BASE: params[optim.BASE], **rest}, opt_state, metrics

    run.trace = lambda params, opt_state, batch: jitted.trace(*split(params), opt_state, batch)
    run.lower = lambda params, opt_state, batch: jitted.lower(*split(params), opt_state, batch)
    return run


@functools.cache
def sharded_rl_step(
    config: ModelConfig,
    mesh: Mesh,
    *,
    rl: RLOptimConfig = _RL,
    sft: SFTOptimConfig = _SFT,
    spec: losses.LossSpec = _LOSS,
    num_micro_batches: int = 1,
    skip_nonfinite: bool = False,
) -> Callable:
    """``optim.rl_step`` on ``mesh``: ``(params, opt_state, batch) -> (params, opt_state, metrics)``.

    ``rl`` and ``sft`` must be the configs of the optimizer (``optim.make_optimizer(rl, sft)``) whose state
    is passed in: they fix the state's structure, hence its layout. ``skip_nonfinite`` wraps the step in
    ``optim.keep_if_finite``.
    """
    step = functools.partial(optim.rl_step, config, rl=rl, spec=spec, num_micro_batches=num_micro_batches)
    if skip_nonfinite:
        step = optim.keep_if_finite(step, subtree=optim.rl_subtree(rl))
    return jit_step(config, mesh, optim.make_optimizer(rl, sft), step)


@functools.cache
def sharded_mixed_rl_step(
    config: ModelConfig,
    mesh: Mesh,
    *,
    rl: RLOptimConfig = _RL,
    sft: SFTOptimConfig = _SFT,
    spec: losses.LossSpec = _LOSS,
    num_micro_batches: int = 1,
    sft_micro_batches: int = 1,
    token_weight: str | Callable = "none",
) -> Callable:
    """``optim.mixed_rl_step`` on ``mesh``, non-finite updates skipped whole: ``(params, opt_state, {"rl": rows,
    "sft": rows, "mu": scalar}) -> (params, opt_state, metrics)``, both batches' rows split as every pass's and mu
    replicated (a traced value: one program for every mu of the schedule). ``rl`` and ``sft`` as in
    ``sharded_rl_step``."""
    step = functools.partial(
        optim.mixed_rl_step, config, rl=rl, spec=spec, num_micro_batches=num_micro_batches,
        sft_micro_batches=sft_micro_batches, token_weight=token_weight,
    )  # fmt: skip
    rows_sh = sharding.batch_sharding(mesh)
    batch_sh = {"rl": rows_sh, "sft": rows_sh, "mu": sharding.replicated(mesh)}
    return jit_step(config, mesh, optim.make_optimizer(rl, sft), optim.keep_if_finite(step), batch_sh)


@functools.cache
def sharded_rl_grad_norm(
    config: ModelConfig, mesh: Mesh, *, spec: losses.LossSpec = _LOSS, num_micro_batches: int = 1
) -> Callable:
    """The norm of ``optim.rl_gradients`` on ``mesh``: ``(params, batch) -> ||grad||``, nothing updated (a
    diagnostic: the part of the update's gradient that some rows carry)."""
    params_sh, batch_sh = sharding.param_shardings(config, mesh), sharding.batch_sharding(mesh)
    keys = optim.policy_keys(params_sh)  # the base, and LoRA RL's policy adapter (then the one differentiated)

    def norm(policy: Params, batch: dict[str, jax.Array]) -> jax.Array:
        frozen = {optim.BASE: policy[optim.BASE]} if optim.POLICY in policy else None
        grads = optim.rl_gradients(
            config, policy[keys[-1]], batch, spec=spec, num_micro_batches=num_micro_batches, frozen=frozen
        )[1]
        return optax.tree.norm(grads)

    jitted = jax.jit(in_mesh(mesh, norm), in_shardings=({k: params_sh[k] for k in keys}, batch_sh))
    return lambda params, batch: jitted({k: params[k] for k in keys}, batch)


@functools.cache
def sharded_sft_step(
    config: ModelConfig,
    mesh: Mesh,
    *,
    rl: RLOptimConfig = _RL,
    sft: SFTOptimConfig = _SFT,
    num_micro_batches: int = 1,
    chunk_size: int | None = None,
) -> Callable:
    """``optim.sft_step`` on ``mesh``: ``(params, opt_state, batch) -> (params, opt_state, metrics)``."""
    step = functools.partial(
        optim.sft_step, config, sft=sft, num_micro_batches=num_micro_batches, chunk_size=chunk_size
    )
    return jit_step(config, mesh, optim.make_optimizer(rl, sft), step)


@functools.cache
def sharded_base_sft_step(
    config: ModelConfig,
    mesh: Mesh,
    *,
    rl: RLOptimConfig = _RL,
    sft: SFTOptimConfig = _SFT,
    num_micro_batches: int = 1,
    chunk_size: int | None = None,
) -> tuple[Callable, Callable]:
    """``optim.base_sft_step`` on ``mesh`` and the program that makes its fresh state from the params:
    ``(init(params), step(params, opt_state, batch) -> (params, opt_state, metrics))``."""
    tx = optim.direct_optimizer(rl, sft)
    params_sh, state_sh, _ = step_shardings(config, mesh, tx)
    init = jax.jit(tx.init, in_shardings=(params_sh,), out_shardings=state_sh)
    step = functools.partial(
        optim.base_sft_step, config, rl=rl, num_micro_batches=num_micro_batches, chunk_size=chunk_size
    )
    # One non-finite SFT step would poison the base the run keeps: skipped whole, as a non-finite RL update is.
    return init, jit_step(config, mesh, tx, optim.keep_if_finite(step, "sft_loss", "sft_grad_norm"))


@functools.cache
def sharded_logprobs(
    config: ModelConfig,
    mesh: Mesh,
    *,
    lora_scale: float = 0.0,
    spec: losses.LossSpec = _LOSS,
    num_micro_batches: int = 1,
    reference: bool = False,
) -> Callable:
    """``logprobs.sequence_logprobs`` on ``mesh``: ``(params, rows) -> logp [B, T]``, at ``spec``'s temperature and
    LM-head chunk.

    ``rows``: ``tokens`` and a layout (``logprobs.layout``: ``attention_mask``, or packed rows' ``segment_ids``
    and ``positions``), each ``[B, T]``. ``num_micro_batches`` runs the rows in that many groups, one after
    another (as the RL step does), so a whole rollout batch of long rows does not hold every row's activations at
    once. A Python ``lora_scale`` of 0 runs the policy alone (the scaffold's adapter subtree is not even passed in;
    LoRA RL's policy adapter is part of the policy, always on).

    ``reference`` (with ``lora_scale`` 0): ``params`` also holds ``ref``, a frozen reference laid out as the base (in
    its dtype or bfloat16), and the program returns ``(logp, ref_logp)``: the reference's log-probs of the same rows
    in the same layout, micro-batches and temperature, the second pass after the first, one program with both sets
    of weights as its arguments (the memory a KL penalty's pass needs).
    """
    if reference and lora_scale != 0:
        raise ValueError(f"a reference pass runs beside the base's, adapter off; got lora_scale={lora_scale}")
    params_sh = sharding.param_shardings(config, mesh)
    # The policy (the base, and LoRA RL's policy adapter, always on), and the scaffold's adapter when switched on.
    policy = optim.policy_keys(params_sh)
    keys = policy if lora_scale == 0 else (*policy, "lora")
    params_sh = {**params_sh, "ref": params_sh["base"]}
    keys = (*keys, "ref") if reference else keys
    batch_sh = sharding.batch_sharding(mesh)

    def one_pass(params: Params, rows: dict[str, jax.Array]) -> jax.Array:
        return logprobs.grouped_logprobs(
            config, params, rows, lora_scale=lora_scale, **spec.reading, num_micro_batches=num_micro_batches,
        )  # fmt: skip

    def logprob_pass(params: Params, rows: dict[str, jax.Array]) -> jax.Array | tuple[jax.Array, jax.Array]:
        if not reference:
            return one_pass(params, rows)
        return one_pass({k: params[k] for k in policy}, rows), one_pass({"base": params["ref"]}, rows)

    jitted = jax.jit(
        in_mesh(mesh, logprob_pass), in_shardings=({k: params_sh[k] for k in keys}, batch_sh), out_shardings=batch_sh
    )
    select = lambda params, rows: ({k: params[k] for k in keys}, {"tokens": rows["tokens"], **logprobs.layout(rows)})

    def run(params: Params, rows: dict[str, jax.Array]) -> jax.Array:
        return jitted(*select(params, rows))

    # Abstract inputs (ShapeDtypeStructs) give the program without running it: ``lower`` for memory plans, ``trace``
    # for a lowering for another platform (``.lower(lowering_platforms=...)``, ``tools/lower_check.py``).
    run.lower = lambda params, rows: jitted.lower(*select(params, rows))
    run.trace = lambda params, rows: jitted.trace(*select(params, rows))
    return run
