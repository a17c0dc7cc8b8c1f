"""Packing: rollouts and worked solutions as fixed-shape training rows, and the buckets they use.

A row is ``[left pad | prompt | response | right pad]`` with the prompt left-padded to ``P`` slots and
the response right-padded to ``R`` slots, so every RL batch of a run has the shape ``[B * K, P + R]`` and
the update compiles once. ``mask`` is 1 on response tokens; ``old_logp[:, t]`` is the log-prob of
``tokens[:, t]`` given the tokens before it (``logprobs.sequence_logprobs``), so the two align.
The sampler buckets and left-pads its prompts with the same helpers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from lspo_jax import sharding

Rows = dict[str, np.ndarray]


def pow2_bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= ``n`` (and >= ``minimum``): buckets of rows or lengths, so varying sizes
    compile a bounded set of programs."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def sft_slots(
    prompts: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], max_prompt: int, max_target: int
) -> tuple[int, int]:
    """``pack_sft``'s ``(prompt_slots, target_slots)`` for these rows: the prompt slots hold the longest prompt, and
    the row length is the power of two (at least 64) that holds the longest prompt and the longest target, at
    most ``max_prompt + max_target``. Short worked solutions then cost short rows, and a run compiles one SFT
    program per row length, whatever its prompts' lengths.
    """
    longest_prompt = max(len(p) for p in prompts)
    need = longest_prompt + max(len(t) for t in targets)
    length = min(max_prompt + max_target, max(64, pow2_bucket(need)))
    return longest_prompt, length - longest_prompt


def left_pad(seqs: Sequence[Sequence[int]], slots: int, rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [rows, slots], mask [rows, slots])`` with each sequence right-aligned (id 0 on padding) and all-zero
    rows after the last sequence (``rows`` defaults to one per sequence); an error if one does not fit."""
    ids = np.zeros((len(seqs) if rows is None else rows, slots), np.int32)
    mask = np.zeros_like(ids)
    for i, seq in enumerate(seqs):
        if len(seq) > slots:
            raise ValueError(f"sequence {i} has {len(seq)} tokens, more than the {slots} slots")
        if len(seq):
            ids[i, slots - len(seq) :] = seq
            mask[i, slots - len(seq) :] = 1
    return ids, mask


def pack_samples(prompts: Sequence[Sequence[int]], sample: Any, prompt_slots: int) -> Rows:
    """Training rows from a ``sampler.SampleBatch``; prompt ``i`` owns rows ``i * n .. i * n + n - 1``."""
    n = sample.n
    prompt_ids, prompt_mask = left_pad([prompts[row // n] for row in range(len(sample.lengths))], prompt_slots)
    response_mask = (np.arange(sample.tokens.shape[1])[None, :] < sample.lengths[:, None]).astype(np.int32)
    return {
        "tokens": np.concatenate([prompt_ids, np.where(response_mask > 0, sample.tokens, 0)], axis=1),
        "attention_mask": np.concatenate([prompt_mask, response_mask], axis=1),
        "mask": np.concatenate([np.zeros_like(prompt_mask), response_mask], axis=1),
        "lengths": sample.lengths.astype(np.int32),
        "eos": sample.eos.astype(bool),
    }


def pack_sft(prompts: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], prompt_slots: int, target_slots: int):
    """SFT rows ``prompt + target`` with the loss mask on the target tokens only (prompt tokens masked)."""
    prompt_ids, prompt_mask = left_pad(prompts, prompt_slots)
    target_ids = np.zeros((len(targets), target_slots), np.int32)
    target_mask = np.zeros_like(target_ids)
    for i, target in enumerate(targets):
        target = list(target)[:target_slots]
        target_ids[i, : len(target)] = target
        target_mask[i, : len(target)] = 1
    return {
        "tokens": np.concatenate([prompt_ids, target_ids], axis=1),
        "attention_mask": np.concatenate([prompt_mask, target_mask], axis=1),
        "mask": np.concatenate([np.zeros_like(prompt_mask), target_mask], axis=1),
    }


def pad_rows(rows: Rows, count: int) -> Rows:
    """Append all-zero rows (masked everywhere) up to ``count`` rows."""
    return {k: np.concatenate([v, np.zeros((count - len(v), *v.shape[1:]), v.dtype)]) for k, v in rows.items()}


def mesh_rows(mesh: Mesh, rows: Rows, *, multiple: int = 1) -> dict[str, jax.Array]:
    """``rows`` as global arrays split over the mesh's data axes, padded with masked rows to a count that
    divides by the data-parallel device count times ``multiple`` (e.g. the micro-batch count)."""
    rows = {k: np.asarray(v) for k, v in rows.items()}
    count = len(next(iter(rows.values())))
    step = sharding.batch_shards(mesh) * multiple
    return sharding.global_batch(mesh, pad_rows(rows, -(-count // step) * step))


def decode_responses(tokenizer, rows: Rows, prompt_slots: int) -> list[str]:
    """Response texts (special tokens dropped) of packed rows, for the verifier."""
    texts = []
    for tokens, length in zip(rows["tokens"], rows["lengths"], strict=True):
        texts.append(tokenizer.decode(tokens[prompt_slots : prompt_slots + int(length)], skip_special_tokens=True))
    return texts
