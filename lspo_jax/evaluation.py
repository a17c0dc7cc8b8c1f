"""pass@k: the paper's first-k-slice estimator and the unbiased estimator of Chen et al. (2021)."""

from __future__ import annotations

import math

import numpy as np


def pass_at_k(correct: np.ndarray, k: int, estimator: str = "first_k") -> float:
    """Mean over problems of pass@k from ``correct`` [problems, samples] booleans.

    ``first_k``: problem passes iff any of its first k samples passes (the paper's reading of its traces).
    ``unbiased``: ``1 - C(n - c, k) / C(n, k)`` with n samples of which c pass (Chen et al. 2021, eq. 1),
    the expected first-k-slice value over all orderings of the n samples.
    """
    correct = np.asarray(correct, dtype=bool)
    if correct.ndim != 2:
        raise ValueError(f"correct must be [problems, samples], got shape {correct.shape}")
    n = correct.shape[1]
    if not 0 < k <= n:
        raise ValueError(f"k must be in 1..{n} (samples per problem), got {k}")
    if correct.shape[0] == 0:
        raise ValueError("pass_at_k of zero problems is undefined")
    if estimator == "first_k":
        return float(np.mean(np.any(correct[:, :k], axis=1)))
    if estimator == "unbiased":
        c = correct.sum(axis=1)
        fail_all = [math.comb(n - int(ci), k) / math.comb(n, k) for ci in c]
        return float(np.mean(1.0 - np.asarray(fail_all)))
    raise ValueError(f"estimator must be 'first_k' or 'unbiased', got {estimator!r}")
