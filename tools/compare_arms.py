"""Named arms (LSPO and the DAPO baseline by default) on the same task with paired seeds, in the layout of the
paper's Table 1.

Each seed trains every arm from the same model with the same data order; an arm is a name and the config
overrides that make it (``--arm NAME:key=value,key=value``, repeatable). Two run when no ``--arm`` is given: ``dapo``
(``scaffold.enabled=false``, the baseline) and ``lspo`` (``scaffold.enabled=true``). More are built in by name
(``ARMS``): the corrections of spliced rows ``guide``, ``shaped`` and ``floor``; the supervisions of the base
``direct`` (``scaffold.supervise=base``), ``mixed`` (CHORD's mixed objective), ``sft_warmup`` (SFT then DAPO) and
``sft_lspo`` (the same SFT, then LSPO). The warm-up arms' budget is ``scaffold.warmup_tokens=N`` when given after the
arms (the other arms do not read it); without it, each seed's is what that seed's direct run spent, the sum of its
records' ``scaffold/sft_tokens`` up to ``steps`` (``warmup_budget``), so ``direct`` is listed before them and trains
first. Per
(run, benchmark) the peak of held-out pass@k and of ``gold_logprob`` (the base's log-likelihood per token of the
gold solutions) over the validation trace is taken, up to ``--horizon`` steps (default: the config's ``steps``, so
a reused run that trained longer is cut back to the matched horizon), then the mean and range over seeds per arm,
and each arm minus DAPO (the first arm, without a ``dapo`` arm) paired by seed: the mean and range of the per-seed
differences (``tools.tables``). The scaffold's own figures (cliff groups, surpass rate, per-rollout pass rate
of the re-rollouts) are reported per arm.

    .venv/bin/python -m tools.compare_arms --config configs/demo.yaml --seeds 42 43 44 --out runs/arms \\
        [--arm dapo --arm lspo --arm none:scaffold.correction=none] [--results benchmarks/RESULTS.md] \\
        [--json runs/arms/arms.json] [--plot runs/arms/arms.png] [dotted.key=value ...]

An arm's overrides apply on top of ``--config`` and the trailing overrides; a value holding commas is written in
brackets (``eval.ks=[1,4]``). Every arm's config and the seeds are checked before anything trains. Runs go to
``OUT/NAME_seedSEED``: a finished one is reused, an interrupted one resumed, one that trained fewer steps than
``steps`` resumed up to it (a study extended to a longer horizon: the tables say the steps each run trained), and a
directory holding another config's run is refused. ``--json OUT`` writes ``{"horizon": H, "arms": {NAME: {SEED:
{BENCHMARK: {METRIC: {"start", "peak", "last", "mean"}}}}}}`` (the mean over the validations after step 0) for every
held-out benchmark and metric (pass@k, accuracy, gold_logprob, gold_logprob_seq; the demo's cliff class is the
benchmark whose name holds ``cliff``); ``--plot OUT`` draws held-out pass@1 against the step per benchmark, each arm's
mean over seeds and its range.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import date

import jax
import yaml

from lspo_jax.job.compiles import use_cache
from lspo_jax.job.config import load_config
from lspo_jax.job.config_io import apply_overrides, from_dict, to_dict
from lspo_jax.job.metrics_log import read_metrics
from lspo_jax.job.run import train_run
from lspo_jax.job.summary import surpass_distribution
from lspo_jax.train_config import ConfigError
from tools import tables

if not __package__:  # run by its path: the repository root, where the package ``tools`` is, is not on sys.path
    sys.exit("tools/compare_arms.py: run it from the repository root as python -m tools.compare_arms ...")
from tools import resume_or_restart, run_main  # noqa: E402

# The built-in arms by name; DEFAULT_ARMS train, in this order, when no --arm is given.
_ADAPTER = ("scaffold.enabled=true", "scaffold.supervise=adapter")
ARMS = {
    "lspo": _ADAPTER,
    "dapo": ("scaffold.enabled=false",),
    "guide": (*_ADAPTER, "scaffold.correction=guide"),
    "shaped": (*_ADAPTER, "scaffold.correction=shaped"),
    "floor": (*_ADAPTER, "scaffold.correction=floor"),
    "direct": ("scaffold.enabled=true", "scaffold.supervise=base"),
    "mixed": ("scaffold.enabled=true", "scaffold.supervise=mixed"),
    "sft_warmup": ("scaffold.enabled=true", "scaffold.supervise=sft_warmup"),
    "sft_lspo": _ADAPTER,  # with the warm-up's budget (WARMED_ARMS)
}
# The built-in arms that read the warm-up's budget besides any arm with ``scaffold.supervise=sft_warmup``.
WARMED_ARMS = ("sft_lspo",)
DEFAULT_ARMS = ("lspo", "dapo")
# A derived SFT budget (``budget_source``) is known once the direct run has trained; the arm's config is checked
# before that with this one in its place.
BUDGET_PLACEHOLDER = "scaffold.warmup_tokens=1"
BASELINE = "dapo"
ARM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # the run directory's name before _seedSEED


def parse_arm(text: str) -> tuple[str, list[str]]:
    """``NAME`` (a built-in arm) or ``NAME:key=value,key=value`` as ``(NAME, overrides)``; a ``ConfigError`` that
    names the argument otherwise."""
    name, sep, spec = text.partition(":")
    if not ARM_NAME.fullmatch(name):
        raise ConfigError(f"--arm {text!r}: write NAME:key=value,... with NAME of letters, digits, '.', '_', '-'")
    if not sep:
        if name not in ARMS:
            raise ConfigError(f"--arm {name}: not a built-in arm ({', '.join(ARMS)}); write {name}:key=value,...")
        return name, list(ARMS[name])
    if name in ARMS:
        raise ConfigError(f"--arm {text!r}: {name} is built in ({', '.join(ARMS[name])}); give the variant a new name")
    overrides: list[str] = []
    for piece in spec.split(","):
        if overrides and _open_brackets(overrides[-1]):  # a comma inside [..] or {..} belongs to the value
            overrides[-1] += "," + piece
        elif "=" in piece and piece.partition("=")[0]:
            overrides.append(piece)
        else:
            raise ConfigError(f"--arm {text!r}: {piece!r} is not key=value (write NAME:key=value,key=value)")
    return name, overrides


def _open_brackets(override: str) -> bool:
    value = override.partition("=")[2]
    return value.count("[") > value.count("]") or value.count("{") > value.count("}")


def parse_arms(items: list[str], base_config, budget: Sequence[str] = ()) -> dict[str, list[str]]:
    """Arm name -> overrides of every ``--arm`` (the built-in arms without any), each checked to make a valid config
    on ``base_config``: a bad one fails here, before anything trains, naming its arm and key. ``budget``: the
    ``scaffold.warmup_tokens=N`` given after the arms, added to the arms that warm up (the config refuses it
    elsewhere)."""
    arms: dict[str, list[str]] = {}
    for name, overrides in [parse_arm(item) for item in items] or [(n, list(ARMS[n])) for n in DEFAULT_ARMS]:
        if name in arms:
            raise ConfigError(f"--arm {name}: given twice")
        if warms_up(base_config, name, overrides):
            overrides = [*overrides, *budget]
        checked = overrides
        if budget_source(base_config, arms, name, overrides) is not None:
            checked = [*overrides, BUDGET_PLACEHOLDER]  # checked here, its budget read once direct has run
        elif name in WARMED_ARMS and not budget:  # without its budget the arm would run plain LSPO under its name
            raise ConfigError(f"--arm {name}: the SFT warm-up budget is given nowhere; give scaffold.warmup_tokens=N "
                              "after the arms or list a direct arm before it")  # fmt: skip
        try:
            from_dict(type(base_config), apply_overrides(to_dict(base_config), checked))
        except ConfigError as err:
            raise ConfigError(f"--arm {name}: {err}") from err
        arms[name] = overrides
    return arms


def warms_up(base_config, name: str, overrides: list[str]) -> bool:
    """Whether arm ``name`` starts with the SFT warm-up: SFT then DAPO (``scaffold.supervise=sft_warmup``) or a
    built-in arm of ``WARMED_ARMS`` (SFT then LSPO)."""
    made = apply_overrides(to_dict(base_config), overrides)["scaffold"]
    return made.get("supervise") == "sft_warmup" or name in WARMED_ARMS  # a variant may not take a built-in name


def budget_source(base_config, earlier: dict[str, list[str]], name: str, overrides: list[str]) -> str | None:
    """The arm an SFT warm-up arm takes its budget from: the last of the ``earlier`` arms that supervises the base
    directly (``scaffold.supervise=base``), when the warm-up's own budget is given nowhere; None for any other arm
    or a budget that is given."""
    made = apply_overrides(to_dict(base_config), overrides)["scaffold"]
    if not warms_up(base_config, name, overrides) or made.get("warmup_tokens") is not None:
        return None
    direct = [name for name, o in earlier.items() if apply_overrides(to_dict(base_config), o)["scaffold"].get(
        "supervise") == "base"]  # fmt: skip
    return direct[-1] if direct else None


def warmup_budget(out_root: str, direct: str, seed: int, steps: int) -> int:
    """The SFT tokens the ``direct`` arm's run of ``seed`` spent over its first ``steps`` steps: the sum of its train
    records' ``scaffold/sft_tokens`` (``sft_steps`` passes over each step's cliff solutions), what ``sft_warmup``
    spends all at once before its first step. A ``ConfigError`` when that run is missing or spent nothing."""
    path = os.path.join(out_root, f"{direct}_seed{seed}", "metrics.jsonl")
    if not os.path.exists(path):
        raise ConfigError(f"the SFT warm-up's budget is {direct}'s SFT tokens, and {path} does not exist")
    spent = sum(int(r.get("scaffold/sft_tokens") or 0) for r in read_metrics(path)
                if r.get("kind", "train") == "train" and r["step"] <= steps)  # fmt: skip
    if spent <= 0:
        raise ConfigError(f"{path}: {direct} spent no SFT tokens in {steps} steps; give scaffold.warmup_tokens")
    return spent


def check_seeds(seeds: list[int]) -> None:
    """Refuse (``ConfigError``) a seed given twice: its runs would share one directory and one table cell."""
    twice = sorted({seed for seed in seeds if seeds.count(seed) > 1})
    if twice:
        raise ConfigError(f"--seeds: {', '.join(map(str, twice))} given twice; give each seed once")


def cell_config(base_config, overrides: list[str], seed: int):
    return from_dict(type(base_config), apply_overrides(to_dict(base_config), [f"seed={seed}", *overrides]))


def check_reusable(
    base_config, name: str, overrides: list[str], seed: int, out_root: str, ignore: tuple[str, ...] = ()
) -> None:
    """Refuse (``ConfigError``) a run directory ``run_cell`` would reuse or resume that holds a run of another
    config: an arm name given new overrides would otherwise be tabulated from the old run. ``steps`` may differ
    (the horizon cuts a longer run back), the keys in ``ignore``, and the knobs of a scaffold the run never used
    (``unread_keys``): a DAPO run is the same run under a config that changes only the adapter's SFT."""
    path = os.path.join(out_root, f"{name}_seed{seed}", "config.yaml")
    if not os.path.exists(path):
        return
    with open(path) as f:
        saved = _flat(yaml.safe_load(f) or {})
    config = cell_config(base_config, overrides, seed)
    wanted, unread = _flat(to_dict(config)), unread_keys(config)
    for key in (k for k in wanted if k in saved and k != "steps" and k not in ignore and k not in unread):
        if saved[key] != wanted[key]:
            raise ConfigError(f"{path}: a run with {key}={saved[key]!r}, not {wanted[key]!r}; give the arm another "
                              "name or --out")  # fmt: skip


