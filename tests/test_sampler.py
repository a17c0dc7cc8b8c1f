"""The sampler: greedy parity with transformers, log-probs against a teacher-forced forward, the sampling
distribution, EOS/length handling, and the bound on compilations.

Most tests share one set of shapes and options (3 prompts -> batch bucket 4, n = 2, prompt bucket 16,
T = 0.7, cache_window 8 so that a call of 9 or 10 new tokens grows the cache once) so the programs compile once.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close_relative

from lspo_jax.models.model import forward
from lspo_jax.rollout import programs, sampler, samples
from lspo_jax.rollout.sampler import generate, generate_arrays
from lspo_jax.rollout.sampling import sample_token

T = 0.7
PROMPTS = [[5, 9, 13, 17, 21], [30, 31, 32, 33, 34, 35, 36, 37, 38], [60, 61]]
SHARED = dict(temperature=T, n=2, cache_window=8)  # the shared program set (see the module docstring)

_sample_token = jax.jit(sample_token, static_argnames=("top_k", "top_p", "greedy"))
_forward = jax.jit(forward, static_argnums=0)


def _left_pad(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        tokens[i, width - len(r) :] = r
        mask[i, width - len(r) :] = 1
    return tokens, mask


# --------------------------------------------------------------------------------- parity and log-probs
@pytest.mark.parametrize("decode_attention", ["reduce", "einsum"])  # the two cache layouts: keys slots-last, first
def test_greedy_matches_transformers_generate(hf_untied_dir, decode_attention):
    import torch
    from transformers import Qwen2ForCausalLM

    from lspo_jax.models.hf import load_pretrained

    config, params = load_pretrained(hf_untied_dir)
    config = dataclasses.replace(config, decode_attention=decode_attention)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 96, size=length).tolist() for length in (7, 3, 11)]
    ours = generate(
        config,
        params,
        prompts,
        key=jax.random.key(0),
        max_new_tokens=12,
        greedy=True,
        eos_token_ids=(2,),
        cache_window=8,
    )

    model = Qwen2ForCausalLM.from_pretrained(hf_untied_dir, dtype=torch.float32).eval()
    tokens, mask = _left_pad(prompts)
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.from_numpy(tokens).long(),
            attention_mask=torch.from_numpy(mask).long(),
            do_sample=False,
            max_new_tokens=12,
            pad_token_id=0,
            eos_token_id=2,
        )
    hf_new = out[:, tokens.shape[1] :].numpy()
    assert [r.prompt_index for r in ours] == [0, 1, 2]
    for rec, row in zip(ours, hf_new, strict=True):
        length = len(rec.tokens)
        np.testing.assert_array_equal(rec.tokens, row[:length])
        if rec.finish_reason == "eos":
            assert rec.tokens[-1] == 2 and np.all(row[length:] == 0)
        else:
            assert length == 12 and 2 not in rec.tokens


@pytest.mark.parametrize("lora_scale", [0.0, 0.75])
def test_logprobs_match_teacher_forced_forward(tiny_config, tiny_params, lora_scale):
    """Cached decode (across a cache growth) gives log_softmax(logits / T) of a plain full forward."""
    recs = generate(
        tiny_config, tiny_params, PROMPTS, key=jax.random.key(1), max_new_tokens=10, lora_scale=lora_scale, **SHARED
    )
    assert [r.prompt_index for r in recs] == [0, 0, 1, 1, 2, 2]  # padding row of the batch bucket dropped
    assert all(len(r.tokens) == 10 and r.finish_reason == "length" for r in recs)
    assert not np.array_equal(recs[0].tokens, recs[1].tokens)  # n samples of one prompt are independent

    tokens, mask = _left_pad([PROMPTS[r.prompt_index] + r.tokens.tolist() for r in recs])
    logits = _forward(tiny_config, tiny_params, tokens, mask, lora_scale=lora_scale)
    logp = np.asarray(jax.nn.log_softmax(logits / T, axis=-1))
    base_logp = np.asarray(jax.nn.log_softmax(_forward(tiny_config, tiny_params, tokens, mask) / T, axis=-1))
    width = tokens.shape[1]
    for i, rec in enumerate(recs):
        # New token j sits at column width - 10 + j and is predicted by the column before it.
        cols = width - 10 - 1 + np.arange(10)
        # Cached decode, one token at a time, against one pass: float32 rounding (~4e-7 of the norm measured).
        assert_close_relative(rec.logprobs, logp[i, cols, rec.tokens], 2e-5)
        if lora_scale:  # the adapter really changed the distribution the tokens were drawn from
            assert np.abs(rec.logprobs - base_logp[i, cols, rec.tokens]).max() > 1e-3


def test_reproducible_and_independent_of_cache_window(tiny_config, tiny_params):
    run = lambda seed, **kw: generate_arrays(
        tiny_config, tiny_params, PROMPTS, key=jax.random.key(seed), max_new_tokens=10, **{**SHARED, **kw}
    )
    a, b, other = run(1), run(1), run(2)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert not np.array_equal(a.tokens, other.tokens)
    # One window of 16 instead of windows 8 and 16: the same tokens, the same log-probs up to rounding.
    whole = run(1, cache_window=16)
    np.testing.assert_array_equal(a.tokens, whole.tokens)
    assert_close_relative(a.logprobs, whole.logprobs, 2e-5)


# ------------------------------------------------------------------------------ per-row randomness
def test_rows_do_not_depend_on_the_other_rows_or_on_compaction(tiny_config, tiny_params, monkeypatch):
    """Row c draws from fold_in(fold_in(key, c), step): its tokens are the same alone or in a batch, and the
    same whether or not the rows still running are moved into smaller batch buckets on the way."""
    limits = [10, 3, 5]  # rows end at 10, 3 and 5 tokens: with compact_every=2 the batch shrinks 8 -> 4 -> 2
    run = lambda prompts, **kw: generate_arrays(
        tiny_config, tiny_params, prompts, key=jax.random.key(4), **{**SHARED, "max_new_tokens": 10, **kw}
    )
    monkeypatch.setattr(sampler, "MIN_COMPACT_ROWS", 1)  # this batch of 8 rows may shrink to 2
    before = collections.Counter(programs.TRACE_COUNTS)
    moved = run(PROMPTS, max_new_tokens=limits, compact_every=2)
    assert (programs.TRACE_COUNTS - before)["compact"] >= 2  # it did move rows, twice
    still = run(PROMPTS, max_new_tokens=limits, compact_every=0)
    np.testing.assert_array_equal(moved.lengths, np.repeat(limits, 2))
    assert not moved.eos.any() and moved.steps == 10
    np.testing.assert_array_equal(moved.tokens, still.tokens)
    # Different batch shapes round the matmuls differently: the log-probs agree to float32 rounding.
    assert_close_relative(moved.logprobs, still.logprobs, 2e-5)
    # The first prompt alone (a batch bucket of 1, not 4): its two rows are rows 0 and 1 of the bigger call.
    alone = run(PROMPTS[:1])
    np.testing.assert_array_equal(alone.tokens, still.tokens[:2])


def test_a_cancelled_call_ends_at_the_next_segment(tiny_config, tiny_params):
    """``cancel`` is asked at each decode segment's start: asked True from the first, the call ends after the first
    segment (``compact_every`` = 2 tokens), every row cut short there; never True, it runs to the limit."""
    asked = []
    cancel = lambda: asked.append(True) or True
    run = lambda **kw: generate_arrays(tiny_config, tiny_params, PROMPTS, key=jax.random.key(4), compact_every=2,
                                       **{**SHARED, "max_new_tokens": 10, **kw})  # fmt: skip
    cut = run(cancel=cancel)
    assert cut.steps == 2 and len(asked) == 1
    np.testing.assert_array_equal(cut.lengths, np.full(6, 2))
    whole = run(cancel=lambda: False)
    assert whole.steps == 10 and whole.lengths.max() == 10
    np.testing.assert_array_equal(cut.tokens[:, :2], whole.tokens[:, :2])  # the same rows, cut short


def test_max_new_tokens_per_prompt(tiny_config, tiny_params):
    recs = generate(tiny_config, tiny_params, PROMPTS, key=jax.random.key(5), max_new_tokens=[1, 7, 4], **SHARED)
    assert [len(r.tokens) for r in recs] == [1, 1, 7, 7, 4, 4]
    assert {r.finish_reason for r in recs} == {"length"}
    for bad in ([1, 2], [3, 0, 1], [1.5, 2, 3]):
        with pytest.raises(ValueError, match="max_new_tokens"):
            generate(tiny_config, tiny_params, PROMPTS, key=jax.random.key(0), max_new_tokens=bad)


# ------------------------------------------------------------------------------------------ EOS, length
def test_eos_and_max_new_tokens_end_rows(tiny_config, tiny_params):
    kw = dict(key=jax.random.key(3), **SHARED)
    free = generate_arrays(tiny_config, tiny_params, PROMPTS, max_new_tokens=9, **kw)
    assert free.tokens.shape == (6, 9) and np.all(free.lengths == 9) and not free.eos.any() and free.steps == 9

    # Make one token of every row an EOS: each row must end at its first EOS, whichever id it is.
    eos_ids = sorted({int(free.tokens[row, 2 + row % 4]) for row in range(6)})
    stopped = generate_arrays(tiny_config, tiny_params, PROMPTS, max_new_tokens=9, eos_token_ids=eos_ids, **kw)
    is_eos = np.isin(free.tokens, eos_ids)
    expected_len = np.argmax(is_eos, axis=1) + 1  # every row has an EOS by construction
    np.testing.assert_array_equal(stopped.lengths, expected_len)
    assert stopped.eos.all()
    assert stopped.steps == expected_len.max() < 9  # the loop stopped once every row was done
    for row, length in enumerate(expected_len):
        np.testing.assert_array_equal(stopped.tokens[row, :length], free.tokens[row, :length])
        np.testing.assert_array_equal(stopped.logprobs[row, :length], free.logprobs[row, :length])
        assert np.all(stopped.tokens[row, length:] == samples.PAD_ID)  # finished rows padded ...
        assert np.all(stopped.logprobs[row, length:] == 0.0)  # ... and masked
    recs = stopped.completions()
    assert [r.finish_reason for r in recs] == ["eos"] * 6
    assert [len(r.tokens) for r in recs] == expected_len.tolist() and recs[0].tokens[-1] in eos_ids


def test_argument_errors(tiny_config, tiny_params):
    base_only = {"base": tiny_params["base"]}
    with pytest.raises(ValueError, match="lora"):
        generate(tiny_config, base_only, PROMPTS, key=jax.random.key(0), max_new_tokens=4, lora_scale=1.0)
    with pytest.raises(ValueError, match="temperature"):
        generate(tiny_config, tiny_params, PROMPTS, key=jax.random.key(0), max_new_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="prompts"):
        generate(tiny_config, tiny_params, [[1], []], key=jax.random.key(0), max_new_tokens=4)


# ---------------------------------------------------------------------------------- compilation bound
def test_compilations_bounded_by_buckets(tiny_config, tiny_params):
    before = collections.Counter(programs.TRACE_COUNTS)
    rng = np.random.default_rng(0)
    lengths = [3, 4, 6, 8, 10, 12, 14, 16, 18, 20]
    for i, length in enumerate(lengths):
        prompts = [rng.integers(4, 96, size=max(1, length - k)).tolist() for k in (0, 2, 1)]
        generate(
            tiny_config,
            tiny_params,
            prompts,
            key=jax.random.key(i),
            max_new_tokens=9 + i % 2,  # 9 and 10 both have windows 8, 16
            eos_token_ids=[(i * 7) % 96],  # a traced argument: changes recompile nothing
            **SHARED,
        )
    new = programs.TRACE_COUNTS - before
    # Prompt lengths 3..16 share bucket 16 and 18..20 bucket 32: at most 2 prefill programs, and per prompt
    # bucket one decode program per window (8, 16), so at most 4; 10 calls without buckets would need 10 / 20.
    assert new["prefill"] <= 2 and new["decode"] <= 4, new

    before = collections.Counter(programs.TRACE_COUNTS)
    for scale in (0.5, 1.0, 0.25):  # adapter on: the scale is traced, one program set for all values
        generate(
            tiny_config, tiny_params, PROMPTS, key=jax.random.key(0), max_new_tokens=10, lora_scale=scale, **SHARED
        )
    new = programs.TRACE_COUNTS - before
    assert new["prefill"] <= 1 and new["decode"] <= 2, new


# --------------------------------------------------------------------------------------- sample_token
# Critical values of the chi-square test at significance 0.001 by the Wilson-Hilferty approximation
# chi2_crit(k) ~= k * (1 - 2/(9k) + z * sqrt(2/(9k)))^3 with z = 3.09 (the 0.999 normal quantile):
#   k = 5: 2/45 = 0.0444, sqrt = 0.2108, 1 - 0.0444 + 3.09 * 0.2108 = 1.6070, cubed 4.150, times 5 = 20.75
#   k = 2: 2/18 = 0.1111, sqrt = 0.3333, 1 - 0.1111 + 3.09 * 0.3333 = 1.9189, cubed 7.066, times 2 = 14.13
# (tables: 20.52 and 13.82). A correct sampler fails this with probability about 0.001 per check; a wrong
# temperature or truncation gives statistics in the hundreds at 20,000 draws.
CHI2_CRIT = {5: 20.75, 2: 14.13}
DRAWS = 20_000


def _draw(logits, key=0, **kw):
    logits_BV = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (DRAWS, len(logits)))
    tokens, logp = _sample_token(logits_BV, jax.random.key(key), kw.pop("temperature", 1.0), **kw)
    return np.asarray(tokens), np.asarray(logp)


def _chi_square(tokens: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=len(probs))
    expected = probs * len(tokens)
    return float(np.sum((counts - expected) ** 2 / expected))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])  # softmax(LOGITS / 0.7): smallest p 5.5e-4, 11 expected


def test_sample_token_distribution_with_temperature():
    tokens, logp = _draw(LOGITS, temperature=T)
    probs = _softmax(LOGITS / T)
    assert _chi_square(tokens, probs) < CHI2_CRIT[5]
    np.testing.assert_allclose(logp, np.log(probs)[tokens], rtol=1e-5)


def test_top_k_keeps_exactly_the_k_most_likely():
    tokens, logp = _draw(LOGITS, temperature=T, top_k=3)
    assert set(np.unique(tokens)) == {0, 1, 2}
    probs = _softmax(LOGITS / T)
    assert _chi_square(tokens, probs[:3] / probs[:3].sum()) < CHI2_CRIT[2]
    np.testing.assert_allclose(logp, np.log(probs)[tokens], rtol=1e-5)  # log-probs before truncation


@pytest.mark.parametrize(
    ("top_p", "top_k", "kept"),
    [
        # Masses before each token: 0, .40, .70, .85, .95. Kept: those whose mass before is < top_p.
        (0.75, 0, {0, 1, 2}),
        (0.5, 0, {0, 1}),
        (0.1, 0, {0}),  # the top token always stays
        (0.86, 0, {0, 1, 2, 3}),
        # After top_k = 4 the renormalised masses before are 0, .421, .737, .895: 0.86 now keeps three.
        (0.86, 4, {0, 1, 2}),
    ],
)
def test_top_p_keeps_the_smallest_nucleus(top_p, top_k, kept):
    probs = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    # Shuffle the vocabulary so that "most likely" cannot be confused with "lowest id".
    order = np.array([3, 0, 4, 1, 2])
    logits = np.empty(5)
    logits[order] = np.log(probs)
    tokens, logp = _draw(logits, top_p=top_p, top_k=top_k)
    assert set(np.unique(tokens)) == set(order[sorted(kept)])
    np.testing.assert_allclose(logp, logits[tokens], atol=1e-5)
    if len(kept) == 3:
        rank = np.argsort(np.argsort(-logits))  # token id -> rank by probability
        assert _chi_square(rank[tokens], probs[:3] / probs[:3].sum()) < CHI2_CRIT[2]


def test_inverse_cdf_draw_over_blocks():
    """A 1000-entry vocabulary (blocks of 32, the last one half padding) with a third of it at -inf: the draw
    never picks a removed or padding entry, and its frequencies match the distribution.

    Bins: the 5 heavy tokens one each, then the rest in one bin (6 bins, k = 5 degrees of freedom)."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=1000)
    logits[:5] = 4.0 + np.arange(5) / 4  # five tokens of 3-6% each; the 662 other kept ones share the rest
    logits[5 + rng.permutation(995)[:333]] = -np.inf
    tokens, logp = _draw(logits)
    assert np.all(np.isfinite(logits[tokens]))
    probs = _softmax(logits)
    bins = np.minimum(tokens, 5)
    expected = np.append(probs[:5], probs[5:].sum())
    assert _chi_square(bins, expected) < CHI2_CRIT[5]
    np.testing.assert_allclose(logp, np.log(probs[tokens]), rtol=1e-4)


def test_greedy_and_key_reproducibility():
    logits = np.random.default_rng(0).normal(size=(64, 10)).astype(np.float32)
    tokens, logp = _sample_token(jnp.asarray(logits), jax.random.key(0), T, greedy=True)
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    ref = np.log(np.apply_along_axis(_softmax, 1, logits / T))
    np.testing.assert_allclose(logp, ref[np.arange(64), tokens], atol=1e-5)
    a, _ = _draw(LOGITS, key=5)
    b, _ = _draw(LOGITS, key=5)
    c, _ = _draw(LOGITS, key=6)
    np.testing.assert_array_equal(a, b)
    assert np.mean(a != c) > 0.2  # independent draws of this distribution differ about 70% of the time
