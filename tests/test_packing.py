"""Packed token buffers: the layout by hand, and the passes over them equal to the padded rows' passes."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import numpy as np
import pytest

from lspo_jax.config import ModelConfig
from lspo_jax.job.config import load_config
from lspo_jax.job.metrics_log import read_metrics
from lspo_jax.job.run import Run
from lspo_jax.models import model
from lspo_jax.models.attention import packs_segments
from lspo_jax.rl import logprobs, losses, optim, packing

pytestmark = pytest.mark.slow  # packed against padded gradients, many shapes

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")
CONFIG = ModelConfig.preset("tiny")
PROMPT, RESPONSE = 6, 18


def test_row_bucket_keeps_four_significant_bits():
    # 17 = 10001b needs 5 bits: rounded up in steps of 2 -> 18; 568 (10 bits) in steps of 64 -> 576.
    assert [packing.row_bucket(n) for n in (0, 1, 7, 15, 16, 17, 31, 33, 568)] == [1, 1, 7, 15, 16, 18, 32, 36, 576]
    assert packing.row_bucket(9, multiple=8) == 16 and packing.row_bucket(568, multiple=24) == 576


def test_micro_batching_sizes_by_rows_per_micro_batch():
    # 130 rows fit one micro-batch of 136, whose 4-bit bucket (144) would not: capped at 136. 300 rows: 3 micro-
    # batches of 136 (ceil(300 / 136) = 3). Without a micro-batch size: the bucket, a multiple of 8.
    assert packing.micro_batching(130, 8, 136) == (136, 1)
    assert packing.micro_batching(300, 8, 136) == (3 * 136, 3)
    assert packing.micro_batching(130, 8) == (144, 1) and packing.micro_batching(9, 8, 16) == (16, 1)


def test_best_fit_decreasing_fills_rows_before_opening_new_ones():
    # Length 8: 5 opens row 0, 4 opens row 1, 3 fits row 0 (3 free, the tighter fit), 3 goes to row 1 (4 free),
    # 1 into row 1's last free slot. Two rows, both full; the empty sequence is not placed.
    row, offset, rows = packing.plan_rows(np.array([3, 5, 0, 1, 4, 3]), 8)
    assert rows == 2
    assert row.tolist() == [0, 0, -1, 1, 1, 1] and offset.tolist() == [5, 0, 0, 7, 0, 4]
    row, offset, rows = packing.plan_rows(np.array([3, 5, 1]), 8, one_per_row=True)
    assert (rows, offset.tolist()) == (3, [0, 0, 0])
    with pytest.raises(ValueError, match="sequence 1 has 9 tokens, more than the 8 slots"):
        packing.plan_rows(np.array([3, 9]), 8)


def test_pack_rows_by_hand():
    # Row 0: a left-padded prompt of 2 and a response of 2; row 1 fills a whole buffer row; row 2 holds 2 tokens;
    # row 3 is empty (mesh padding). Best fit: row 1 (8) -> buffer 0, row 0 (4) -> buffer 1, row 2 (2) after it.
    rows = {
        "tokens": np.arange(32).reshape(4, 8) + 1,
        "attention_mask": np.array([[0, 0, 1, 1, 1, 1, 0, 0], [1] * 8, [0, 1, 1, 0, 0, 0, 0, 0], [0] * 8]),
        "mask": np.array([[0, 0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0], [0] * 8]),
        "advantages": np.array([1.0, 2.0, 3.0, 4.0], np.float32),
    }
    packed = packing.pack_rows(rows, ("mask", "advantages"), 8)
    got = packed.arrays
    assert got["tokens"].tolist() == [[9, 10, 11, 12, 13, 14, 15, 16], [3, 4, 5, 6, 18, 19, 0, 0]]
    assert got["segment_ids"].tolist() == [[1] * 8, [1, 1, 1, 1, 2, 2, 0, 0]]
    assert got["positions"].tolist() == [list(range(8)), [0, 1, 2, 3, 0, 1, 0, 0]]
    # Row 2's first real token was in its mask: cleared, as nothing of its own segment predicts it.
    assert got["mask"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 1, 0, 0]]
    assert got["advantages"].tolist() == [[2.0] * 8, [1.0] * 4 + [3.0] * 2 + [0.0] * 2]
    assert packed.real_tokens == 14 and packed.slots == 16
    # unpack puts every real slot back, zeros elsewhere (row 3 included).
    assert np.array_equal(packed.unpack(got["tokens"]), np.where(rows["attention_mask"] > 0, rows["tokens"], 0))


def _rows(seed: int = 0, count: int = 12) -> dict[str, np.ndarray]:
    """Left-padded prompts of 1..PROMPT tokens and responses of 0..RESPONSE (the extremes included), old log-probs
    of any value (a spliced row's adapter-on denominators are just other numbers here) and mixed advantages."""
    rng = np.random.default_rng(seed)
    prompt, response = rng.integers(1, PROMPT + 1, count), rng.integers(0, RESPONSE + 1, count)
    prompt[:3], response[:3] = (PROMPT, 1, 1), (RESPONSE, 0, 1)
    slots = np.arange(PROMPT + RESPONSE)[None, :]
    real = (slots >= PROMPT - prompt[:, None]) & (slots < PROMPT + response[:, None])
    mask = real & (slots >= PROMPT)
    tokens = np.where(real, rng.integers(1, CONFIG.vocab_size, real.shape), 0).astype(np.int32)
    old_logp = np.where(mask, -rng.uniform(1.0, 8.0, real.shape), 0.0).astype(np.float32)
    advantages = rng.standard_normal(count).astype(np.float32)
    return {"tokens": tokens, "attention_mask": real.astype(np.int32), "mask": mask.astype(np.int32),
            "old_logp": old_logp, "advantages": advantages}  # fmt: skip


# Packed and padded rows sum the same terms in other orders (keys at other slots, rows in other micro-batches), so
# they differ by float32 rounding, relative to each value's scale: measured at most 3 ulps of the SFT loss (1.4e-6
# of 5.3) and 2.4e-7 on a gradient entry. 1e-6 of the scale (at least 1) is the bound; a segment leaking into its
# neighbour, a position not restarted or a token counted twice changes them at the scale of the values themselves.
TOL = 1e-6


def _close(got, want) -> bool:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want))) <= TOL * max(1.0, float(np.max(np.abs(want))))


