"""Batched autoregressive sampling from the Qwen2 model with a static-shape KV cache.

Shape letters (as ``models/model.py``, plus): B prompt rows (padded), C completion rows (B * n; row b*n + j is
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
  to the output arrays (``programs.flush``) and the live rows, cache included, are gathered into that bucket
  (``programs.take_rows``), so later steps pay only for them. Row c samples step i with
  ``fold_in(fold_in(key, c), i)`` (``programs``): moving rows changes no sample.
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

This module is the host side of a call: its plan (buckets, padding, the weights once per call, in
``sampler_weights``) and the loop over decode segments. The jitted programs and their loop state are in
``programs``, the token draw in ``sampling``, the types a call takes and returns in ``samples``.

Log-probs are ``log_softmax(logits / temperature)`` at the sampled token, taken BEFORE any top-k/top-p
truncation: the quantity the trainer computes for ``old_logp``. Greedy decoding reports them at the
temperature given too (so greedy with T = 1 reports the model's plain log-probs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lspo_jax.config import ModelConfig
from lspo_jax.models import sharding
from lspo_jax.models.specs import Params
from lspo_jax.rollout import programs, sampler_weights
from lspo_jax.rollout.buckets import left_pad, pow2_bucket
from lspo_jax.rollout.programs import Out, State
from lspo_jax.rollout.samples import Completion, SampleBatch
from lspo_jax.rollout.sampling import SamplingOptions

MIN_PROMPT_BUCKET = 16


# First cache window (new tokens): short generations read few empty slots, and a rollout of 8192 tokens
# grows the cache 5 times, so it compiles 6 decode programs per prompt bucket.
DEFAULT_CACHE_WINDOW = 256


# Decode segments end every this many steps: the host then drops the rows that have ended (``_Call._compact``).
DEFAULT_COMPACT_EVERY = 16


# No bucket below this many rows: a step of so few rows costs about the same as of half as many (reading the
# weights dominates), so a smaller bucket would only add compiled programs.
MIN_COMPACT_ROWS = 8


def window_ends(max_new_tokens: int, cache_window: int) -> list[int]:
    """Generated lengths at which the cache grows: ``w, 2w, 4w, ...`` up to the first >= max_new_tokens.

    ``w`` is ``cache_window``, or less for short generations (the smallest power of two that fits).
    """
    ends = [min(cache_window, pow2_bucket(max_new_tokens))]
    while ends[-1] < max_new_tokens:
        ends.append(2 * ends[-1])
    return ends


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

    def prefill(self, key: jax.Array) -> State:
        args = (self.tokens_BP, self.mask_BP, self.live_B, self.limit_B, key, self.temperature, self.scale, self.eos_E)
        static = dict(options=self.options, n=self.n, window=self.ends[0], total_new=self.ends[-1])
        with self.in_mesh():
            return programs.prefill(self.config, self.tree, *args, **static)

    def decode(self, state: State, key: jax.Array, cancel: Callable[[], bool] | None = None) -> tuple[Out, int]:
        """Run the decode segments; the results by output row and the number of steps taken. ``cancel`` returning
        True ends it at the next segment's start (the rows cut short, for a caller that drops them)."""
        with self.in_mesh():
            state, out = self._decode(state, key, cancel)
            results = programs.results(state) if out is None else programs.flush(out, state)
            return results, int(np.max(sharding.fetch(state.step)))

    def stops(self) -> list[int]:
        """Where the decode segments end: every ``compact_every`` steps and at each window end."""
        marks = set(range(self.compact_every, self.max_new_tokens, self.compact_every)) if self.compact_every else set()
        return sorted({min(end, self.max_new_tokens) for end in self.ends} | marks)

    def _decode(self, state: State, key: jax.Array, cancel: Callable[[], bool] | None) -> tuple[State, Out | None]:
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
                state = state._replace(cache=programs.grow(state.cache, length=prompt_slots + window))
            args = (key, self.temperature, self.scale, self.eos_E, jnp.asarray(stop, jnp.int32))
            state = programs.decode_segment(self.config, self.tree, state, *args, options=self.options)
        return state, out

    def _compact(self, state: State, out: Out | None, done_C: np.ndarray) -> tuple[State, Out | None]:
        """Move the live rows into the smallest row bucket that holds them, of at least ``MIN_COMPACT_ROWS`` (ended
        rows fill it up); their results so far go to ``out`` first. Rows stay split evenly over the data axes."""
        live = np.flatnonzero(~done_C)
        rows = pow2_bucket(len(live), max(MIN_COMPACT_ROWS, sharding.batch_shards(self.mesh)))
        if rows >= len(done_C):
            return state, out
        index = np.concatenate([live, np.flatnonzero(done_C)])[:rows].astype(np.int32)
        return programs.take_rows(state, index), programs.flush(out, state)


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
    tree, scale = sampler_weights.sampling_params(config, params, lora_scale)
    tree = sampler_weights.decode_weights(config, tree, mesh)
    batch = pow2_bucket(len(prompts))
    prompt_slots = pow2_bucket(max(len(p) for p in prompts), MIN_PROMPT_BUCKET)
    longest = int(limits.max())
    return _Call(
        config,
        tree,
        scale,
        jnp.asarray(temperature, jnp.float32),
        programs.eos_array(eos_token_ids),
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
