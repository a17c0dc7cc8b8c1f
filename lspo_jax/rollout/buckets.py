"""Shapes that bound the compiled programs: power-of-two buckets of rows or lengths, and left-padded prompts.

The sampler buckets and left-pads its prompts with these; the training passes (``rl.packing``) bucket their rows
with the same ones, so a run compiles one set of shapes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pow2_bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= ``n`` (and >= ``minimum``): buckets of rows or lengths, so varying sizes
    compile a bounded set of programs."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


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
