"""Make the demo's warm-started model shipped in ``lspo_jax/assets/toy_model`` (several minutes on 2 cores).

Full-parameter SFT of a 3-layer Qwen2 on generated 1-3 digit sums, and a ``--frontier-share`` of three-operand
2-digit sums, with worked solutions by a teacher who drops each carry with probability ``--forget-carry``
(``lspo_jax.job.toy_model.ensure_model``). Deterministic on the CPU for a given seed.

    .venv/bin/python -m tools.make_toy_model [--steps 1200] [--seed 0] [--forget-carry 0.4] \\
        [--frontier-share 0.02] [--out lspo_jax/assets/toy_model]
"""

from __future__ import annotations

import argparse
import shutil
import sys

from lspo_jax.job import toy_model

if not __package__:  # run by its path: the repository root, where the package ``tools`` is, is not on sys.path
    sys.exit("tools/make_toy_model.py: run it from the repository root as python -m tools.make_toy_model ...")
from tools import run_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return run_main("make_toy_model", _make, argv)


def _make(argv: list[str] | None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=toy_model.WARM_START_STEPS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--forget-carry", type=float, default=toy_model.FORGET_CARRY)
    p.add_argument("--frontier-share", type=float, default=toy_model.FRONTIER_SHARE)
    p.add_argument("--out", default=toy_model.SHIPPED_MODEL)
    args = p.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    print(
        toy_model.ensure_model(
            args.out,
            steps=args.steps,
            seed=args.seed,
            forget_carry=args.forget_carry,
            frontier_share=args.frontier_share,
        )
    )


if __name__ == "__main__":
    raise SystemExit(main())
