"""Make the demo's warm-started model shipped in ``lspo_jax/assets/toy_model`` (about a minute on 2 cores).

Full-parameter SFT of a 3-layer Qwen2 on generated 1-3 digit sums with worked solutions
(``lspo_jax.toy.ensure_model``). Deterministic on the CPU for a given seed.

    .venv/bin/python tools/make_toy_model.py [--steps 600] [--seed 0] [--out lspo_jax/assets/toy_model]
"""

import argparse
import shutil

from lspo_jax import toy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=toy.SHIPPED_MODEL)
    args = p.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    print(toy.ensure_model(args.out, steps=args.steps, seed=args.seed))


if __name__ == "__main__":
    main()
