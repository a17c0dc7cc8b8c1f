"""Batched autoregressive sampling from the Qwen2 model with a static-shape KV cache.

Shape letters (as ``model.py``, plus): B prompt rows (padded), C completion rows (B * n; row b*n + j is
sample j of prompt b), P prompt slots, N new-token slots, S cache slots, V vocabulary.

How a call runs:

* Prompts are left-padded to a bucketed length P, the batch to a bucketed size B; positions come from the
  mask (``cumsum(mask) - 1``), so padding changes no real token's logits.
* One jitted prefill runs the B prompts once, repeats the cache and the last logits n times
  (``jnp.repeat`` on the batch axis: the n samples of a prompt share its prefill) and samples token 0.
* Jitted decode segments each run a ``lax.while_loop`` that feeds the last token through the decoder,
  writing its keys/values into the cache, and samples the next, until every row is done or the
  segment's last step. The loop state, cache included, is donated, so the loop updates it in place.
* A segment ends every ``compact_every`` steps and at each cache window's end. Between segments the host
  reads which rows have ended; when the live rows fit a smaller power-of-two bucket, every row's results go
  to the output arrays (``_flush``) and the live rows, cache included, are gathered into that bucket
  (``_take_rows``), so later steps pay only for them. Row c samples step i with ``fold_in(fold_in(key, c),
  i)`` (``_sample``): moving rows changes no sample.
* Attention during decode reads every cache slot, written or not, so the cache grows in segments
  (windows of generated length ``w, 2w, 4w, ...``) instead of being allocated at full length: a step
  then reads at most about twice the slots it needs and about 1.33 times on average, where a full-length
  cache from the first step reads about twice on average. For long rollouts, where cache reads dominate
  the step, that removes about a third of the decode's memory traffic. Between segments the cache is
  copied into a larger one (once per window).

The programs always run under a device mesh (``generate(..., mesh=mesh)``; by default the first device as a
1 x 1 x 1 mesh) with ``jax.set_mesh``: weights split over ``tp`` only, rows and the KV cache over the data
axes; XLA inserts the collectives.

Every shape is bucketed (powers of two), so a run compiles a bounded number of programs:
per (batch bucket, prompt bucket, new-token bucket, sampling options, adapter on/off) one prefill program, and
one decode program per window and row bucket that the call's live rows pass through. ``rollout.lowering`` traces
a call's programs for abstract inputs, to be lowered or compiled for any platform (``tools/lower_check.py``).

Log-probs are ``log_softmax(logits / temperature)`` at the sampled token, taken BEFORE any top-k/top-p
truncation: the quantity the trainer computes for ``old_logp``. Greedy decoding reports them at the
temperature given too (so greedy with T = 1 reports the model's plain log-probs).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lspo_jax.config import ModelConfig
from lspo_jax.models import sharding
from lspo_jax.models.model import (
    Params,
    attention_positions,
    causal_padding_mask,
    decoder,
    embed,
    lm_logits,
    unstack_layers,
)
from lspo_jax.rollout.buckets import left_pad, pow2_bucket
from lspo_jax.rollout.kv_cache import constrain as constrain_cache
from lspo_jax.rollout.kv_cache import grow_cache, init_cache, repeat_rows

PAD_ID = 0  # what a finished row emits; its log-prob is 0 and it is cut from every returned record
MIN_PROMPT_BUCKET = 16
# First cache window (new tokens): short generations read few empty slots, and a rollout of 8192 tokens
# grows the cache 5 times, so it compiles 6 decode programs per prompt bucket.
DEFAULT_CACHE_WINDOW = 256
# Decode segments end every this many steps: the host then drops the rows that have ended (``_Call._compact``).
DEFAULT_COMPACT_EVERY = 16
# No bucket below this many rows: a step of so few rows costs about the same as of half as many (reading the
# weights dominates), so a smaller bucket would only add compiled programs.
MIN_COMPACT_ROWS = 8

# Incremented inside the traced functions, so it counts traces (= compilations) per program kind.
TRACE_COUNTS: collections.Counter[str] = collections.Counter()


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled continuation: ``tokens`` and ``logprobs`` [length] (EOS included when produced)."""

    prompt_index: int
    tokens: np.ndarray
    logprobs: np.ndarray
    finish_reason: str  # "eos" or "length"