# The scaffold's keys that a run whose steps use no cliffs (DAPO, SFT then DAPO) still reads: whether it is on, what
# it supervises, the warm-up's budget, and what a cliff is (its records count them).
READ_WITHOUT_CLIFFS = (
    "scaffold.enabled", "scaffold.supervise", "scaffold.warmup_tokens", "scaffold.cliff_max_successes",
)  # fmt: skip


def unread_keys(config) -> set[str]:
    """The keys ``config``'s run never reads: with no step acting on its cliffs, the adapter's shape and the
    scaffold's knobs but ``READ_WITHOUT_CLIFFS``."""
    if config.scaffold.uses_cliffs:
        return set()
    keys = _flat(to_dict(config))
    return {k for k in keys if k.startswith(("scaffold.", "model.lora.")) and k not in READ_WITHOUT_CLIFFS}


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def run_cell(base_config, name: str, overrides: list[str], seed: int, out_root: str, tool: str) -> dict:
    """Train ``base_config`` with ``overrides`` and ``seed`` into ``out_root/NAME_seedSEED``: a run there that
    trained ``steps`` or more is reused; an interrupted one, or one that finished fewer steps (a study extended to a
    longer horizon), is resumed up to ``steps``, so a comparison stopped midway picks up where it was. Returns the
    run's summary and records under ``arm`` = ``name``, and whether its scaffold was on; a run stopped by SIGTERM or
    Ctrl-C ends the tool (status 75)."""
    config = cell_config(base_config, overrides, seed)
    out = os.path.join(out_root, f"{name}_seed{seed}")
    summary_path = os.path.join(out, "summary.json")
    summary = None
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
    if summary is not None and not summary["stopped_early"] and summary["steps"] < config.steps:
        print(f"{tool}: {name} seed {seed} finished at step {summary['steps']}; resuming it to steps={config.steps}",
              file=sys.stderr)  # fmt: skip
    if summary is None or summary["stopped_early"] or summary["steps"] < config.steps:
        resume = resume_or_restart(out, tool)
        # The runs' own lines do not name the arm or the seed: this one says which run they are of.
        print(f"{tool}: {'resuming' if resume else 'training'} {name} seed {seed} to step {config.steps} in {out}",
              file=sys.stderr, flush=True)  # fmt: skip
        summary = train_run(config, out, resume=resume)
    else:
        print(f"{tool}: {name} seed {seed}: reusing the run in {out} (step {summary['steps']})", file=sys.stderr)
    if summary["stopped_early"]:  # its checkpoint is written; go no further
        print(f"{tool}: {name} seed {seed} stopped at step {summary['steps']}; run again to resume", file=sys.stderr)
        raise SystemExit(75)
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    evals = [r for r in records if r.get("kind") == "eval"]
    train = [r for r in records if r.get("kind", "train") == "train"]
    return {"arm": name, "seed": seed, "summary": summary, "evals": evals, "train": train, "steps": config.steps,
            "scaffold": config.scaffold.uses_cliffs}  # fmt: skip


