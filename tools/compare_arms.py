"""LSPO against the DAPO baseline on the same task with paired seeds, in the layout of the paper's Table 1.

Each seed trains both arms from the same model with the same data order; the arms differ only in
``scaffold.enabled``. Per (run, benchmark, k) the peak of held-out pass@k over the validation trace is taken,
up to ``--horizon`` steps (default: the config's ``steps``, so a reused run that trained longer is cut back to
the matched horizon), then the mean and range over seeds per arm, and the difference LSPO - DAPO (the tables of
``tools/compare_runs.py``, from ``lspo_jax.tables``). The scaffold's own figures
(cliff groups, surpass rate, per-rollout pass rate of the re-rollouts) are reported beside it.

    .venv/bin/python tools/compare_arms.py --config configs/demo.yaml --seeds 42 43 44 --out runs/arms \\
        [--results benchmarks/RESULTS.md] [--json runs/arms/arms.json] [--plot runs/arms/arms.png] \\
        [dotted.key=value ...]

``--json OUT`` writes ``{"horizon": H, "arms": {ARM: {SEED: {BENCHMARK: {METRIC: {"start", "peak", "last"}}}}}}``
for every held-out benchmark and metric (the demo's cliff class is the benchmark whose name holds ``cliff``);
``--plot OUT`` draws held-out pass@1 against the step per benchmark, each arm's mean over seeds and its range.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import date

import jax

from lspo_jax import tables
from lspo_jax.cli import has_checkpoint
from lspo_jax.metrics_log import read_metrics
from lspo_jax.run import surpass_distribution, train_run
from lspo_jax.train_config import apply_overrides, from_dict, load_config, to_dict

ARMS = {"lspo": True, "dapo": False}


def run_arm(base_config, arm: str, seed: int, out_root: str) -> dict:
    return run_cell(base_config, arm, [f"scaffold.enabled={str(ARMS[arm]).lower()}"], seed, out_root, "compare_arms")


def run_cell(base_config, name: str, overrides: list[str], seed: int, out_root: str, tool: str) -> dict:
    """Train ``base_config`` with ``overrides`` and ``seed`` into ``out_root/NAME_seedSEED``: a finished run there is
    reused and an interrupted one resumed, so a comparison stopped midway picks up where it was. Returns the run's
    summary and records under ``arm`` = ``name``; a run stopped by SIGTERM or Ctrl-C ends the tool (status 75)."""
    config = from_dict(type(base_config), apply_overrides(to_dict(base_config), [f"seed={seed}", *overrides]))
    out = os.path.join(out_root, f"{name}_seed{seed}")
    summary_path = os.path.join(out, "summary.json")
    summary = None
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
    if summary is None or summary["stopped_early"]:
        summary = train_run(config, out, resume=has_checkpoint(out))
    if summary["stopped_early"]:  # its checkpoint is written; go no further
        print(f"{tool}: {name} seed {seed} stopped at step {summary['steps']}; run again to resume", file=sys.stderr)
        raise SystemExit(75)
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    evals = [r for r in records if r.get("kind") == "eval"]
    train = [r for r in records if r.get("kind", "train") == "train"]
    return {"arm": name, "seed": seed, "summary": summary, "evals": evals, "train": train, "steps": config.steps}


def traces(results: list[dict]) -> list[tables.RunTrace]:
    return [tables.RunTrace(r["arm"], r["seed"], tuple(r["evals"]), steps=r.get("steps")) for r in results]


def peak_table(results: list[dict], ks: list[int], horizon: int | None) -> tuple[tables.PeakTable, str]:
    """Peak held-out pass@k per (run, benchmark, k), per arm and seed (``lspo_jax.tables``, DAPO the baseline),
    up to ``horizon`` (None: the runs' ``steps``), and the line that says which horizon it was."""
    runs = traces(results)
    horizon, horizon_line = tables.resolve_horizon(runs, horizon)
    return tables.peak_table(runs, ks=ks, horizon=horizon, baseline="dapo"), horizon_line


def scaffold_figures(results: list[dict]) -> str:
    rows = ["| seed | cliff groups | surpassed | surpass rate | re-rollouts verified | per-rollout pass rate |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for r in sorted((r for r in results if r["arm"] == "lspo"), key=lambda r: r["seed"]):
        s = r["summary"]
        rate = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"
        rows.append(f"| {r['seed']} | {s['cliff_groups']} | {s['surpassed_groups']} | {rate(s['surpass_rate'])} | "
                    f"{s['rerolls_passed']} of {s['rerolls']} | {rate(s['rescue_pass_rate'])} |")  # fmt: skip
    dapo = [r["summary"]["cliff_groups"] for r in results if r["arm"] == "dapo"]
    rows.append(f"\nDAPO arm cliff groups per seed (left unrescued): {dapo}")
    return "\n".join(rows)


def surpass_spread(results: list[dict]) -> str:
    """The per-step surpass rate's distribution over all LSPO runs' cliff-bearing steps, beside the paper's."""
    spread = surpass_distribution([r for res in results if res["arm"] == "lspo" for r in res["train"]])
    if spread is None:
        return "No LSPO step attempted a cliff."
    return (
        f"Per-step surpass rate over {spread['steps']} cliff-bearing LSPO steps: {100 * spread['at_0']:.1f}% "
        f"at 0.0, {100 * spread['at_1']:.1f}% at 1.0 (paper: 31% at 0.0, 21% at 1.0)."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="LSPO vs DAPO with paired seeds.")
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    p.add_argument("--out", default="runs/arms")
    p.add_argument("--horizon", type=int, default=None, help="only validation steps <= this count (default: steps)")
    p.add_argument("--results", default=None, help="append the tables to this Markdown file")
    p.add_argument("--json", default=None, help="write start, peak and last of every held-out metric per run here")
    p.add_argument("--plot", default=None, help="draw held-out pass@1 per benchmark, both arms, into this PNG")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    base = load_config(args.config, args.overrides)
    start = time.perf_counter()
    results = [run_arm(base, arm, seed, args.out) for seed in args.seeds for arm in ARMS]
    minutes = (time.perf_counter() - start) / 60
    table, horizon_line = peak_table(results, list(base.eval.ks), args.horizon)
    command = " ".join(["tools/compare_arms.py", *(argv if argv is not None else sys.argv[1:])])
    text = "\n\n".join([
        f"## LSPO vs DAPO on `{args.config}` ({date.today().isoformat()})",
        provenance(command, len(results), minutes),
        tables.caption(table),
        horizon_line,
        tables.markdown(table),
        "Per seed:",
        tables.markdown_per_seed(table),
        "The scaffold's mechanism figures (LSPO arm, whole run; paper: 43% surpassed, 5.8% per-rollout pass rate):",
        scaffold_figures(results),
        surpass_spread(results),
    ])  # fmt: skip
    print(text)
    runs, horizon = traces(results), table.horizon
    if args.json:
        with open(args.json, "w") as f:
            json.dump(tables.start_peak_last(runs, horizon), f, indent=1)
        print(f"compare_arms: wrote {args.json}")
    if args.plot:
        print(f"compare_arms: wrote {tables.plot_curves(runs, args.plot, horizon=horizon)}")
    append_results(args.results, text)
    return 0


def provenance(command: str, runs: int, minutes: float) -> str:
    """The line that says how the tables were made: the command, the runs, their time and the machine."""
    return (f"Command: `.venv/bin/python {command}`; {runs} runs in {minutes:.1f} min on {platform.machine()} "
            f"({os.cpu_count()} cores, jax {jax.__version__} {jax.default_backend()}).")  # fmt: skip


def append_results(path: str | None, text: str) -> None:
    """Append the tables to the Markdown file ``path`` (``--results``), when one is given."""
    if path:
        with open(path, "a") as f:
            f.write("\n" + text + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
