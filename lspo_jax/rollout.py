"""Rollouts as fixed-shape training rows: packing samples, scoring them, and teacher-forced log-probs.

A row is ``[left pad | prompt | response | right pad]`` with the prompt left-padded to ``P`` slots and
the response right-padded to ``R`` slots, so every RL batch of a run has the shape ``[B * K, P + R]`` and
the update compiles once. ``mask`` is 1 on response tokens; ``old_logp[:, t]`` is the log-prob of
``tokens[:, t]`` given the tokens before it (``optim.sequence_logprobs``), so the two align.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from lspo_jax import distributed, optim, sharding
from lspo_jax.config import ModelConfig
from lspo_jax.model import Params
from lspo_jax.sampler import SampleBatch

Rows = dict[str, np.ndarray]


def pow2_rows(n: int) -> int:
    """Row buckets: a power of two, so a varying number of cliff rows compiles a bounded set of programs."""
    return 1 << max(0, (n - 1).bit_length())


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
    length = min(max_prompt + max_target, max(64, pow2_rows(need)))
    return longest_prompt, length - longest_prompt


def left_pad(seqs: Sequence[Sequence[int]], slots: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [N, slots], mask [N, slots])`` with each sequence right-aligned; error if one does not fit."""
    ids = np.zeros((len(seqs), slots), np.int32)
    mask = np.zeros((len(seqs), slots), np.int32)
    for i, seq in enumerate(seqs):
        if len(seq) > slots:
            raise ValueError(f"sequence {i} has {len(seq)} tokens, more than the {slots} slots")
        if seq:
            ids[i, slots - len(seq) :] = seq
            mask[i, slots - len(seq) :] = 1
    return ids, mask


def pack_samples(prompts: Sequence[Sequence[int]], sample: SampleBatch, prompt_slots: int) -> Rows:
    """Training rows from a sampler result; prompt ``i`` owns rows ``i * n .. i * n + n - 1``."""
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


@functools.partial(jax.jit, static_argnames=("config", "lora_scale", "temperature", "chunk_size", "micro_batches"))
def _logprobs(
    config: ModelConfig, params: Params, tokens, attention_mask, lora_scale: float, temperature: float,
    chunk_size: int | None = None, micro_batches: int = 1,
):  # fmt: skip
    return optim.grouped_logprobs(
        config, params, tokens, attention_mask, lora_scale=lora_scale, temperature=temperature,
        chunk_size=chunk_size, num_micro_batches=micro_batches,
    )  # fmt: skip


def teacher_forced_logprobs(
    config: ModelConfig, params: Params, rows: Rows, *, lora_scale: float, temperature: float, min_rows: int = 1,
    mesh: Mesh | None = None, micro_batches: int = 1, chunk_size: int | None = None,
) -> np.ndarray:  # fmt: skip
    """``log pi(tokens[t] | tokens[<t])`` at the sampling temperature, zero off the response mask.

    Rows are padded to a power-of-two count (at least ``min_rows``) first, so a varying number of rows
    reuses compiled programs. The pass runs like the RL step: rows in ``micro_batches`` groups one after
    another and the LM head in ``chunk_size`` sequence chunks, so a long rollout batch never holds every
    row's activations or a whole ``[rows, length, vocab]`` logits array; on a ``mesh``, rows are split over
    its data axes too.
    """
    count = len(rows["tokens"])
    slots = pow2_rows(max(count, min_rows))
    padded = pad_rows({k: rows[k] for k in ("tokens", "attention_mask")}, -(-slots // micro_batches) * micro_batches)
    if mesh is None:
        logp = _logprobs(
            config, params, padded["tokens"], padded["attention_mask"], lora_scale=lora_scale,
            temperature=temperature, chunk_size=chunk_size, micro_batches=micro_batches,
        )  # fmt: skip
    else:
        program = _mesh_logprobs(config, mesh, lora_scale, temperature, chunk_size, micro_batches)
        placed = mesh_rows(mesh, padded, multiple=micro_batches)
        logp = sharding.fetch(program(params, placed["tokens"], placed["attention_mask"]))
    return np.where(rows["mask"] > 0, np.asarray(logp)[:count], 0.0).astype(np.float32)


@functools.cache
def _mesh_logprobs(config: ModelConfig, mesh: Mesh, lora_scale: float, temperature: float, chunk_size, micro_batches):
    return distributed.sharded_logprobs(
        config, mesh, lora_scale=lora_scale, temperature=temperature, chunk_size=chunk_size,
        num_micro_batches=micro_batches,
    )  # fmt: skip


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