def _trees_close(got, want) -> bool:
    return all(_close(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))


@pytest.mark.parametrize("attention, micro_batches, chunk_size", [("einsum", 1, None), ("blocked", 2, 5)])
def test_packed_rl_gradient_equals_padded(tiny_params, attention, micro_batches, chunk_size):
    config = dataclasses.replace(CONFIG, attention=attention)
    rows = _rows()
    packed = packing.pack_rows(rows, ("mask", "old_logp", "advantages"), PROMPT + RESPONSE, row_multiple=2)
    assert packed.slots < rows["tokens"].size  # it did pack
    grads = jax.jit(
        functools.partial(
            optim.rl_gradients, config, num_micro_batches=micro_batches, spec=losses.LossSpec(chunk_size=chunk_size)
        )
    )
    loss, grad, metrics = grads(tiny_params["base"], rows)
    packed_loss, packed_grad, packed_metrics = grads(tiny_params["base"], packed.arrays)
    assert _close(packed_loss, loss) and _trees_close(packed_grad, grad)
    # The global token-mean's T: every response token but each row's first real one (none here is a response).
    assert float(packed_metrics["num_tokens"]) == float(metrics["num_tokens"]) == rows["mask"].sum()


def test_packed_logprobs_and_sft_gradient_equal_padded(tiny_params):
    config = CONFIG
    rows = _rows(seed=1)
    packed = packing.pack_rows(rows, ("mask",), PROMPT + RESPONSE)
    for lora_scale in (0.0, 1.0):  # the two old-log-prob passes: base, and adapter on
        run = functools.partial(logprobs.grouped_logprobs, config, lora_scale=lora_scale, num_micro_batches=1)
        want = np.where(rows["mask"] > 0, run(tiny_params, rows), 0.0)
        got = np.where(rows["mask"] > 0, packed.unpack(np.asarray(run(tiny_params, packed.arrays))), 0.0)
        assert _close(got, want)
    sft = jax.jit(functools.partial(optim.sft_gradients, config, num_micro_batches=1))
    loss, grad, _ = sft(tiny_params, rows)
    packed_loss, packed_grad, _ = sft(tiny_params, packed.arrays)
    assert _close(packed_loss, loss) and _trees_close(packed_grad, grad)


