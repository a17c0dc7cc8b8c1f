"""Blocked attention against the einsum path on this machine: one jitted log-prob pass of the ``tiny`` preset and its
gradient, best of 3 calls after a compiling one, and the compiled program's temporary memory (XLA's estimate).

    .venv/bin/python -m tools.bench_attention
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from lspo_jax.config import ModelConfig
from lspo_jax.models import specs
from lspo_jax.rl import logprobs

if not __package__:  # run by its path: the repository root, where the package ``tools`` is, is not on sys.path
    sys.exit("tools/bench_attention.py: run it from the repository root as python -m tools.bench_attention ...")
from tools import run_main  # noqa: E402

SHAPES = ((64, 128), (4, 1024), (2, 4096))  # (rows, tokens per row): the same 8k tokens spread ever longer


def timed(config: ModelConfig, params, tokens, mask) -> tuple[float, float]:
    """``(seconds, temporary MiB)`` of the gradient of the summed log-probs."""
    grad = jax.jit(jax.grad(lambda p: jnp.sum(logprobs.sequence_logprobs(config, p, tokens, mask)[0])))
    temp_mib = grad.lower(params).compile().memory_analysis().temp_size_in_bytes / 2**20
    jax.block_until_ready(grad(params))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(grad(params))
        best = min(best, time.perf_counter() - start)
    return best, temp_mib


def main(argv: list[str] | None = None) -> int:
    return run_main("bench_attention", _bench, argv)


def _bench(argv: list[str] | None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    base = ModelConfig.preset("tiny")
    params = specs.init_params(base, jax.random.key(0))
    for rows, length in SHAPES:
        tokens = jnp.asarray(np.random.default_rng(0).integers(1, base.vocab_size, size=(rows, length)), jnp.int32)
        mask = jnp.ones((rows, length), jnp.int32)
        (te, me), (tb, mb) = (
            timed(dataclasses.replace(base, attention=a), params, tokens, mask) for a in ("einsum", "blocked")
        )
        print(
            f"rows {rows} x T {length}: einsum {te * 1e3:.0f} ms {me:.0f} MiB temp | blocked {tb * 1e3:.0f} ms "
            f"{mb:.0f} MiB temp | time ratio {tb / te:.2f} memory ratio {mb / me:.3f}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