@dataclasses.dataclass(frozen=True)
class SampleBatch:
    """Padded results of one call, rows in prompt order (n consecutive rows per prompt).

    ``tokens``/``logprobs`` are [C, max_new_tokens]; past a row's ``lengths`` they hold ``PAD_ID`` and 0.
    ``steps`` is how many decode steps ran: the longest row's length when every row ended early.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    eos: np.ndarray
    n: int
    steps: int

    def completions(self) -> list[Completion]:
        return [
            Completion(
                prompt_index=row // self.n,
                tokens=self.tokens[row, :length].copy(),
                logprobs=self.logprobs[row, :length].copy(),
                finish_reason="eos" if self.eos[row] else "length",
            )
            for row, length in enumerate(self.lengths.tolist())
        ]


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """The static part of sampling: each distinct value compiles its own programs."""

    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False


@dataclasses.dataclass(frozen=True)
class Decoding:
    """How to sample, as one value: what every engine's call takes besides the params, prompts, key, the number
    of samples per prompt and the adapter's scale (``generate_arrays(..., **decoding.kwargs())``)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eos_token_ids: tuple[int, ...] = ()

    def kwargs(self) -> dict[str, Any]:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


class _State(NamedTuple):
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


# ----------------------------------------------------------------------------------------------- sampling
def sample_token(
    logits_BV: jax.Array,
    key: jax.Array,
    temperature: jax.Array | float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """One token per row and its log-prob ``log_softmax(logits / T)[token]`` (before truncation).

    ``key`` is one key per row (``[B]``) or one for the batch, in which case row b draws with
    ``fold_in(key, b)``: a row's token depends on its own key and logits only, never on the other rows.
    Order as in Hugging Face: temperature, then top-k, then top-p on the renormalised top-k distribution,
    keeping the smallest prefix (by probability) whose mass reaches ``top_p``, the top token always.
    ``top_k``, ``top_p`` and ``greedy`` are Python values: the plain path has no sort at all.
    """
    scaled_BV = logits_BV.astype(jnp.float32) / temperature
    # Sampling is shift-invariant, so the normalised [B, V] log-probs are never materialised: one
    # log-sum-exp per row and one gather give the reported log-prob (fewer full-vocab passes per step).
    if greedy:
        token_B, lse_B = jnp.argmax(logits_BV, axis=-1), jax.nn.logsumexp(scaled_BV, axis=-1)
    else:
        per_row = key.ndim == (1 if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else 2)  # legacy: [2]
        keys_B = key if per_row else jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(scaled_BV.shape[0]))
        u_B2 = jax.vmap(lambda k: jax.random.uniform(k, (2,)))(keys_B)
        if top_k == 0 and top_p >= 1.0:
            token_B, lse_B = _inverse_cdf(scaled_BV, u_B2)
        else:
            token_B, lse_B = _sample_truncated(scaled_BV, u_B2[:, 0], top_k, top_p), jax.nn.logsumexp(scaled_BV, -1)
    token_B = token_B.astype(jnp.int32)
    picked_B = jnp.take_along_axis(scaled_BV, token_B[:, None], axis=-1)[:, 0]
    return token_B, picked_B - lse_B


