"""Command-line entry points: ``lspo-train``, ``lspo-eval``, ``lspo-export``, each a thin shell. Each parses its
options and runs its body through the commands' funnel (``errors.run_command``: the exit statuses, a user error in
one line). What they drive lives elsewhere: the run (``run``), the evaluation (``eval_command``), the export
(``export``); kept here are ``lspo-train``'s start-up order (device memory and the compile cache before JAX starts,
the job's processes joined before devices are listed) and its closing lines. Importing this module imports no JAX:
a command's body imports what it runs."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from lspo_jax.job import eval_command
from lspo_jax.job.errors import (
    EXIT_CONFIG,
    EXIT_INTERRUPTED,
    EXIT_ROLLOUT,
    EXIT_STOPPED,
    has_checkpoint,
    run_command,
    until_stopped,
)


def _finish_on_terminate() -> None:
    """Once training has ended, a SIGTERM comes while the run closes its engine and verifier and plots: not a
    stop during start-up, and nothing left to checkpoint. The first is let finish, with a line; a second ends the
    process at once."""

    def finishing(signum, frame):
        print("lspo-train: finishing the run (closing, plotting); a second SIGTERM ends it at once", file=sys.stderr)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, finishing)


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lspo-train",
        description="Train with LSPO (or DAPO: scaffold.enabled=false).",
        epilog=f"Exit status: 0 finished; {EXIT_CONFIG} bad config, data, path or checkpoint (nothing ran); 3 stopped "
        f"after non-finite updates in a row; {EXIT_ROLLOUT} stopped on a rollout error (the engine did not sample the "
        "policy: its log-probs off the trainer's, a checkpoint written first; or the adapter not on); "
        f"{EXIT_STOPPED} stopped by SIGTERM or Ctrl-C with a checkpoint written "
        f"(--resume continues it); {EXIT_INTERRUPTED} interrupted during start-up.",
    )
    p.add_argument("--config", help="YAML config (defaults apply to keys it does not name); a new run needs one")
    p.add_argument(
        "--out", help="output directory: metrics, checkpoints, summary, plots (not needed to --print-config a new run)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --out (with its config.yaml when --config is not given)",
    )
    p.add_argument(
        "--print-config", action="store_true", help="print the resolved config as YAML and exit (no --config: defaults)"
    )
    p.add_argument(
        "--no-plots",
        action="store_true",
        help="no PNG curves at the end (seconds); python -m tools.plot_metrics draws them from metrics.jsonl later",
    )
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. rollout.group_size=8")
    return p


def _train_config(args):
    """The run's config: ``--config`` (or, resuming without one, the run's own ``config.yaml``) and overrides."""
    from lspo_jax.job.config import load_config
    from lspo_jax.train_config import ConfigError

    saved = os.path.join(args.out, "config.yaml") if args.out else None
    if args.resume and not has_checkpoint(args.out):
        raise FileNotFoundError(f"nothing to resume in {args.out}: it holds no checkpoint")
    config_path = args.config
    if config_path is None and args.resume and os.path.exists(saved):
        config_path = saved  # the run's own settings, the overrides on top
        if not args.print_config:
            print(f"lspo-train: resuming with {saved}", file=sys.stderr)
    if config_path is None and args.resume:
        raise ConfigError(f"--resume: {saved} is missing (the run's own settings); pass the run's config with --config")
    if config_path is None and args.print_config:  # printed, not run: the built-in defaults, overrides on top
        return load_config(None, args.overrides)
    if config_path is None:
        # The built-in defaults are the paper's shape (32 x 16 rollouts of 8192 tokens): no machine to run by
        # accident. configs/ has the recipes.
        raise ConfigError("--config: a new run needs a config file (configs/demo.yaml is the CPU demo, "
                          "configs/lspo_deepmath_r1_distill_qwen_1p5b.yaml the paper's recipe)")  # fmt: skip
    # Process 0 wrote config.yaml, with its own mesh.process_id: each host takes its id from the environment.
    overrides = ["mesh.process_id=null", *args.overrides] if config_path == saved else args.overrides
    return load_config(config_path, overrides)


def train_main(argv: list[str] | None = None) -> int:
    parser = _train_parser()
    # Options and key=value overrides in any order (`--config c.yaml steps=4 --out d k=v`): plain parse_args stops
    # collecting the positional overrides at the first option after them.
    args = parser.parse_intermixed_args(argv)
    if args.out is None and (args.resume or not args.print_config):
        parser.error("--out is required" + (" to resume" if args.resume else " (only --print-config runs without it)"))
    if args.out is not None and not args.out.strip():
        parser.error(f"--out {args.out!r}: name the run's directory")
    return run_command("lspo-train", _train, args, "interrupted during start-up; nothing was trained")


def _train(args) -> int:
    from lspo_jax.job.signals import StartupStopped, StopFlag

    # SIGTERM and Ctrl-C set a flag from here on, read at start-up's own points and then by the loop: a handler that
    # raised could land in a garbage-collector callback, where the exception is dropped and the run goes on.
    with StopFlag("lspo-train") as stop:
        try:
            summary = _start_and_train(args, stop)
        except StartupStopped as err:
            print(f"lspo-train: {err}", file=sys.stderr)
            return EXIT_INTERRUPTED
    if isinstance(summary, int):  # --print-config, or stopped after non-finite updates
        return summary
    _finish_on_terminate()  # the run has ended: a SIGTERM while it prints and plots lets it finish
    print(format_summary(summary))
    import jax

    if jax.process_index() == 0 and not args.no_plots:  # one writer of the run directory, as for its logs
        _plot(args.out)
    if summary.get("stopped_early"):
        print(f"lspo-train: stopped at step {summary['steps']} with a checkpoint; --resume continues it "
              f"(exit status {EXIT_STOPPED})", file=sys.stderr)  # fmt: skip
        return EXIT_STOPPED
    return 0


def _start_and_train(args, stop) -> dict | int:
    """The run's summary, or an exit status: 0 after ``--print-config``, 3 stopped after non-finite updates.
    ``stop`` (entered) is asked between the parts of start-up; the run reads it from then on."""
    from lspo_jax.job.config_io import to_dict

    config = _train_config(args)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
        return 0
    stop.startup_point()
    from lspo_jax.job.build import claim_device_memory
    from lspo_jax.job.compiles import use_cache

    config = claim_device_memory(config)  # before JAX's backends start: the allocator reads it once
    use_cache(config.compile_cache)  # before anything compiles: JAX decides once per process
    from lspo_jax.job.run import RunStopped, train_run
    from lspo_jax.models.sharding import initialize_distributed

    # Before any other JAX call: every process of a multi-host job must join before devices are listed.
    initialize_distributed(config.mesh.coordinator, config.mesh.num_processes, config.mesh.process_id)
    stop.reclaim()  # jax.distributed sets its own SIGTERM handler
    import jax

    stop.startup_point(single_process=jax.process_count() == 1)  # joined: the job's processes are known
    try:
        return train_run(config, args.out, resume=args.resume, on_finish=_finish_on_terminate, stop=stop)
    except RunStopped as err:
        print(f"lspo-train: stopped: {err}", file=sys.stderr)
        return 3


def format_summary(summary: dict) -> str:
    """The end-of-run lines a reader compares with the paper's mechanism figures, and one line per held-out
    benchmark: the per-sample accuracy, the largest-k pass@k and the gold solutions' log-likelihood (where the
    benchmark has worked solutions) before and after training."""

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    def nats(x):
        return "n/a" if x is None else f"{x:.3f}"

    session, skipped = summary.get("seconds_session", summary["seconds"]), summary.get("nonfinite_updates")
    lines = [
        f"steps {summary['steps']} in {summary['seconds']} s"
        + (f" ({session} s since the resume)" if session != summary["seconds"] else "")
        + (" (stopped early)" if summary["stopped_early"] else "")
        # An update whose loss or gradient was not finite is skipped whole: the base did not take it.
        + (f"; {skipped} updates skipped as non-finite" if skipped else ""),
        f"cliff groups {summary['cliff_groups']}, {summary['scaffold_attempted']} attempted by the scaffold "
        f"({summary['scaffold_no_solution']} without a worked solution), surpassed {summary['surpassed_groups']} "
        f"(surpass rate {pct(summary['surpass_rate'])} of those attempted)",
        f"per-rollout pass rate after the scaffold {pct(summary['rescue_pass_rate'])} "
        f"({summary['rerolls_passed']} of {summary['rerolls']} re-rollouts verified)",
    ]
    spread = summary.get("surpass_rate_per_step")
    if spread:
        lines.append(f"per-step surpass rate over {spread['steps']} cliff-bearing steps: {pct(spread['at_0'])} of them "
                     f"at 0, {pct(spread['at_1'])} at 1 (paper: 31% and 21%)")  # fmt: skip
    before, after = summary.get("held_out_before") or {}, summary.get("held_out_after") or {}
    for name in dict.fromkeys([*before, *after]):
        b, a = before.get(name) or {}, after.get(name) or {}
        ks = sorted(int(key[5:]) for key in {*b, *a} if key.startswith("pass@") and key[5:].isdigit())
        line = f"held-out {name} ({(a or b).get('problems', '?')} problems): accuracy before {pct(b.get('accuracy'))}, "
        line += f"after {pct(a.get('accuracy'))}"
        if ks:
            key = f"pass@{ks[-1]}"
            line += f"; {key} before {pct(b.get(key))}, after {pct(a.get(key))}"
        if "gold_logprob" in b or "gold_logprob" in a:
            line += f"; gold nats/token before {nats(b.get('gold_logprob'))}, after {nats(a.get('gold_logprob'))}"
        lines.append(line)
    return "\n".join(lines)


def _plot(out_dir: str) -> None:
    from lspo_jax.job.plots import plot_run

    for path in plot_run(out_dir):
        print(f"plot: {path}")


def eval_main(argv: list[str] | None = None) -> int:
    args = eval_command.parser().parse_args(argv)
    return run_command("lspo-eval", eval_command.evaluate, args, "interrupted")


def export_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lspo-export", description="Checkpoint of a run -> Hugging Face directory.")
    p.add_argument("run_dir", help="a training run's --out directory")
    p.add_argument("out", help="directory to write (config.json, model.safetensors, tokenizer files)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA RL run's policy adapter as a PEFT directory (default: the merged model)")  # fmt: skip
    args = p.parse_args(argv)
    return run_command("lspo-export", _export, args, "interrupted; nothing was exported")


def _export(args) -> int:
    """SIGTERM and Ctrl-C set a flag (``StopFlag``), read after the restore and after each tensor and file written,
    as ``lspo-eval`` reads it: a ``KeyboardInterrupt`` could land wherever Python happened to be, XLA's callbacks
    included. The files are written beside OUT (``export._staged``), so a stop leaves OUT as it was."""
    return until_stopped("lspo-export", "after the current tensor or file", "exported", _export_until_stopped, args)


def _export_until_stopped(args, stop) -> int:
    from lspo_jax.job.export import check_run_dir, export_checkpoint
    from lspo_jax.rl.checkpoint import Checkpointer

    check_run_dir(args.run_dir)
    step = args.step
    if step is None:  # the step the export restores: the latest
        checkpointer = Checkpointer(os.path.join(args.run_dir, "checkpoints"))
        try:
            step = checkpointer.latest_step()
        finally:
            checkpointer.close()
    path = export_checkpoint(args.run_dir, args.out, step=args.step, adapter=args.adapter, check=stop.startup_point)
    stop.expect("after these lines: the export is complete and kept")  # the flag is not read again
    follow_umask(path)
    print(f"lspo-export: step {step} of {args.run_dir} exported to {path}", file=sys.stderr)
    print(json.dumps({"exported": os.path.abspath(path)}))  # absolute: the line is read by scripts run elsewhere
    return 0


def follow_umask(directory: str) -> None:
    """Give the files of a fresh export the mode any new file gets (``0o666`` less the umask): safetensors writes its
    file through a temporary one, readable by its owner alone (0600), which a model shared on a cluster must not be."""
    mask = os.umask(0)
    os.umask(mask)
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)
