"""How strong a scaffold is, set against the paper's: per variant of the scaffold's knobs, the three figures the
paper reports of its own (per-rollout pass rate of the re-rolls, surpass rate of the attempted cliff groups, and the
share of cliff-bearing steps that surpassed none and all of their cliffs), from short runs.

Each ``--arm NAME:key=value,...`` (``tools.compare_arms``'s syntax; the built-in names too) trains ``--steps`` steps
per seed with validation off (the figures are the training records'), into ``OUT/NAME_seedSEED``; a finished run is
reused, an interrupted one resumed. The table has one row per arm, its seeds pooled (the counts summed) and the
seeds' range, and says which figures fall in the paper's band (``PAPER``).

    .venv/bin/python -m tools.calibrate_scaffold --config configs/demo_horizon.yaml --seeds 42 43 --steps 40 \\
        --out runs/calibrate --arm today:scaffold.sft_steps=8 --arm s2:scaffold.sft_steps=2 [--json OUT]

Why two of the four figures may stay out of reach of any scaffold knob: the share of steps that surpass none (or
all) of their cliffs depends on how many cliffs a step attempts. With c cliffs a step, each surpassed with
probability s independently, (1 - s)^c of the steps surpass none; the paper's 31% at s = 0.43 means c near 1,
while a step of the demo attempts several. The table gives the cliffs attempted per step beside them.
"""

from __future__ import annotations

import argparse
import json
import sys

from lspo_jax.job.compiles import use_cache
from lspo_jax.job.config import load_config
from lspo_jax.job.summary import surpass_distribution

if not __package__:  # run by its path: the repository root, where the package ``tools`` is, is not on sys.path
    sys.exit("tools/calibrate_scaffold.py: run it from the repository root as python -m tools.calibrate_scaffold ...")
from tools import compare_arms, run_main  # noqa: E402

# The paper's figures of its scaffold (LSPO, section 5): the bands a calibrated scaffold is to fall in, and the
# per-step shares it reports (31% of cliff-bearing steps surpass none, 21% all).
PAPER = {"rollout_pass": (0.04, 0.08), "surpass": (0.35, 0.50), "steps_at_0": 0.31, "steps_at_1": 0.21}
# Training only: the figures come from the training records, and validation would cost as much as the steps.
SHORT = ("eval.enabled=false",)


def run_figures(train: list[dict]) -> dict:
    """The scaffold's figures of one run from its train records: the counts, the two rates and the per-step shares
    (``None`` where nothing was attempted or re-rolled)."""
    count = lambda key: sum(int(r.get(key) or 0) for r in train)  # noqa: E731
    attempted, surpassed, rerolls, passed = (count(k) for k in ("scaffold_attempted", "surpassed_groups", "rerolls",
                                                                 "rerolls_passed"))  # fmt: skip
    spread = surpass_distribution(train)
    return {
        "steps": len(train), "attempted": attempted, "surpassed": surpassed, "rerolls": rerolls, "passed": passed,
        "steps_attempted": spread["steps"] if spread else 0,
        "rollout_pass": passed / rerolls if rerolls else None,
        "surpass": surpassed / attempted if attempted else None,
        "steps_at_0": spread["at_0"] if spread else None,
        "steps_at_1": spread["at_1"] if spread else None,
    }  # fmt: skip


def pooled(runs: list[dict]) -> dict:
    """The figures of several runs of one arm: counts summed (so each rate is over all its re-rolls or groups), each
    per-step share over all their cliff-bearing steps, and per figure the range over the runs."""
    total = {k: sum(r[k] for r in runs) for k in ("steps", "attempted", "surpassed", "rerolls", "passed")}
    steps = [r["steps_attempted"] for r in runs]

    def share(key: str) -> float | None:
        return sum(r[key] * n for r, n in zip(runs, steps, strict=True) if n) / sum(steps) if sum(steps) else None

    out = {
        **total,
        "rollout_pass": total["passed"] / total["rerolls"] if total["rerolls"] else None,
        "surpass": total["surpassed"] / total["attempted"] if total["attempted"] else None,
        "steps_at_0": share("steps_at_0"),
        "steps_at_1": share("steps_at_1"),
        "cliffs_per_step": total["attempted"] / sum(steps) if sum(steps) else None,
    }
    for key in ("rollout_pass", "surpass", "steps_at_0", "steps_at_1"):
        values = [r[key] for r in runs if r[key] is not None]
        out[f"{key}_range"] = (min(values), max(values)) if values else None
    return out


