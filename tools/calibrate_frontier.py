"""How far each of the demo's held-out classes is from the warm start's reach: the figures that place a class at the
frontier (mostly cliffs at the run's K, yet solved within many samples) or beyond it.

Per class (``lspo_jax.tasks.toy.CLASSES``), with the run's sampling settings and ``--samples`` draws per problem:
the per-sample accuracy; the cliff share at K (the share of problems whose K samples all fail, averaged over the
``samples // K`` disjoint slices of K samples); pass@``samples``; and the base's teacher-forced log-prob of the gold
worked solutions (per sequence, and the per-token quantiles, the share of tokens with p < 0.01 and p > 0.95).

    .venv/bin/python -m tools.calibrate_frontier [--model DIR] [--samples 64] [--k 8] [--classes a,b] \\
        [--json OUT] [dotted.key=value ...]

``--model`` is a Hugging Face directory (default: the shipped warm start); the settings are ``configs/demo.yaml``'s
with the overrides on top, seed 0 unless ``seed=`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np

from lspo_jax.train_config import ConfigError

if not __package__:  # run by its path: the repository root, where the package ``tools`` is, is not on sys.path
    sys.exit("tools/calibrate_frontier.py: run it from the repository root as python -m tools.calibrate_frontier ...")
from tools import run_main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gold_token_logprobs(policy, params, examples) -> list[np.ndarray]:
    """Each example's per-token log-probs of its gold solution under the base (temperature 1: the model's own
    likelihood, not a sampling distribution's)."""
    from lspo_jax.rl import logprobs, packing

    prompts = [ex.prompt_ids for ex in examples]
    solutions = [ex.solution_ids for ex in examples]
    slots = (max(map(len, prompts)), max(map(len, solutions)))
    batch = packing.pack_sft(prompts, solutions, *slots)
    logp, _ = jax.jit(logprobs.sequence_logprobs, static_argnums=0)(
        policy.config, params, batch["tokens"], batch["attention_mask"]
    )
    logp, mask = np.asarray(logp), batch["mask"] > 0
    return [row[m] for row, m in zip(logp, mask, strict=True)]


def class_figures(correct: np.ndarray, gold: list[np.ndarray], k: int) -> dict:
    """The figures of one class from its ``[problems, samples]`` pass table and gold token log-probs."""
    slices = correct[:, : correct.shape[1] // k * k].reshape(len(correct), -1, k)
    tokens = np.concatenate(gold)
    return {
        "problems": len(correct),
        "samples": correct.shape[1],
        "accuracy": float(correct.mean()),
        f"cliff_share_at_{k}": float((~slices.any(axis=2)).mean()),
        f"pass_at_{correct.shape[1]}": float(correct.any(axis=1).mean()),
        "gold_logprob_seq_mean": float(np.mean([g.sum() for g in gold])),
        "gold_tokens_mean": float(np.mean([g.size for g in gold])),
        "gold_token_logprob_q10_q50_q90": [float(q) for q in np.quantile(tokens, [0.1, 0.5, 0.9])],
        "gold_tokens_below_p001_per_seq": float(np.mean([(g < np.log(0.01)).sum() for g in gold])),
        "gold_token_share_above_p095": float((tokens > np.log(0.95)).mean()),
    }


def main(argv: list[str] | None = None) -> int:
    return run_main("calibrate_frontier", _calibrate, argv)


def _calibrate(argv: list[str] | None) -> int:
    # The docstring's first paragraph: its first line alone stops mid-sentence.
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--model", default=None, help="a Hugging Face directory (default: the shipped warm start)")
    p.add_argument("--samples", type=int, default=64, help="draws per problem (default 64)")
    p.add_argument("--k", type=int, default=8, help="the group size the cliff share is taken at")
    p.add_argument("--classes", default=None, help="comma-separated class names (default: all)")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides of configs/demo.yaml")
    args = p.parse_args(argv)

    from lspo_jax.config import cache_root
    from lspo_jax.job import evaluation, toy_model
    from lspo_jax.job.build import load_benchmarks, load_policy, make_verifier
    from lspo_jax.job.compiles import use_cache
    from lspo_jax.job.config import load_config
    from lspo_jax.rollout.generator import Generator
    from lspo_jax.tasks import toy

    names = args.classes.split(",") if args.classes else list(toy.CLASSES)
    unknown = sorted(set(names) - set(toy.CLASSES))
    if unknown:
        raise ConfigError(f"--classes: unknown class(es) {unknown}; known: {list(toy.CLASSES)}")
    model = args.model or toy_model.SHIPPED_MODEL
    run = load_config(
        os.path.join(ROOT, "configs", "demo.yaml"),
        [f"model.path={json.dumps(model)}", "seed=0", f"eval.n={args.samples}", *args.overrides],
    )
    use_cache(run.compile_cache)
    policy, params = load_policy(run, str(cache_root()))
    benchmarks = load_benchmarks(run, policy, [f"toy:heldout_{name}" for name in names])
    pool, generator, figures = make_verifier(run), Generator(policy), {}
    try:
        for name, (examples, _) in benchmarks.items():
            key = evaluation.benchmark_key(jax.random.key(run.seed), name)
            correct = evaluation.correct_table(run, generator, params, examples, pool, key)
            figures[name] = class_figures(correct, gold_token_logprobs(policy, params, examples), args.k)
            print(name, json.dumps(figures[name]), flush=True)
    finally:
        pool.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "seed": run.seed, "k": args.k, "classes": figures}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
