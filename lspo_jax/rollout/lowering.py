"""The sampler's programs for abstract inputs: what a ``sampler.generate`` call compiles, traced without allocating
anything, to be lowered or compiled for any platform (``.lower(lowering_platforms=(...))``). How programs too big
to run here are checked (``tools/lower_check.py``); a run never imports it. Beside the sampler, whose programs
(``programs``) and weight layouts (``sampler_weights``) it traces exactly as a call runs them.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from lspo_jax.config import ModelConfig
from lspo_jax.models import sharding
from lspo_jax.models.specs import Params, abstract_params
from lspo_jax.rollout.buckets import pow2_bucket
from lspo_jax.rollout.kv_cache import grow_cache
from lspo_jax.rollout.programs import State, decode_segment, eos_array, prefill
from lspo_jax.rollout.sampler import DEFAULT_CACHE_WINDOW, MIN_PROMPT_BUCKET, window_ends
from lspo_jax.rollout.sampler_weights import layer_shardings, unstack_weights
from lspo_jax.rollout.sampling import SamplingOptions


def trace_call(
    config: ModelConfig,
    *,
    prompts: int,
    prompt_tokens: int,
    max_new_tokens: int,
    n: int = 1,
    adapter: bool = False,
    options: SamplingOptions = SamplingOptions(),
    cache_window: int = DEFAULT_CACHE_WINDOW,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    decode: bool = True,
) -> dict[str, jax.stages.Traced]:
    """The programs a call of ``prompts`` prompts of up to ``prompt_tokens`` tokens compiles, traced for abstract
    inputs (nothing is allocated) on ``mesh`` (an abstract one will do): ``"prefill"``, and ``"decode S"`` for the
    decode segment of each cache window (S cache slots), from the prefill's state grown as the call grows it
    (``decode=False``: the prefill alone). Bucketed as a call buckets them; ``adapter``: the adapter on (a traced
    scale). Each lowers for any platform (``.lower(lowering_platforms=(...))``): how programs too big to run here
    are checked (``tools/lower_check.py``).
    """
    mesh = sharding.mesh_or_local(mesh)
    rows, slots = pow2_bucket(prompts), pow2_bucket(prompt_tokens, MIN_PROMPT_BUCKET)
    ends = window_ends(max_new_tokens, cache_window)
    params = _abstract_weights(config, mesh, adapter)
    spec, scalar = jax.ShapeDtypeStruct, jax.ShapeDtypeStruct((), jnp.float32)
    key, eos = jax.eval_shape(jax.random.key, 0), spec(eos_array(()).shape, jnp.int32)
    # As ``_Call.prefill`` passes them: host prompts, mask, live rows and limits, then the key and the scalars.
    prompt_BP = spec((rows, slots), jnp.int32)
    inputs = (prompt_BP, prompt_BP, spec((rows,), bool), spec((rows,), jnp.int32))
    static = dict(options=options, n=n, window=ends[0], total_new=ends[-1])
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        traced = {"prefill": prefill.trace(config, params, *inputs, key, scalar, scalar, eos, **static)}
        first = traced["prefill"].out_info
        for end in ends if decode else ():
            grown = first._replace(cache=jax.eval_shape(functools.partial(grow_cache, length=slots + end), first.cache))
            state = _place(grown, _state_shardings(config, mesh, grown))
            args = (key, scalar, scalar, eos, spec((), jnp.int32))
            traced[f"decode {slots + end}"] = decode_segment.trace(config, params, state, *args, options=options)
    return traced


def _abstract_weights(config: ModelConfig, mesh: jax.sharding.Mesh, adapter: bool) -> Params:
    """The weights the programs read (``sampler_weights.decode_weights``) as abstract arrays: the compute dtype,
    split per layer, laid out over ``tp`` only; the adapter's too when ``adapter``."""
    dtype = jnp.dtype(config.compute_dtype)
    keys = ("base", *(("policy",) if config.policy_lora else ()), *(("lora",) if adapter else ()))
    cast = {k: jax.tree.map(lambda a: a.update(dtype=dtype), abstract_params(config)[k]) for k in keys}
    tree = jax.eval_shape(functools.partial(unstack_weights, config), cast)
    stacked = sharding.param_shardings(config, mesh, gather_fsdp=True)
    shardings = {"base": {**stacked["base"], "layers": layer_shardings(stacked["base"]["layers"], config.num_layers)}}
    for key in keys[1:]:  # the policy adapter (LoRA RL) and the scaffold's, split per layer as the weights
        shardings[key] = layer_shardings(stacked[key], config.num_layers)
    return _place(tree, shardings)


def _place(tree: Any, shardings: Any) -> Any:
    """Abstract arrays of ``tree``'s shapes and dtypes laid out by ``shardings``."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def _state_shardings(config: ModelConfig, mesh: jax.sharding.Mesh, state: State) -> State:
    """Rows over the data axes, scalars replicated, the cache as ``sharding.kv_cache_sharding``."""
    rows = state.token_C.shape[0]
    by_rows, whole = sharding.batch_sharding(mesh, rows), sharding.replicated(mesh)
    cache = sharding.kv_cache_sharding(config, mesh, rows)
    return jax.tree.map(lambda a: by_rows if a.ndim else whole, state)._replace(
        cache=jax.tree.map(lambda _: cache, state.cache)
    )