def _inverse_cdf(scaled_BV: jax.Array, u_B2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """An exact draw from ``softmax(scaled)`` with two uniforms per row, and the row's log-sum-exp.

    The Gumbel-max trick (``jax.random.categorical``) draws one noise value per vocabulary entry: at a 32k
    vocabulary that costs more than the head matmul on a CPU. Here the vocabulary is cut into blocks of about
    sqrt(V) entries: the first uniform picks a block by its mass, the second an entry within it, each by
    inverting a cumulative sum. Two short cumulative sums keep float32 rounding at the scale of one block's
    mass, and the second uniform resolves an entry at 2^-24 of its block's mass, not of the whole vocabulary's.
    """
    b, v = scaled_BV.shape
    width = pow2_bucket(int(np.ceil(np.sqrt(v))))
    blocks = -(-v // width)
    max_B = jnp.max(scaled_BV, axis=-1)
    weight_BV = jnp.exp(scaled_BV - max_B[:, None])
    weight_BGW = jnp.pad(weight_BV, ((0, 0), (0, blocks * width - v))).reshape(b, blocks, width)
    mass_BG = jnp.sum(weight_BGW, axis=-1)
    block_B = _invert(mass_BG, u_B2[:, 0])
    within_BW = jnp.take_along_axis(weight_BGW, block_B[:, None, None], axis=1)[:, 0]
    token_B = block_B * width + _invert(within_BW, u_B2[:, 1])
    return token_B, max_B + jnp.log(jnp.sum(mass_BG, axis=-1))


def _invert(weight_BN: jax.Array, u_B: jax.Array) -> jax.Array:
    """Per row, the first index whose inclusive cumulative weight exceeds ``u * total``.

    An entry of weight 0 is never the first to exceed (its predecessor has the same sum), so padding and
    truncated entries are never picked; rounding that leaves every sum at or below the target is clamped to
    the last entry of positive weight.
    """
    cum_BN = jnp.cumsum(weight_BN, axis=-1)
    index_B = jnp.sum(cum_BN <= (u_B * cum_BN[:, -1])[:, None], axis=-1)
    last_B = weight_BN.shape[-1] - 1 - jnp.argmax(weight_BN[:, ::-1] > 0, axis=-1)
    return jnp.minimum(index_B, last_B)


def _sample_truncated(scaled_BV: jax.Array, u_B: jax.Array, top_k: int, top_p: float) -> jax.Array:
    vocab = scaled_BV.shape[-1]
    k = top_k if 0 < top_k < vocab else vocab
    # top_k returns candidates sorted by probability; with k < V it is a partial selection, not a sort.
    cand_BK, cand_id_BK = jax.lax.top_k(scaled_BV, k)
    weight_BK = jnp.exp(cand_BK - cand_BK[:, :1])
    if top_p < 1.0:
        probs_BK = weight_BK / jnp.sum(weight_BK, axis=-1, keepdims=True)
        mass_before_BK = jnp.cumsum(probs_BK, axis=-1) - probs_BK
        keep_BK = (mass_before_BK < top_p) | (jnp.arange(k) == 0)
        weight_BK = jnp.where(keep_BK, weight_BK, 0.0)
    choice_B = _invert(weight_BK, u_B)
    return jnp.take_along_axis(cand_id_BK, choice_B[:, None], axis=-1)[:, 0]


def _sample(options: SamplingOptions, logits_CV, key, row_C, step, temperature):
    # Row c's key at step i is fold_in(fold_in(key, c), i): the same whatever the segment layout and whichever
    # rows share the batch, so moving rows between batch buckets changes no sample.
    keys_C = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(key, r), step))(row_C)
    return sample_token(logits_CV, keys_C, temperature, options.top_k, options.top_p, options.greedy)