def in_band(figures: dict) -> dict[str, bool]:
    """Which of the two banded figures fall in the paper's band."""
    return {key: figures[key] is not None and PAPER[key][0] <= figures[key] <= PAPER[key][1]
            for key in ("rollout_pass", "surpass")}  # fmt: skip


def table(arms: dict[str, list[str]], figures: dict[str, dict]) -> str:
    """The calibration table: per arm its overrides, the cliffs it attempted a step and the four figures, pooled
    over its seeds with their range, the banded ones marked when in the paper's band."""
    pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}"  # noqa: E731

    def cell(f: dict, key: str, band: dict | None = None) -> str:
        spread = "" if f[f"{key}_range"] is None else f" [{pct(f[f'{key}_range'][0])}, {pct(f[f'{key}_range'][1])}]"
        return pct(f[key]) + spread + (" in band" if band and band.get(key) else "")

    rows = ["| arm | overrides | cliffs attempted a step | per-rollout pass % | surpass % | steps surpassing none % "
            "| steps surpassing all % |", "|---|---|---|---|---|---|---|",
            f"| paper | | | {pct(PAPER['rollout_pass'][0])}-{pct(PAPER['rollout_pass'][1])} | "
            f"{pct(PAPER['surpass'][0])}-{pct(PAPER['surpass'][1])} | {pct(PAPER['steps_at_0'])} | "
            f"{pct(PAPER['steps_at_1'])} |"]  # fmt: skip
    for name, overrides in arms.items():
        f, band = figures[name], in_band(figures[name])
        per_step = "n/a" if f["cliffs_per_step"] is None else f"{f['cliffs_per_step']:.1f}"
        figures_ = [cell(f, "rollout_pass", band), cell(f, "surpass", band), cell(f, "steps_at_0"),
                    cell(f, "steps_at_1")]  # fmt: skip
        rows.append(f"| {name} | `{' '.join(overrides)}` | {per_step} | " + " | ".join(figures_) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    return run_main("calibrate_scaffold", _calibrate, argv)


def _calibrate(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--config", default="configs/demo_horizon.yaml")
    p.add_argument("--arm", action="append", default=[], metavar="NAME[:KEY=VALUE,...]",
                   help="a variant of the scaffold's knobs, as tools.compare_arms takes it; repeatable")  # fmt: skip
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 43])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default="runs/calibrate")
    p.add_argument("--json", default=None, help="write each arm's pooled and per-seed figures here")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    compare_arms.check_seeds(args.seeds)
    base = load_config(args.config, [*args.overrides, *SHORT, f"steps={args.steps}"])
    arms = compare_arms.parse_arms(args.arm or ["lspo"], base)
    for name, overrides in arms.items():
        for seed in args.seeds:
            compare_arms.check_reusable(base, name, overrides, seed, args.out)
    use_cache(base.compile_cache)
    per_seed = {name: {seed: run_figures(compare_arms.run_cell(base, name, overrides, seed, args.out,
                                                               "calibrate_scaffold")["train"])
                       for seed in args.seeds} for name, overrides in arms.items()}  # fmt: skip
    figures = {name: pooled(list(runs.values())) for name, runs in per_seed.items()}
    print(table(arms, figures))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "steps": args.steps, "seeds": args.seeds, "arms": {
                name: {"overrides": arms[name], "pooled": figures[name], "per_seed": per_seed[name]} for name in arms}},
                f, indent=1)  # fmt: skip
        print(f"calibrate_scaffold: wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
