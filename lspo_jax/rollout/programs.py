"""The sampler's jitted programs and the loop state they carry (letters as in ``sampler``): the prefill that runs the
prompts once and samples token 0, the decode segment (a ``lax.while_loop`` over steps, its state donated), and the
moves between segments: the rows written to the output arrays (``flush``) and the live ones gathered into a smaller
bucket (``take_rows``). ``TRACE_COUNTS`` counts their traces, i.e. compilations, per program kind."""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lspo_jax.config import ModelConfig
from lspo_jax.models.attention import attention_positions, causal_padding_mask
from lspo_jax.models.model import decoder, embed, lm_logits
from lspo_jax.models.specs import Params
from lspo_jax.rollout.kv_cache import constrain as constrain_cache
from lspo_jax.rollout.kv_cache import grow_cache, init_cache, repeat_rows
from lspo_jax.rollout.samples import PAD_ID
from lspo_jax.rollout.sampling import SamplingOptions, sample_token

# Incremented inside the traced functions, so it counts traces (= compilations) per program kind.
TRACE_COUNTS: collections.Counter[str] = collections.Counter()


class State(NamedTuple):
    """Loop state carried through the decode segments (all of it donated to each segment)."""

    cache: Params  # per layer {"k", "v"}: [C, K, P + window, E]
    step: jax.Array  # number of tokens sampled so far (the next column of tokens_CN)
    row_C: jax.Array  # each row's index in the call's output (its randomness follows it; see ``_sample``)
    limit_C: jax.Array  # each row's max_new_tokens
    token_C: jax.Array  # last sampled token, the next decoder input
    done_C: jax.Array
    eos_C: jax.Array
    length_C: jax.Array
    tokens_CN: jax.Array
    logp_CN: jax.Array
    prompt_len_C: jax.Array
    prompt_valid_CP: jax.Array


def _sample(options: SamplingOptions, logits_CV, key, row_C, step, temperature):
    # Row c's key at step i is fold_in(fold_in(key, c), i): the same whatever the segment layout and whichever
    # rows share the batch, so moving rows between batch buckets changes no sample.
    keys_C = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(key, r), step))(row_C)
    return sample_token(logits_CV, keys_C, temperature, options.top_k, options.top_p, options.greedy)


