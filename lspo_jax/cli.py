"""Command-line entry points: ``lspo-train``, ``lspo-eval``, ``lspo-export``. Each is a thin shell."""

from __future__ import annotations

import argparse
import json
import sys


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lspo-train", description="Train with LSPO (or DAPO: scaffold.enabled=false).")
    p.add_argument("--config", help="YAML config (defaults apply to keys it does not name)")
    p.add_argument("--out", required=True, help="output directory: metrics, checkpoints, summary, plots")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. rollout.group_size=8")
    return p


def _enable_compilation_cache() -> None:
    """Keep compiled XLA programs on disk: a second run of the same shapes starts in seconds, not minutes."""
    import os

    import jax

    path = os.environ.get("LSPO_JAX_COMPILATION_CACHE", os.path.expanduser("~/.cache/lspo_jax/xla"))
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def train_main(argv: list[str] | None = None) -> int:
    args = _train_parser().parse_args(argv)
    _enable_compilation_cache()
    from lspo_jax.run import RunStopped, train_run
    from lspo_jax.train_config import ConfigError, load_config

    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"lspo-train: config error: {err}", file=sys.stderr)
        return 2
    try:
        summary = train_run(config, args.out, resume=args.resume)
    except RunStopped as err:
        print(f"lspo-train: stopped: {err}", file=sys.stderr)
        return 3
    except (FileExistsError, FileNotFoundError) as err:
        print(f"lspo-train: {err}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    _plot(args.out)
    return 0


def format_summary(summary: dict) -> str:
    """The end-of-run lines a reader compares with the paper's mechanism figures."""

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    before, after = summary.get("held_out_before") or {}, summary.get("held_out_after") or {}
    lines = [
        f"steps {summary['steps']} in {summary['seconds']} s"
        + (" (stopped early)" if summary["stopped_early"] else ""),
        f"cliff groups {summary['cliff_groups']}, surpassed {summary['surpassed_groups']} "
        f"(surpass rate {pct(summary['surpass_rate'])})",
        f"per-rollout pass rate after the scaffold {pct(summary['rescue_pass_rate'])} "
        f"({summary['rerolls_passed']} of {summary['rerolls']} re-rollouts verified)",
        f"held-out accuracy before {pct(before.get('accuracy'))}, after {pct(after.get('accuracy'))}",
    ]
    return "\n".join(lines)


def _plot(out_dir: str) -> None:
    from lspo_jax.plots import plot_run

    for path in plot_run(out_dir):
        print(f"plot: {path}")


def eval_main(argv: list[str] | None = None) -> int:
    raise SystemExit("lspo-eval: not implemented yet")


def export_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lspo-export", description="Checkpoint of a run -> Hugging Face directory.")
    p.add_argument("run_dir", help="a training run's --out directory")
    p.add_argument("out", help="directory to write (config.json, model.safetensors, tokenizer files)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    args = p.parse_args(argv)
    from lspo_jax.export import export_checkpoint

    path = export_checkpoint(args.run_dir, args.out, step=args.step)
    print(json.dumps({"exported": path}))
    return 0