def test_fused_attention_refuses_a_row_of_several_segments(tiny_params):
    """The fused path reads one segment from slot 0 per row: any other row is NaN, never a silently wrong value."""
    config = dataclasses.replace(CONFIG, attention="xla")
    tokens = np.arange(1, 17, dtype=np.int32).reshape(2, 8)
    segments = np.array([[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 2, 2, 2, 0, 0]], np.int32)
    positions = np.array([[0, 1, 2, 3, 4, 0, 0, 0], [0, 1, 2, 0, 1, 2, 0, 0]], np.int32)
    h = np.asarray(model.packed_hidden_states(config, tiny_params, tokens, segments, positions))
    assert np.isfinite(h[0]).all() and np.isnan(h[1]).all()


def test_fused_attention_packs_one_sequence_per_row(tiny_params):
    """``xla`` (``jax.nn.dot_product_attention``) takes right-padded rows: one segment each, at slot 0."""
    config = dataclasses.replace(CONFIG, attention="xla")
    assert not packs_segments(config) and packs_segments(CONFIG)
    rows = _rows(seed=2)
    packed = packing.pack_rows(rows, ("mask",), PROMPT + RESPONSE, one_per_row=True)
    assert packed.arrays["segment_ids"].max() == 1
    run = functools.partial(logprobs.grouped_logprobs, config)
    want = np.where(rows["mask"] > 0, logprobs.grouped_logprobs(CONFIG, tiny_params, rows), 0.0)
    got = np.where(rows["mask"] > 0, packed.unpack(np.asarray(run(tiny_params, packed.arrays))), 0.0)
    assert _close(got, want)


def test_demo_agrees_with_packing_on_and_off(tmp_path):
    """The first step of ``configs/demo.yaml`` (no validation): the same samples, and the same loss and gradient norm
    up to float32 rounding, whether the passes run packed or padded. One step is every pass of the loop (sample,
    SFT, re-roll, both log-probs, update; 30 rows spliced at step 1): a second added only new packed buckets."""
    records = {}
    for packed in (True, False):
        # Half the demo's prompts and groups: the same passes, fewer packed buckets to compile.
        overrides = ["steps=1", "eval.enabled=false", "reward.workers=0", "checkpoint.every=100",
                     "rollout.prompts_per_step=8", "rollout.group_size=4", f"loss.packing={packed}"]  # fmt: skip
        job = Run(load_config(DEMO, overrides), str(tmp_path / str(packed)))
        try:
            job.train()
        finally:
            job.close()
        metrics = read_metrics(str(tmp_path / str(packed) / "metrics.jsonl"))
        assert not [m for m in metrics if m["kind"] == "eval"]  # eval.enabled=false: not even before and after
        records[packed] = [m for m in metrics if m["kind"] == "train"]
    on, off = records[True], records[False]
    assert [m["step"] for m in on] == [m["step"] for m in off] == [1]
    assert sum(m["spliced_rows"] for m in on) > 0  # the scaffold's rows are in the comparison
    for a, b in zip(on, off, strict=True):
        # The rollouts are the same tokens (a flipped sample would change these counts), so the batches are too.
        for name in ("accuracy_mean", "spliced_accuracy_mean", "cliff_groups", "surpassed_groups", "spliced_rows"):
            assert a[name] == b[name], (a["step"], name)
        # The loss (about 0.01, a mean of O(0.1) terms) moved by <= 6e-8 measured; the gradient norm (about 0.2) by
        # <= 1.8e-7, 1e-6 of it: Adam's update of a near-zero gradient entry amplifies rounding, step after step.
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        # And packing removed padding: a third of it here (0.32 against 0.49 at step 1), as the demo's 80-slot rows
        # hold one or two responses of 30-50 tokens (three-operand and 4-digit sums write long ones).
        assert a["pad_fraction"] < 0.75 * b["pad_fraction"]


def test_packed_log_probs_through_the_splash_kernel_equal_padded_einsum(tiny_params):
    """``model.attention: splash`` (TPU splash attention, Pallas's interpreter here) over packed buffers."""
    config = dataclasses.replace(CONFIG, attention="splash")
    rows = _rows(seed=3)
    packed = packing.pack_rows(rows, ("mask",), PROMPT + RESPONSE)
    want = np.where(rows["mask"] > 0, logprobs.grouped_logprobs(CONFIG, tiny_params, rows), 0.0)
    got = logprobs.grouped_logprobs(config, tiny_params, packed.arrays)
    assert _close(np.where(rows["mask"] > 0, packed.unpack(np.asarray(got)), 0.0), want)