def eos_array(eos_token_ids: Sequence[int]) -> np.ndarray:
    # Traced, padded with -1 (never a token) to a multiple of 8: changing the EOS set recompiles nothing.
    ids = [int(t) for t in eos_token_ids]
    size = max(8, 8 * -(-len(ids) // 8))
    return np.asarray(ids + [-1] * (size - len(ids)), np.int32)


def _record(state: State, token_C: jax.Array, logp_C: jax.Array, eos_E: jax.Array) -> State:
    """Write this step's token and log-prob; rows already done write PAD_ID and 0 and stay done."""
    live_C = ~state.done_C
    token_C = jnp.where(live_C, token_C, PAD_ID)
    logp_C = jnp.where(live_C, logp_C, 0.0)
    hit_C = live_C & jnp.any(token_C[:, None] == eos_E, axis=-1)
    length_C = state.length_C + live_C.astype(jnp.int32)
    column = (0, state.step)
    return state._replace(
        step=state.step + 1,
        token_C=token_C,
        done_C=state.done_C | hit_C | (length_C >= state.limit_C),
        eos_C=state.eos_C | hit_C,
        length_C=length_C,
        tokens_CN=jax.lax.dynamic_update_slice(state.tokens_CN, token_C[:, None], column),
        logp_CN=jax.lax.dynamic_update_slice(state.logp_CN, logp_C[:, None], column),
    )


@functools.partial(jax.jit, static_argnames=("config", "options", "n", "window", "total_new"))
def prefill(
    config: ModelConfig,
    params: Params,
    tokens_BP: jax.Array,
    mask_BP: jax.Array,
    live_B: jax.Array,
    limit_B: jax.Array,
    key: jax.Array,
    temperature: jax.Array,
    lora_scale: jax.Array,
    eos_E: jax.Array,
    *,
    options: SamplingOptions,
    n: int,
    window: int,
    total_new: int,
) -> State:
    """Run the prompts once, repeat the result n times, sample token 0: the initial loop state."""
    TRACE_COUNTS["prefill"] += 1
    b, p = tokens_BP.shape
    with jax.named_scope("prefill"):
        x_BPD = embed(config, params, tokens_BP)
        h_BPD, cache = decoder(
            config,
            params,
            x_BPD,
            attention_positions(mask_BP),
            causal_padding_mask(mask_BP),
            lora_scale=lora_scale,
            kv_cache=init_cache(config, b, p),
            cache_index=0,
        )
        # Left padding puts every row's last prompt token in the last column: one row of logits each.
        logits_BV = lm_logits(config, params, h_BPD[:, -1])
    with jax.named_scope("repeat"):
        c = b * n
        valid_CP = jnp.repeat(mask_BP.astype(bool), n, axis=0)
        state = State(
            cache=grow_cache(repeat_rows(cache, n), p + window),
            step=jnp.zeros((), jnp.int32),
            row_C=jnp.arange(c, dtype=jnp.int32),
            limit_C=jnp.repeat(limit_B, n, axis=0),
            token_C=jnp.zeros((c,), jnp.int32),
            done_C=~jnp.repeat(live_B, n, axis=0),  # padding rows are done from the start
            eos_C=jnp.zeros((c,), bool),
            length_C=jnp.zeros((c,), jnp.int32),
            tokens_CN=jnp.full((c, total_new), PAD_ID, jnp.int32),
            logp_CN=jnp.zeros((c, total_new), jnp.float32),
            prompt_len_C=jnp.sum(valid_CP, axis=-1, dtype=jnp.int32),
            prompt_valid_CP=valid_CP,
        )
        logits_CV = jnp.repeat(logits_BV, n, axis=0)
    token_C, logp_C = _sample(options, logits_CV, key, state.row_C, state.step, temperature)
    return _record(state, token_C, logp_C, eos_E)


@functools.partial(jax.jit, static_argnames=("config", "options"), donate_argnames=("state",))
def decode_segment(
    config: ModelConfig,
    params: Params,
    state: State,
    key: jax.Array,
    temperature: jax.Array,
    lora_scale: jax.Array,
    eos_E: jax.Array,
    stop_step: jax.Array,
    *,
    options: SamplingOptions,
) -> State:
    """Decode until ``state.step == stop_step`` or every row is done (a while loop, no host round trip).

    Step i feeds token i-1 at cache slot P + i - 1 (position prompt_len + i - 1) and samples token i.
    """
    TRACE_COUNTS["decode"] += 1
    p = state.prompt_valid_CP.shape[1]
    s = state.cache[0]["v"].shape[2]
    slots_S = jnp.arange(s)
    prompt_valid_CS = jnp.pad(state.prompt_valid_CP, ((0, 0), (0, s - p)))

    def cond(st: State) -> jax.Array:
        return (st.step < stop_step) & ~jnp.all(st.done_C)

    def body(st: State) -> State:
        slot = p + st.step - 1
        # Visible: the real prompt slots and every generated slot up to and including this one.
        mask_C1S = (prompt_valid_CS | ((slots_S >= p) & (slots_S <= slot)))[:, None, :]
        positions_C1 = (st.prompt_len_C + st.step - 1)[:, None]
        x_C1D = embed(config, params, st.token_C[:, None])
        h_C1D, cache = decoder(
            config, params, x_C1D, positions_C1, mask_C1S, lora_scale=lora_scale, kv_cache=st.cache, cache_index=slot
        )
        logits_CV = lm_logits(config, params, h_C1D[:, 0])
        token_C, logp_C = _sample(options, logits_CV, key, st.row_C, st.step, temperature)
        return _record(st._replace(cache=cache), token_C, logp_C, eos_E)

    with jax.named_scope("decode"):
        return jax.lax.while_loop(cond, body, state)


grow = jax.jit(grow_cache, static_argnames=("length",))


class Out(NamedTuple):
    """The call's results by output row, where compaction leaves the rows that have ended."""

    tokens_CN: jax.Array
    logp_CN: jax.Array
    length_C: jax.Array
    eos_C: jax.Array


def results(state: State) -> Out:
    return Out(state.tokens_CN, state.logp_CN, state.length_C, state.eos_C)


@functools.partial(jax.jit, donate_argnames=("out",))
def flush(out: Out | None, state: State) -> Out:
    """Write every row of ``state`` into ``out`` at its output row (``out`` starts empty at the call's size)."""
    TRACE_COUNTS["flush"] += 1
    if out is None:
        out = jax.tree.map(jnp.zeros_like, results(state))
    return Out(*(o.at[state.row_C].set(x) for o, x in zip(out, results(state), strict=True)))


@jax.jit  # not donated: the result has fewer rows, so no buffer of the state could hold it
def take_rows(state: State, index_R: jax.Array) -> State:
    """The state of rows ``index_R`` only (every per-row array and the cache gathered), the step unchanged."""
    TRACE_COUNTS["compact"] += 1
    taken = jax.tree.map(lambda x: x if x.ndim == 0 else jnp.take(x, index_R, axis=0), state)
    return taken._replace(cache=constrain_cache(taken.cache))