def traces(results: list[dict]) -> list[tables.RunTrace]:
    return [tables.RunTrace(r["arm"], r["seed"], tuple(r["evals"]), steps=r.get("steps")) for r in results]


def peak_table(
    results: list[dict], ks: list[int], horizon: int | None, baseline: str = BASELINE
) -> tuple[tables.PeakTable, str]:
    """Peak held-out pass@k (and gold_logprob, where recorded) per (run, benchmark), per arm and seed
    (``tools.tables``), ``baseline`` the arm the others are paired with (the first arm when it has no runs), up
    to ``horizon`` (None: the runs' ``steps``), and the line that says which horizon it was."""
    runs = traces(results)
    horizon, horizon_line = tables.resolve_horizon(runs, horizon)
    arms = list(dict.fromkeys(r.arm for r in runs))
    baseline = baseline if baseline in arms else arms[0]
    return tables.peak_table(runs, ks=ks, horizon=horizon, baseline=baseline), horizon_line


def scaffold_figures(results: list[dict], arms: list[str]) -> str:
    """Per arm and seed, over the whole run: the steps it trained (a reused run may have trained past the
    horizon), cliff groups, and with the scaffold on the groups it surpassed, the surpass rate, the re-rollouts
    verified and the per-rollout pass rate."""
    rows = ["| arm | seed | steps trained | cliff groups | surpassed | surpass rate | re-rollouts verified | "
            "per-rollout pass rate |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    rate = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"
    for r in sorted(results, key=lambda r: (arms.index(r["arm"]), r["seed"])):
        s = r["summary"]
        run = f"| {r['arm']} | {r['seed']} | {s['steps']} | {s['cliff_groups']} |"
        if not r.get("scaffold", True):
            rows.append(f"{run} scaffold off | | | |")
            continue
        rows.append(f"{run} {s['surpassed_groups']} | "
                    f"{rate(s['surpass_rate'])} | {s['rerolls_passed']} of {s['rerolls']} | "
                    f"{rate(s['rescue_pass_rate'])} |")  # fmt: skip
    return "\n".join(rows)


CARRIED = ("spliced_log_ratio_q10", "spliced_log_ratio_q50", "spliced_log_ratio_q90", "spliced_token_share",
           "spliced_grad_share")  # fmt: skip


def spliced_figures(results: list[dict], arms: list[str]) -> str:
    """Per arm with the scaffold on, what its spliced rows carried into the updates: the mean over its runs' steps
    that spliced rows of each step's log-ratio quantiles (log pi_theta / pi_mu over spliced tokens), their share
    of the update's tokens and, where recorded (``scaffold.grad_share``), of its gradient norm."""
    rows = ["| arm | steps with spliced rows | log ratio q10 | q50 | q90 | token share | gradient-norm share |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm in arms:
        steps = [r for res in results if res["arm"] == arm and res.get("scaffold", True) for r in res["train"]
                 if r.get("spliced_token_share") is not None]  # fmt: skip
        if not steps:
            continue
        means = [statistics.fmean(v) if (v := [r[k] for r in steps if r.get(k) is not None]) else None for k in CARRIED]
        cells = [f"{m:.3f}" if m is not None and i < 3 else ("n/a" if m is None else f"{100 * m:.1f}%")
                 for i, m in enumerate(means)]  # fmt: skip
        rows.append(f"| {arm} | {len(steps)} | " + " | ".join(cells) + " |")
    return "\n".join(rows) if len(rows) > 2 else "No arm spliced a row."


def surpass_spread(results: list[dict], arms: list[str]) -> str:
    """Per arm with the scaffold on, the per-step surpass rate's distribution over its runs' cliff-bearing steps,
    beside the paper's."""
    lines = []
    for arm in arms:
        mine = [res for res in results if res["arm"] == arm and res.get("scaffold", True)]
        if not mine:
            continue
        spread = surpass_distribution([r for res in mine for r in res["train"]])
        lines.append(f"{arm}: no step attempted a cliff." if spread is None else
                     f"{arm}: per-step surpass rate over {spread['steps']} cliff-bearing steps: "
                     f"{100 * spread['at_0']:.1f}% at 0.0, {100 * spread['at_1']:.1f}% at 1.0 (paper: 31% at 0.0, "
                     "21% at 1.0).")  # fmt: skip
    return "\n".join(lines) or "No arm has the scaffold on."


def main(argv: list[str] | None = None) -> int:
    return run_main("compare_arms", _compare, argv)


def _compare(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description="Named arms (default: LSPO and DAPO) with paired seeds.")
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--arm", action="append", default=[], metavar="NAME[:KEY=VALUE,...]",
                   help=f"an arm: a built-in name ({', '.join(ARMS)}) or NAME:overrides; repeatable (default: "
                        f"{' and '.join(DEFAULT_ARMS)})")  # fmt: skip
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    p.add_argument("--out", default="runs/arms")
    p.add_argument("--horizon", type=int, default=None, help="only validation steps <= this count (default: steps)")
    p.add_argument("--results", default=None, help="append the tables to this Markdown file")
    p.add_argument("--json", default=None, help="write start, peak and last of every held-out metric per run here")
    p.add_argument("--plot", default=None, help="draw held-out pass@1 per benchmark, every arm, into this PNG")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    check_seeds(args.seeds)
    # The warm-up's budget is its arm's alone: the base config of the other arms would refuse it.
    budget = [o for o in args.overrides if o.partition("=")[0].strip() == "scaffold.warmup_tokens"]
    base = load_config(args.config, [o for o in args.overrides if o not in budget])
    arms = parse_arms(args.arm, base, budget)
    sources = {name: budget_source(base, dict(list(arms.items())[:i]), name, o)
               for i, (name, o) in enumerate(arms.items())}  # fmt: skip
    for name, overrides in arms.items():
        for seed in args.seeds:  # a derived budget is checked once it is known (``budgeted``), the rest here
            derived = sources[name] is not None
            checked = [*overrides, BUDGET_PLACEHOLDER] if derived else overrides
            check_reusable(base, name, checked, seed, args.out, ("scaffold.warmup_tokens",) if derived else ())
    use_cache(base.compile_cache)  # the arms share their programs, and a rerun reads them back
    start = time.perf_counter()
    results = [run_cell(base, name, budgeted(base, name, overrides, seed, args.out, sources[name]), seed, args.out,
                        "compare_arms") for seed in args.seeds for name, overrides in arms.items()]  # fmt: skip
    minutes = (time.perf_counter() - start) / 60
    table, horizon_line = peak_table(results, list(base.eval.ks), args.horizon)
    command = " ".join(["-m tools.compare_arms", *(argv if argv is not None else sys.argv[1:])])
    text = "\n\n".join([
        f"## {' vs '.join(arms)} on `{args.config}` ({date.today().isoformat()})",
        provenance(command, len(results), minutes),
        arms_line(arms),
        tables.caption(table),
        horizon_line,
        tables.markdown(table),
        "Per seed:",
        tables.markdown_per_seed(table),
        "The scaffold's mechanism figures per arm (whole run; paper: 43% surpassed, 5.8% per-rollout pass rate):",
        scaffold_figures(results, list(arms)),
        surpass_spread(results, list(arms)),
        "What the spliced rows carried into the updates (means over the steps that spliced rows):",
        spliced_figures(results, list(arms)),
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


def budgeted(base_config, name: str, overrides: list[str], seed: int, out_root: str, source: str | None) -> list[str]:
    """``overrides``, with the SFT warm-up's budget read from the ``source`` arm's run of ``seed`` when it has one
    (``budget_source``), said in one line and checked against a run already in the arm's directory."""
    if source is None:
        return overrides
    tokens = warmup_budget(out_root, source, seed, cell_config(base_config, [], seed).steps)
    print(f"compare_arms: {name} seed {seed}: scaffold.warmup_tokens={tokens}, what {source} spent", file=sys.stderr)
    overrides = [*overrides, f"scaffold.warmup_tokens={tokens}"]
    check_reusable(base_config, name, overrides, seed, out_root)
    return overrides


def arms_line(arms: dict[str, list[str]]) -> str:
    """What each arm changed on the config, so a table row can be traced to its runs' settings."""
    return "Arms (overrides on the config): " + "; ".join(f"{name} = `{' '.join(overrides) or 'the config as given'}`"
                                for name, overrides in arms.items()) + "."  # fmt: skip


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
