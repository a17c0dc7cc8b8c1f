"""Packing: rollouts and worked solutions as fixed-shape rows, their real tokens as token buffers, the buckets.

A row is ``[left pad | prompt | response | right pad]`` with the prompt left-padded to ``P`` slots and
the response right-padded to ``R`` slots, so every rollout batch of a run has the shape ``[B * K, P + R]``: the
step's host-side record. ``mask`` is 1 on response tokens; ``old_logp[:, t]`` is the log-prob of
``tokens[:, t]`` given the tokens before it (``logprobs.sequence_logprobs``), so the two align. With
``loss.packing`` the passes take ``pack_rows``' token buffers instead, which hold the rows' real tokens only.
Buckets and left padding are the sampler's (``rollout.buckets``), shared with the passes here.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from lspo_jax.models import sharding
from lspo_jax.rollout.buckets import left_pad, pow2_bucket

Arrays = Mapping[str, np.ndarray]  # per-row arrays, rows on axis 0, as a pass reads them


class Rows(Mapping[str, np.ndarray]):
    """A step's rollouts as one frozen record of per-row arrays (``tokens``, ``attention_mask``, ``mask``,
    ``lengths``, ``eos``, ``sampler_logp``; ``accuracy`` and ``reward`` once scored; ``old_logp`` once the update's
    denominators are known). A stage adds or replaces fields with ``replace`` and gets a new record: what one stage
    read is never changed under it by the next (the record's arrays are read-only views), and no field exists
    before its value does."""

    __slots__ = ("_fields",)

    def __init__(self, fields: Arrays | None = None, /, **more: np.ndarray):
        self._fields = {name: _read_only(value) for name, value in {**(fields or {}), **more}.items()}

    def __getitem__(self, name: str) -> np.ndarray:
        return self._fields[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={getattr(v, 'shape', '?')}" for k, v in self._fields.items())
        return f"Rows({shapes})"

    def replace(self, **fields: np.ndarray) -> Rows:
        """A new record with ``fields`` added or replaced."""
        return Rows(self._fields, **fields)

    def take(self, index: Any) -> Rows:
        """The rows at ``index`` (a slice, indices or a mask) of every field."""
        return Rows({name: value[index] for name, value in self._fields.items()})


def _read_only(value: Any) -> Any:
    """A read-only view of a numpy array (the caller's array stays writeable); anything else as it is."""
    if not isinstance(value, np.ndarray):
        return value
    view = value.view()
    view.setflags(write=False)
    return view


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


def pack_samples(prompts: Sequence[Sequence[int]], sample: Any, prompt_slots: int) -> Rows:
    """Training rows from a ``samples.SampleBatch``; prompt ``i`` owns rows ``i * n .. i * n + n - 1``."""
    n = sample.n
    prompt_ids, prompt_mask = left_pad([prompts[row // n] for row in range(len(sample.lengths))], prompt_slots)
    response_mask = (np.arange(sample.tokens.shape[1])[None, :] < sample.lengths[:, None]).astype(np.int32)
    return Rows(
        tokens=np.concatenate([prompt_ids, np.where(response_mask > 0, sample.tokens, 0)], axis=1),
        attention_mask=np.concatenate([prompt_mask, response_mask], axis=1),
        mask=np.concatenate([np.zeros_like(prompt_mask), response_mask], axis=1),
        lengths=sample.lengths.astype(np.int32),
        eos=sample.eos.astype(bool),
    )


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


def pad_rows(rows: Arrays, count: int) -> dict[str, np.ndarray]:
    """Append all-zero rows (masked everywhere) up to ``count`` rows."""
    return {k: np.concatenate([v, np.zeros((count - len(v), *v.shape[1:]), v.dtype)]) for k, v in rows.items()}


def mesh_rows(mesh: Mesh, rows: Arrays, *, multiple: int = 1) -> dict[str, jax.Array]:
    """``rows`` as global arrays split over the mesh's data axes, padded with masked rows to a count that
    divides by the data-parallel device count times ``multiple`` (e.g. the micro-batch count)."""
    rows = {k: np.asarray(v) for k, v in rows.items()}
    count = len(next(iter(rows.values())))
    step = sharding.batch_shards(mesh) * multiple
    return sharding.global_batch(mesh, pad_rows(rows, -(-count // step) * step))


def decode_responses(tokenizer, rows: Arrays, prompt_slots: int) -> list[str]:
    """Response texts (special tokens dropped) of packed rows, for the verifier."""
    texts = []
    for tokens, length in zip(rows["tokens"], rows["lengths"], strict=True):
        texts.append(tokenizer.decode(tokens[prompt_slots : prompt_slots + int(length)], skip_special_tokens=True))
    return texts


# ------------------------------------------------------------------------------------------ token buffers
# Packed row counts keep this many significant bits (8 buckets per octave): at most 1/8 of a packed batch's rows
# are bucket padding, and a run compiles a handful of programs per pass however its lengths vary.
_ROW_BITS = 4


def row_bucket(n: int, multiple: int = 1) -> int:
    """``n`` rounded up to ``_ROW_BITS`` significant bits, then to a multiple of ``multiple`` (at least one row)."""
    n = max(n, 1)
    grain = 1 << max(0, n.bit_length() - _ROW_BITS)
    return -(-(-(-n // grain) * grain) // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Packed:
    """Rows' real tokens in ``[rows, length]`` buffers: each source row one segment, whole, in one buffer row.

    ``arrays``: ``tokens``, ``segment_ids`` (1, 2, ... within a buffer row, 0 on empty slots), ``positions``
    (restarting at 0 per segment, as ``attention.attention_positions`` numbers a left-padded row) and the packed keys.
    ``where[i, t]`` is the flat index into a ``[rows * length]`` buffer of source slot ``(i, t)``, -1 where that
    slot held no real token; ``unpack`` uses it to bring a per-token result back to the source layout.
    """

    arrays: dict[str, np.ndarray]
    where: np.ndarray
    real_tokens: int
    micro_batches: int = 1

    @property
    def slots(self) -> int:
        return self.arrays["tokens"].size

    def unpack(self, packed: np.ndarray) -> np.ndarray:
        """A ``[rows, length]`` per-token result in the source rows' layout, 0 on their padding."""
        flat = np.asarray(packed).reshape(-1)
        return np.where(self.where >= 0, flat[np.maximum(self.where, 0)], 0).astype(flat.dtype)


def lognormal_lengths(n: int, median: float, p90: float, cap: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` lengths in ``[1, cap]`` from the log-normal with that median and 90th percentile (benchmarks' inputs:
    R1's response lengths are reported so, with a long tail cut at the cap)."""
    sigma = np.log(p90 / median) / 1.2815515655446004  # the standard normal's 90th percentile
    return np.clip(np.round(np.exp(np.log(median) + sigma * rng.standard_normal(n))), 1, cap).astype(np.int64)


def plan_rows(lengths: np.ndarray, length: int, one_per_row: bool = False) -> tuple[np.ndarray, np.ndarray, int]:
    """``(row [n], offset [n], rows)``: where each sequence of ``lengths`` goes in buffers of ``length`` slots.

    Best-fit decreasing: longest first, each into the fullest buffer row that still holds it (a sorted list of
    free spaces, ``O(n log n)``), so long sequences are not split and the rows end nearly full. Empty sequences
    are not placed (row -1). ``one_per_row`` gives every sequence its own row, at offset 0 (right padding).
    """
    n = len(lengths)
    row, offset = np.full(n, -1, np.int64), np.zeros(n, np.int64)
    free: list[tuple[int, int]] = []  # (free slots, row), sorted
    used: list[int] = []
    for i in np.argsort(-lengths, kind="stable"):
        need = int(lengths[i])
        if need == 0:
            continue
        if need > length:
            raise ValueError(f"sequence {i} has {need} tokens, more than the {length} slots of a packed row")
        j = bisect.bisect_left(free, (need, -1))
        if j < len(free):
            _, r = free.pop(j)
        else:
            r = len(used)
            used.append(0)
        row[i], offset[i] = r, used[r]
        used[r] += need
        if not one_per_row and used[r] < length:
            bisect.insort(free, (length - used[r], r))
    return row, offset, len(used)


def micro_batching(needed: int, row_multiple: int, rows_per_micro: int | None = None) -> tuple[int, int]:
    """``(buffer rows, micro-batches)`` for ``needed`` buffer rows with at most ``rows_per_micro`` (a multiple of
    ``row_multiple``) in a micro-batch: one micro-batch of ``row_bucket(needed, row_multiple)`` rows while they fit,
    else a ``row_bucket`` count of full micro-batches. Either way the row count divides by ``row_multiple``."""
    if rows_per_micro is None:
        return row_bucket(needed, row_multiple), 1
    if needed <= rows_per_micro:  # the bucket, unless it would exceed one micro-batch (a 5-bit rows_per_micro)
        return min(row_bucket(needed, row_multiple), rows_per_micro), 1
    micro = row_bucket(-(-needed // rows_per_micro))
    return micro * rows_per_micro, micro


def pack_rows(
    rows: Arrays,
    keys: Sequence[str],
    length: int,
    *,
    row_multiple: int = 1,
    rows_per_micro: int | None = None,
    one_per_row: bool = False,
) -> Packed:
    """The real tokens (``attention_mask`` 1) of ``rows`` and their ``keys`` packed into buffers of ``length``.

    A key is ``[B, T]`` (per token) or ``[B]`` (per row, e.g. advantages: broadcast over the row's tokens). The
    buffer row count and micro-batch count are ``micro_batching``'s. ``mask`` is cleared on each segment's first
    token: nothing of its own segment predicts it, and a packed row's previous slot belongs to another sequence.
    """
    real = np.asarray(rows["attention_mask"]) > 0
    rank = np.cumsum(real, axis=1) - 1
    row, offset, needed = plan_rows(real.sum(axis=1), length, one_per_row)
    count, micro = micro_batching(needed, row_multiple, rows_per_micro)
    where = np.where(real, row[:, None] * length + offset[:, None] + rank, -1)
    dest = where[real]
    segment = _segment_numbers(row, offset)

    def scatter(values: np.ndarray) -> np.ndarray:
        out = np.zeros(count * length, values.dtype)
        out[dest] = values
        return out.reshape(count, length)

    arrays = {"tokens": scatter(np.asarray(rows["tokens"])[real].astype(np.int32))}
    arrays["segment_ids"] = scatter(np.broadcast_to(segment[:, None], real.shape)[real])
    arrays["positions"] = scatter(rank[real].astype(np.int32))
    for key in keys:
        value = np.asarray(rows[key])
        value = np.broadcast_to(value[:, None], real.shape) if value.ndim == 1 else value
        if key == "mask":
            value = np.where(rank > 0, value, 0)
        arrays[key] = scatter(value[real])
    return Packed(arrays, where, int(real.sum()), micro)


def _segment_numbers(row: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """1, 2, ... by offset within each buffer row (0 for unplaced sequences)."""
    order = np.lexsort((offset, row))
    sorted_rows = row[order]
    first = np.searchsorted(sorted_rows, sorted_rows)  # index of each row's first member in the sorted order
    segment = np.zeros(len(row), np.int32)
    segment[order] = np.arange(len(row)) - first + 1
    return np.where(row >= 0, segment, 0).astype(np.int32)