def _eos_array(eos_token_ids: Sequence[int]) -> np.ndarray:
    # Traced, padded with -1 (never a token) to a multiple of 8: changing the EOS set recompiles nothing.
    ids = [int(t) for t in eos_token_ids]
    size = max(8, 8 * -(-len(ids) // 8))
    return np.asarray(ids + [-1] * (size - len(ids)), np.int32)


def _record(state: _State, token_C: jax.Array, logp_C: jax.Array, eos_E: jax.Array) -> _State:
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


# ------------------------------------------------------------------------------------------ jitted parts
@functools.partial(jax.jit, static_argnames=("config", "options", "n", "window", "total_new"))
def _prefill(
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
) -> _State:
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
        state = _State(
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
def _decode_segment(
    config: ModelConfig,
    params: Params,
    state: _State,
    key: jax.Array,
    temperature: jax.Array,
    lora_scale: jax.Array,
    eos_E: jax.Array,
    stop_step: jax.Array,
    *,
    options: SamplingOptions,
) -> _State:
    """Decode until ``state.step == stop_step`` or every row is done (a while loop, no host round trip).

    Step i feeds token i-1 at cache slot P + i - 1 (position prompt_len + i - 1) and samples token i.
    """
    TRACE_COUNTS["decode"] += 1
    p = state.prompt_valid_CP.shape[1]
    s = state.cache[0]["v"].shape[2]
    slots_S = jnp.arange(s)
    prompt_valid_CS = jnp.pad(state.prompt_valid_CP, ((0, 0), (0, s - p)))

    def cond(st: _State) -> jax.Array:
        return (st.step < stop_step) & ~jnp.all(st.done_C)

    def body(st: _State) -> _State:
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


_grow = jax.jit(grow_cache, static_argnames=("length",))


def _cast_floats(tree: Params, dtype: Any) -> Params:
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


_cast = jax.jit(_cast_floats, static_argnames=("dtype",))


@functools.partial(jax.jit, static_argnames=("config",))
def _unstack(config: ModelConfig, tree: Params) -> Params:
    """Per-layer weights in the compute dtype for the unrolled decode (``model.decoder``): cast and split in one
    program, so a call holds one extra copy of the weights (none per step)."""
    tree = _cast_floats(tree, jnp.dtype(config.compute_dtype))
    layers, lora = unstack_layers(config, tree["base"]["layers"], tree.get("lora"))
    out = {"base": {**tree["base"], "layers": layers}}
    if "policy" in tree:  # LoRA RL's policy adapter, applied unmerged at every step (``model.decoder``)
        out["policy"] = unstack_layers(config, tree["policy"])[0]
    return out if lora is None else {**out, "lora": lora}


def _layer_shardings(shardings: Params, num_layers: int) -> tuple[Params, ...]:
    """The per-layer shardings of stacked ones: each spec without its leading L entry (never split)."""
    drop_l = lambda s: jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec[1:]))
    return (jax.tree.map(drop_l, shardings),) * num_layers


# ----------------------------------------------------------------------------------------- host side
def window_ends(max_new_tokens: int, cache_window: int) -> list[int]:
    """Generated lengths at which the cache grows: ``w, 2w, 4w, ...`` up to the first >= max_new_tokens.

    ``w`` is ``cache_window``, or less for short generations (the smallest power of two that fits).
    """
    ends = [min(cache_window, pow2_bucket(max_new_tokens))]
    while ends[-1] < max_new_tokens:
        ends.append(2 * ends[-1])
    return ends


def _sampling_params(config: ModelConfig, params: Params, lora_scale: Any) -> tuple[Params, jax.Array]:
    """The params subtree the programs see and the traced scale.

    The policy adapter (``params["policy"]``, LoRA RL) is kept: it is part of the policy.
    A Python 0 drops the adapter subtree, so the model skips the adapter matmuls: the base-policy program
    (the bulk of all sampling) is exactly the base model. Any other scale is traced, so every adapter-on
    value shares one second program. ``_decode_weights`` then makes the call's one copy of the weights.
    """
    adapter_on = not (isinstance(lora_scale, int | float) and lora_scale == 0)
    if adapter_on and not params.get("lora"):
        raise ValueError(f"lora_scale={lora_scale!r} but params have no 'lora' subtree")
    tree = {k: params[k] for k in ("base", "policy", *(("lora",) if adapter_on else ())) if k in params}
    return tree, jnp.asarray(lora_scale if adapter_on else 0.0, jnp.float32)


def _decode_weights(config: ModelConfig, tree: Params, mesh: jax.sharding.Mesh) -> Params:
    """The weights as the programs read them: in the compute dtype (an fp32 master copy is cast once, so a
    decode step reads half the bytes) and split per layer. The cast comes before the placement, so the weights
    gathered over ``fsdp`` are the narrow ones."""
    dtype = jnp.dtype(config.compute_dtype)
    if any(jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype for x in jax.tree.leaves(tree)):
        tree = _cast(tree, dtype.name)  # an fp32 master copy for a bf16 sampler; nothing to do when they agree
    tree = _place_on_mesh(config, tree, mesh)
    return _unstack(config, tree)


def _check_args(limits, temperature, top_p, top_k, n, cache_window, compact_every) -> None:
    if limits.min() < 1 or n < 1 or top_k < 0 or cache_window < 1 or compact_every < 0:
        raise ValueError(
            "need max_new_tokens, n, cache_window >= 1 and top_k, compact_every >= 0; "
            f"got {limits.min()}, {n}, {cache_window}, {top_k} and {compact_every}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (greedy too: it sets the log-probs), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def _place_on_mesh(config: ModelConfig, tree: Params, mesh: jax.sharding.Mesh) -> Params:
    """The sampling params in the decode layout: split over ``tp`` only, whole on every data-parallel replica.

    Gathering FSDP-split weights at every generated token would move the whole model per step; holding
    them (in the compute dtype) on each replica costs less than the KV cache of a long rollout.
    """
    return sharding.shard_params(tree, sharding.param_shardings(config, mesh, gather_fsdp=True))


class _Out(NamedTuple):
    """The call's results by output row, where compaction leaves the rows that have ended."""

    tokens_CN: jax.Array
    logp_CN: jax.Array
    length_C: jax.Array
    eos_C: jax.Array


def _results(state: _State) -> _Out:
    return _Out(state.tokens_CN, state.logp_CN, state.length_C, state.eos_C)


@functools.partial(jax.jit, donate_argnames=("out",))
def _flush(out: _Out | None, state: _State) -> _Out:
    """Write every row of ``state`` into ``out`` at its output row (``out`` starts empty at the call's size)."""
    TRACE_COUNTS["flush"] += 1
    if out is None:
        out = jax.tree.map(jnp.zeros_like, _results(state))
    return _Out(*(o.at[state.row_C].set(x) for o, x in zip(out, _results(state), strict=True)))


@jax.jit  # not donated: the result has fewer rows, so no buffer of the state could hold it
def _take_rows(state: _State, index_R: jax.Array) -> _State:
    """The state of rows ``index_R`` only (every per-row array and the cache gathered), the step unchanged."""
    TRACE_COUNTS["compact"] += 1
    taken = jax.tree.map(lambda x: x if x.ndim == 0 else jnp.take(x, index_R, axis=0), state)
    return taken._replace(cache=constrain_cache(taken.cache))


class _Call(NamedTuple):
    """Everything about one call except the key: padded inputs, buckets, the params tree the programs see."""

    config: ModelConfig
    tree: Params
    scale: jax.Array
    temperature: jax.Array
    eos_E: np.ndarray
    options: SamplingOptions
    tokens_BP: np.ndarray
    mask_BP: np.ndarray
    live_B: np.ndarray
    limit_B: np.ndarray
    ends: list[int]
    n: int
    max_new_tokens: int
    compact_every: int
    mesh: jax.sharding.Mesh

    def in_mesh(self):
        """The context the programs trace and run in: the model's layout constraints apply under it."""
        return jax.set_mesh(self.mesh)

    def prefill(self, key: jax.Array) -> _State:
        args = (self.tokens_BP, self.mask_BP, self.live_B, self.limit_B, key, self.temperature, self.scale, self.eos_E)
        static = dict(options=self.options, n=self.n, window=self.ends[0], total_new=self.ends[-1])
        with self.in_mesh():
            return _prefill(self.config, self.tree, *args, **static)

    def decode(self, state: _State, key: jax.Array, cancel: Callable[[], bool] | None = None) -> tuple[_Out, int]:
        """Run the decode segments; the results by output row and the number of steps taken. ``cancel`` returning
        True ends it at the next segment's start (the rows cut short, for a caller that drops them)."""
        with self.in_mesh():
            state, out = self._decode(state, key, cancel)
            return (_results(state) if out is None else _flush(out, state)), int(np.max(sharding.fetch(state.step)))

    def stops(self) -> list[int]:
        """Where the decode segments end: every ``compact_every`` steps and at each window end."""
        marks = set(range(self.compact_every, self.max_new_tokens, self.compact_every)) if self.compact_every else set()
        return sorted({min(end, self.max_new_tokens) for end in self.ends} | marks)

    def _decode(self, state: _State, key: jax.Array, cancel: Callable[[], bool] | None) -> tuple[_State, _Out | None]:
        prompt_slots = self.tokens_BP.shape[1]
        out = None
        for i, stop in enumerate(self.stops()):
            if i > 0:
                if cancel is not None and cancel():
                    break
                # One host round trip per segment: stop once every row has ended, else drop the ended rows.
                done_C = sharding.fetch(state.done_C)
                if done_C.all():
                    break
                if self.compact_every:
                    state, out = self._compact(state, out, done_C)
            window = next(end for end in self.ends if end >= stop)
            if state.cache[0]["v"].shape[2] < prompt_slots + window:
                state = state._replace(cache=_grow(state.cache, length=prompt_slots + window))
            args = (key, self.temperature, self.scale, self.eos_E, jnp.asarray(stop, jnp.int32))
            state = _decode_segment(self.config, self.tree, state, *args, options=self.options)
        return state, out

    def _compact(self, state: _State, out: _Out | None, done_C: np.ndarray) -> tuple[_State, _Out | None]:
        """Move the live rows into the smallest row bucket that holds them, of at least ``MIN_COMPACT_ROWS`` (ended
        rows fill it up); their results so far go to ``out`` first. Rows stay split evenly over the data axes."""
        live = np.flatnonzero(~done_C)
        rows = pow2_bucket(len(live), max(MIN_COMPACT_ROWS, sharding.batch_shards(self.mesh)))
        if rows >= len(done_C):
            return state, out
        index = np.concatenate([live, np.flatnonzero(done_C)])[:rows].astype(np.int32)
        return _take_rows(state, index), _flush(out, state)


def _limits(max_new_tokens: int | Sequence[int], prompts: int) -> np.ndarray:
    """One limit per prompt from an int or a sequence of them; a clear error for a bad one."""
    if isinstance(max_new_tokens, int | np.integer):
        return np.full((prompts,), int(max_new_tokens), np.int32)
    limits = np.asarray(list(max_new_tokens))
    if limits.shape != (prompts,) or not np.issubdtype(limits.dtype, np.integer):
        raise ValueError(f"max_new_tokens must be an int or one int per prompt ({prompts}), got {max_new_tokens!r}")
    return limits.astype(np.int32)


def _plan(
    config: ModelConfig,
    params: Params,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_token_ids: Sequence[int] = (),
    n: int = 1,
    lora_scale: float | jax.Array = 0.0,
    greedy: bool = False,
    cache_window: int = DEFAULT_CACHE_WINDOW,
    compact_every: int = DEFAULT_COMPACT_EVERY,
    mesh: jax.sharding.Mesh | None = None,
) -> _Call:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    limits = _limits(max_new_tokens, len(prompts))
    _check_args(limits, temperature, top_p, top_k, n, cache_window, compact_every)
    mesh = sharding.mesh_or_local(mesh)
    tree, scale = _sampling_params(config, params, lora_scale)
    tree = _decode_weights(config, tree, mesh)
    batch = pow2_bucket(len(prompts))
    prompt_slots = pow2_bucket(max(len(p) for p in prompts), MIN_PROMPT_BUCKET)
    longest = int(limits.max())
    return _Call(
        config,
        tree,
        scale,
        jnp.asarray(temperature, jnp.float32),
        _eos_array(eos_token_ids),
        SamplingOptions(int(top_k), float(top_p), bool(greedy)),
        *left_pad(prompts, prompt_slots, rows=batch),
        np.arange(batch) < len(prompts),
        np.pad(limits, (0, batch - len(prompts)), constant_values=1),
        window_ends(longest, cache_window),
        n,
        longest,
        compact_every,
        mesh,
    )


def prefill_only(config: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], *, key: jax.Array, **kwargs):
    """Only the prompt pass (and token 0) of the ``generate`` call with these arguments: for benchmarks."""
    return jax.block_until_ready(_plan(config, params, prompts, **kwargs).prefill(key))


def generate_arrays(
    config: ModelConfig,
    params: Params,
    prompts: Sequence[Sequence[int]],
    *,
    key: jax.Array,
    max_new_tokens: int | Sequence[int],
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_token_ids: Sequence[int] = (),
    n: int = 1,
    lora_scale: float | jax.Array = 0.0,
    greedy: bool = False,
    cache_window: int = DEFAULT_CACHE_WINDOW,
    compact_every: int = DEFAULT_COMPACT_EVERY,
    mesh: jax.sharding.Mesh | None = None,
    cancel: Callable[[], bool] | None = None,
) -> SampleBatch:
    """Sample ``n`` continuations of each prompt (token-id lists): ``n`` consecutive rows per prompt, as padded
    arrays (``generate`` returns them as records).

    ``logprobs`` are ``log_softmax(logits / temperature)`` at each new token, before top-k/top-p, also when
    ``greedy`` (argmax). A row ends at its first token in ``eos_token_ids`` (kept, finish_reason "eos") or
    after ``max_new_tokens`` ("length"): one int, or one per prompt. ``lora_scale`` switches the adapter
    ``params["lora"]`` on; a Python 0 runs the base program without adapter matmuls.

    Row c's tokens depend only on ``key``, its own prompt, its index c and the shape buckets, not on the other
    rows nor on ``cache_window`` (the first cache growth step) or ``compact_every``: every ``compact_every``
    steps (0: never) the rows still running move into a smaller batch bucket when they fit one, so the steps
    after that pay only for them (see the module docstring).

    With a ``mesh`` (``sharding.make_mesh``) the programs run on all its devices: weights split over ``tp``
    (whole on each data-parallel replica), rows and the KV cache over ``data`` and ``fsdp`` when the row
    bucket divides, KV heads over ``tp`` when they divide. The tokens equal the single-device ones up to
    ties that a different order of floating-point sums can break.

    ``cancel``, asked at each decode segment's start, ends the call there when it returns True: every row is cut
    short where it stands (``steps`` says how far), for a caller that will drop the rows (rollouts sampled ahead
    when the run stops).
    """
    options = dict(temperature=temperature, top_p=top_p, top_k=top_k, eos_token_ids=eos_token_ids, n=n)
    layout = dict(lora_scale=lora_scale, greedy=greedy, cache_window=cache_window, compact_every=compact_every)
    call = _plan(config, params, prompts, max_new_tokens=max_new_tokens, **options, **layout, mesh=mesh)
    out, steps = call.decode(call.prefill(key), key, cancel)
    rows = len(prompts) * n  # padding rows come last: drop them
    # On several hosts each holds only its devices' rows: gather them so every host gets the whole result.
    tokens, logp, lengths, eos = jax.tree.map(sharding.fetch, tuple(out))
    return SampleBatch(
        tokens=tokens[:rows, : call.max_new_tokens],
        logprobs=logp[:rows, : call.max_new_tokens],
        lengths=lengths[:rows],
        eos=eos[:rows],
        n=n,
        steps=steps,
    )


def generate(config: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], **options: Any) -> list[Completion]:
    """``generate_arrays`` (the same arguments) as one ``Completion`` record per row."""
    return generate_arrays(config, params, prompts, **options).completions()
