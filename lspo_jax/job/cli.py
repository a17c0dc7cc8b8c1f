"""Command-line entry points: ``lspo-train``, ``lspo-eval``, ``lspo-export``. Each is a thin shell."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import signal
import sys
import threading
import traceback

EXIT_CONFIG = 2  # a bad config, file, path or checkpoint: nothing ran
EXIT_ROLLOUT = 4  # the rollout engine's samples were not the policy's (a rollout error); a checkpoint was written
EXIT_STOPPED = 75  # stopped by SIGTERM or Ctrl-C with a checkpoint written: `--resume` continues it (EX_TEMPFAIL)
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM before the run had started: nothing to resume from it
DEBUG_VAR = "LSPO_JAX_DEBUG"  # set (to anything but 0): a one-line error also prints its traceback


def _user_errors() -> tuple[type[BaseException], ...]:
    """The errors that come from what the user gave (a config, a path, a file, a model directory, a checkpoint)
    or from the machine (permissions, space): each ends a command in one line and ``EXIT_CONFIG``."""
    from lspo_jax.job.metrics_log import MetricsError
    from lspo_jax.rl.checkpoint import CheckpointError
    from lspo_jax.tasks.data_report import DataError
    from lspo_jax.train_config import ConfigError

    return ConfigError, DataError, CheckpointError, MetricsError, OSError


# OS errors that say what to do: (what failed, the advice). Space and a read-only file system can only be a write's,
# so they are looked for through an error's causes too (a checkpoint's write deep in orbax); permissions may be a
# read's, so only an OSError raised as it is gets that line.
RESUME_ADVICE = "a run continues from its last checkpoint with --resume"
_WRITES = {
    errno.ENOSPC: ("cannot write", f"free some space; {RESUME_ADVICE}"),
    errno.EDQUOT: ("cannot write", f"free some space; {RESUME_ADVICE}"),
    errno.EROFS: ("cannot write", "choose a writable --out"),
}
_ACCESS = {errno.EACCES: ("cannot use", "check its permissions"), errno.EPERM: ("cannot use", "check its permissions")}


def describe(err: BaseException) -> str:
    """One line for a user error: what failed, on which path, and what to do."""
    from lspo_jax.options import RolloutError
    from lspo_jax.train_config import ConfigError

    if isinstance(err, RolloutError):
        return f"rollout error: {err}"
    if isinstance(err, ConfigError):
        return f"config error: {err}"
    if _out_of_memory(err):
        first = str(err).strip().splitlines()[0][:200]
        return (
            f"the devices ran out of memory ({first}); raise loss.micro_batches or lower rollout.prompts_per_step or "
            "rollout.group_size (a run continues from its last checkpoint with --resume and the new values)"
        )
    cause, seen = err, set()
    while cause is not None and id(cause) not in seen and not _os_line(cause, _WRITES):
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    line = (_os_line(cause, _WRITES) if cause is not None else None) or _os_line(err, _ACCESS)
    if line:
        return line
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def _os_line(err: BaseException, known: dict) -> str | None:
    if not (isinstance(err, OSError) and err.errno in known):
        return None
    what, advice = known[err.errno]
    where = f" {err.filename}" if err.filename else ""
    return f"{what}{where}: {err.strerror or os.strerror(err.errno)}; {advice}"


def _run_command(prog: str, body, args, interrupted: str) -> int:
    """``body(args)``'s exit status, through one funnel: a user error (``_user_errors``) is one line and
    ``EXIT_CONFIG``, its traceback only with ``LSPO_JAX_DEBUG`` set; Ctrl-C or SIGTERM before the command's own
    handlers take over is ``interrupted`` and ``EXIT_INTERRUPTED``. Any other error is a bug: its traceback."""
    from lspo_jax.options import RolloutError

    _quiet_imports()
    try:
        with _terminate_as_interrupt():
            return body(args)
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except RolloutError as err:  # found mid-run, from the samples: not the config's fault, and not a bug here
        if os.environ.get(DEBUG_VAR, "0") not in ("", "0"):
            traceback.print_exc()
        print(f"{prog}: {describe(err)}", file=sys.stderr)
        return EXIT_ROLLOUT
    except Exception as err:
        if not (isinstance(err, _user_errors()) or _out_of_memory(err)):
            raise
        if os.environ.get(DEBUG_VAR, "0") not in ("", "0"):
            traceback.print_exc()
        print(f"{prog}: {_with_resume_advice(describe(err), getattr(args, 'out', None))}", file=sys.stderr)
        return EXIT_CONFIG


def _with_resume_advice(line: str, out: str | None) -> str:
    """``line`` without the advice to ``--resume`` where the run directory ``out`` holds no checkpoint to resume from
    (the disk filled during the first one): its records refuse the same command again, so it is removed first."""
    if RESUME_ADVICE not in line or not out or has_checkpoint(out) or not os.path.isdir(out):
        return line
    return line.replace(RESUME_ADVICE, f"{out} holds no checkpoint to resume from: remove it and start the run again")


def _finish_on_terminate() -> None:
    """Once training has ended, a SIGTERM comes while the run closes its engine and verifier and plots: not a
    stop during start-up, and nothing left to checkpoint. The first is let finish, with a line; a second ends the
    process at once."""

    def finishing(signum, frame):
        print("lspo-train: finishing the run (closing, plotting); a second SIGTERM ends it at once", file=sys.stderr)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, finishing)


def _out_of_memory(err: BaseException) -> bool:
    """XLA's allocation failure on an accelerator: a shape the devices cannot hold, not a bug of the program."""
    return type(err).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and str(err).startswith("RESOURCE_EXHAUSTED")


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM (a scheduler's stop) read as Ctrl-C until the command's own handlers replace it: a stop during
    start-up ends with the interrupted line and ``EXIT_INTERRUPTED``, the resources opened so far closed, not
    with a silent 143. The previous handler comes back afterwards (a test, a notebook)."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)  # None: set outside Python


def _quiet_imports() -> None:
    """transformers announces at import that PyTorch is absent (the JAX path never needs it), as advice:
    advice is off unless the user set ``TRANSFORMERS_NO_ADVISORY_WARNINGS`` themselves; its warnings stay."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


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


def has_checkpoint(out_dir: str) -> bool:
    """Whether ``out_dir`` holds a finished checkpoint step (orbax names them by number), without orbax."""
    directory = os.path.join(out_dir, "checkpoints")
    return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


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
    return _run_command("lspo-train", _train, args, "interrupted during start-up; nothing was trained")


def _train(args) -> int:
    from lspo_jax.signals import StartupStopped, StopFlag

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
    from lspo_jax.train_config import to_dict

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


DEFAULT_BENCHMARKS = "math500,aime24,aime25"  # the three that ship inside the package


def _eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lspo-eval",
        description="pass@k of a model on math benchmarks, sampled with the JAX sampler. Settings not given here "
        "come from the run's config.yaml (a checkpoint) or from --config / the defaults (a Hugging Face directory).",
    )
    p.add_argument(
        "--model",
        required=True,
        help="a Hugging Face directory, a hub name ORG/NAME[@REVISION] (fetched once into "
        "the Hugging Face cache), 'toy', or a training run's --out directory",
    )
    p.add_argument("--step", type=int, default=None, help="checkpoint step of a run directory (default: the latest)")
    p.add_argument("--config", default=None, help="YAML run config for a Hugging Face model (prompt, reward settings)")
    p.add_argument("--benchmarks", default=None,
                   help="comma-separated bare names, paths or hub datasets ORG/NAME[@REVISION][:PART] (default: the "
                        "config's eval.benchmarks, else a run's own held-out sets, else "
                        f"{DEFAULT_BENCHMARKS}). A bare name is looked for as NAME.jsonl or NAME.parquet in "
                        "--data-dir (else $LSPO_JAX_DATA_DIR), then among the package's math500, aime24, aime25, "
                        "then on the hub (aime26: MathArena/aime_2026)")  # fmt: skip
    p.add_argument("--data-dir", default=None, help="where bare benchmark names are looked for first (default: "
                   "eval.data_dir, else $LSPO_JAX_DATA_DIR)")  # fmt: skip
    p.add_argument("--protocol", default=None, metavar="NAME", help=_protocol_help())
    p.add_argument("--n", type=int, default=None, help="samples per problem (default: eval.n)")
    p.add_argument("--ks", default=None, help="comma-separated k (default: eval.ks; with a new n from --n or "
                   "--protocol: those of 1,4,8,16 that fit, the powers of two from 32 up to n, and n)")  # fmt: skip
    p.add_argument("--limit", type=int, default=None, help="the first N problems of each file")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: eval.max_new_tokens")
    p.add_argument("--temperature", type=float, default=None, help="default: eval.temperature")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling's p (default: eval.top_p, which "
                   "null leaves to rollout.top_p)")  # fmt: skip
    p.add_argument(
        "--prompts-per-batch", type=int, default=None, help="problems sampled together (rollout.prompts_per_step)"
    )
    p.add_argument("--workers", type=int, default=None, help="verifier processes (0: in this process; reward.workers)")
    seeds = p.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, default=None, help="sampling seed (default: the config's seed)")
    seeds.add_argument("--seeds", default=None, help="comma-separated seeds: every benchmark sampled once with each, "
                       "the output holding each repeat and the mean and standard error over them")  # fmt: skip
    p.add_argument("--out", default=None, help="write the results here as JSON")
    p.add_argument("--samples", default=None, help="write one JSON line per sample here (text, token ids, extracted "
                   "answer, reward, length, terminated; default: beside --out, its .json replaced by "
                   ".samples.jsonl)")  # fmt: skip
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. reward.require_think_close=true")
    return p


def _protocol_help() -> str:
    from lspo_jax.options import EVAL_PROTOCOLS

    listed = "; ".join(f"{p.name}: n {p.n}, temperature {p.temperature}, top-p {p.top_p}, {p.max_new_tokens} new "
                       f"tokens" for p in EVAL_PROTOCOLS.values())  # fmt: skip
    return (f"sample as a published evaluation states it ({listed}); --n, --temperature, --top-p, --max-new-tokens "
            "and eval.KEY= overrides given win, and the output records the protocol and each deviation")  # fmt: skip


def _eval_settings(run, args):
    """``run`` with this command's evaluation settings on top (each only when given): ``--protocol``'s sampling
    settings but those that a flag here or an ``eval.KEY=`` override names, then the flags."""
    from lspo_jax.options import eval_protocol
    from lspo_jax.train_config import EvalConfig, apply_overrides, from_dict, to_dict

    named = {item.partition("=")[0] for item in args.overrides}
    sampling = {}
    if args.protocol is not None:
        protocol = eval_protocol(args.protocol, "--protocol")
        stated = {f"eval.{key}": value for key, value in protocol.settings().items()}
        sampling = {"eval.protocol": protocol.name, **{key: v for key, v in stated.items() if key not in named}}
    given = {"eval.n": args.n, "eval.temperature": args.temperature, "eval.top_p": args.top_p,
             "eval.max_new_tokens": args.max_new_tokens}  # fmt: skip
    sampling.update({key: value for key, value in given.items() if value is not None})
    if args.ks:
        ks = _ints("--ks", args.ks)
    elif "eval.n" in sampling and "eval.ks" not in named:  # a new n: the usual ks that fit (--n 0: eval.n refuses)
        ks = EvalConfig.default_ks(sampling["eval.n"])
    else:
        ks = list(run.eval.ks)
    benchmarks = _benchmarks(args.benchmarks, run.eval.benchmarks, _own_benchmarks(run, args.model))
    flags = {
        **sampling, "eval.benchmarks": benchmarks, "eval.ks": ks,
        "eval.limit": args.limit, "eval.data_dir": args.data_dir, "rollout.prompts_per_step": args.prompts_per_batch,
        "reward.workers": args.workers, "seed": args.seed,
    }  # fmt: skip
    overrides = [f"{key}={json.dumps(value)}" for key, value in flags.items() if value is not None]
    return from_dict(type(run), apply_overrides(to_dict(run), overrides))


def _benchmarks(flag: str | None, configured: tuple[str, ...], own: tuple[str, ...] = ()) -> list[str] | None:
    """``--benchmarks`` when given; else None (keep the config's own), the run's ``own`` held-out sets where it
    names none (a run on the generated task validates on its classes: math500 would hold no prompt that fits), or
    the packaged three. A name a run prints for a generated held-out set (``toy_heldout_2digit``) is that set."""
    from lspo_jax.tasks import toy
    from lspo_jax.train_config import ConfigError

    if flag is None and configured:
        return None
    if flag is None and own:
        return list(own)
    names = [b.strip() for b in (DEFAULT_BENCHMARKS if flag is None else flag).split(",") if b.strip()]
    if not names:
        raise ConfigError(f"--benchmarks {flag!r}: names no benchmark; leave it out for the config's own")
    generated = {spec.replace(":", "_"): spec for spec in ("toy:heldout", "toy:target", *toy.HELDOUT_SPECS)}
    return [generated.get(name, name) for name in names]


def _own_benchmarks(run, model: str) -> tuple[str, ...]:
    """What a training run at ``model`` validated on when its config names no benchmark (``build.validation_specs``);
    nothing for a model that is not a run's."""
    from lspo_jax.job import export
    from lspo_jax.job.build import validation_specs

    return tuple(validation_specs(run)) if export.is_run_dir(model) else ()


def _ints(flag: str, text: str) -> list[int]:
    from lspo_jax.train_config import ConfigError

    try:
        return [int(k) for k in text.split(",")]
    except ValueError:
        raise ConfigError(f"{flag} {text}: not a comma-separated list of integers") from None


def _eval_model(args):
    """``(run config, policy, params, checkpoint step or None)`` of ``--model``: a training run's checkpoint
    with the run's own config, or a Hugging Face directory with ``--config`` (or the defaults)."""
    from lspo_jax.config import cache_root
    from lspo_jax.job import export
    from lspo_jax.job.build import load_policy
    from lspo_jax.job.compiles import use_cache
    from lspo_jax.job.config import load_config
    from lspo_jax.train_config import ConfigError

    a_run = os.path.isfile(os.path.join(args.model, "config.yaml"))
    if a_run and args.config is not None:
        raise ConfigError(f"--config {args.config}: {args.model} is a training run, evaluated with its own "
                          "config.yaml; give changes as KEY=VALUE overrides")  # fmt: skip
    if a_run and not has_checkpoint(args.model):
        raise FileNotFoundError(f"--model {args.model}: a training run with no checkpoint yet; evaluate it once it has "
                                "written one (checkpoint.every), or its model at model.path")  # fmt: skip
    if export.is_run_dir(args.model):
        # The cache is set before the checkpoint is read: JAX decides at its first compile whether it uses one.
        use_cache(load_config(os.path.join(args.model, "config.yaml"), args.overrides).compile_cache)
        run, policy, params, step = export.restore_run(args.model, args.step, args.overrides)
    elif args.step is not None:
        raise FileNotFoundError(f"--step {args.step}: {args.model} is not a training run (no config.yaml and "
                                "checkpoints/ in it)")  # fmt: skip
    else:
        run = load_config(args.config, [f"model.path={json.dumps(args.model)}", *args.overrides])
        use_cache(run.compile_cache)
        policy, params = load_policy(run, str(cache_root()))
        step = None
    return _eval_settings(run, args), policy, params, step


def check_output_file(path: str, flag: str = "--out") -> None:
    """Refuse, before any work, an output file (given as ``flag``) that could not be written at the end."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise FileExistsError(f"{flag} {path} is a directory; name a file to write the results to")
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"{flag} {path}: no directory {parent} to write it in")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise PermissionError(f"{flag} {path}: not writable")


def samples_path(out: str | None, samples: str | None) -> str | None:
    """Where the per-sample lines go: ``--samples``, else beside ``--out`` (``r.json``: ``r.samples.jsonl``), else
    nowhere."""
    if samples or not out:
        return samples
    return (out[: -len(".json")] if out.endswith(".json") else out) + ".samples.jsonl"


def _eval_arguments(args) -> tuple[str | None, list[int] | None]:
    """The per-sample file (``samples_path``) and ``--seeds`` (None: the config's one seed), refused before any work
    where they cannot be used: an output that could not be written, one file for both, a seed given twice (it
    would repeat its samples), an unknown ``--protocol`` or a ``--benchmarks`` that names none."""
    from lspo_jax.options import eval_protocol
    from lspo_jax.train_config import ConfigError

    for flag, given in (("--out", args.out), ("--samples", args.samples)):
        if given is not None and not given.strip():
            raise ConfigError(f"{flag} {given!r}: name a file to write")
    samples = samples_path(args.out, args.samples)
    for flag, path in (("--out", args.out), ("--samples", samples)):
        if path:
            check_output_file(path, flag)
    if args.out and samples and os.path.abspath(samples) == os.path.abspath(args.out):
        raise FileExistsError(f"--samples {samples} is --out too; name another file")
    seeds = _ints("--seeds", args.seeds) if args.seeds else None
    if seeds is not None and len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {args.seeds}: a seed given twice draws the same samples twice")
    if args.protocol is not None:
        eval_protocol(args.protocol, "--protocol")
    _benchmarks(args.benchmarks, ())
    return samples, seeds


def eval_main(argv: list[str] | None = None) -> int:
    args = _eval_parser().parse_args(argv)
    return _run_command("lspo-eval", _eval, args, "interrupted")


def _eval(args) -> int:
    """SIGTERM and Ctrl-C set a flag (``StopFlag``), read between the parts of loading and between the sampler's
    decode segments. A ``KeyboardInterrupt`` raised wherever Python happened to be could leave the process while XLA
    still ran the last call dispatched to it (JAX dispatches asynchronously), the interpreter finalising under
    XLA's threads, which sometimes crashed (exit 139 for the 130 of an interrupt); the flag ends the command between
    two calls, each waited for."""
    return _until_stopped("lspo-eval", "at the next point of loading", "evaluated", _eval_until_stopped, args)


def _until_stopped(prog: str, where: str, what: str, body, args) -> int:
    """``body(args, stop)`` under a ``StopFlag`` that says it stops ``where``; a stop it takes (``StartupStopped``,
    raised at its points) ends the command with one line, nothing ``what``, and ``EXIT_INTERRUPTED``."""
    from lspo_jax.signals import StartupStopped, StopFlag

    with StopFlag(prog) as stop:
        stop.expect(f"{where}; nothing is {what}")
        try:
            return body(args, stop)
        except StartupStopped:
            print(f"{prog}: interrupted; nothing was {what}", file=sys.stderr)
            return EXIT_INTERRUPTED


def _eval_until_stopped(args, stop) -> int:
    from lspo_jax.job import evaluation
    from lspo_jax.job.build import check_positions, load_benchmarks, make_verifier
    from lspo_jax.rollout.generator import Generator
    from lspo_jax.tasks.data_report import DataReport

    try:
        samples, seeds = _eval_arguments(args)
        stop.startup_point()
        run, policy, params, step = _eval_model(args)
        stop.startup_point()
        check_positions(run, policy.config, train=False, how=" (--max-new-tokens; data.max_prompt_tokens=N)")
        benchmarks = load_benchmarks(run, policy, run.eval.benchmarks)
        for name, (examples, report) in benchmarks.items():
            _warn_about_rows(name, report)
            if not examples:
                lost = DataReport(**report).losses()
                raise ValueError(f"{name}: no problem is left to evaluate (rows read: {report['rows']}"
                                 + (f"; {lost}" if lost else "") + ")")  # fmt: skip
    except ValueError as err:  # the loaders' plain ValueErrors are about the files given too; the rest: the funnel
        print(f"lspo-eval: {describe(err)}", file=sys.stderr)
        return EXIT_CONFIG
    stop.startup_point()
    _warn_about_protocol(run)
    pool, generator, seeds = make_verifier(run), Generator(policy, mesh=eval_mesh()), seeds or [run.seed]
    sampled_on = {"engine": "jax" if generator.vllm is None else "vllm", "devices": generator.mesh.devices.size}
    results = {}

    # Written before sampling and after each benchmark, "finished" false until the end: an earlier file at --out
    # never looks current, and a stop keeps the benchmarks already scored.
    def save(finished: bool) -> None:
        _write_results(args.out, _eval_output(args.model, step, run, seeds, sampled_on, results), finished)

    save(False)
    kept = f"the benchmarks scored so far are kept in {args.out} (finished: false)" if args.out else "nothing is kept"
    stop.expect(f"after the sampler's current decode segment; {kept}")
    try:
        with _json_lines(samples) as write:
            for name, (examples, report) in benchmarks.items():
                scored = _eval_benchmark(run, generator, params, name, examples, pool, seeds, write, stop)
                results[name] = {**scored, "data": report}
                save(False)
    except evaluation.ValidationStopped:
        scored = f"the {len(results)} benchmark{'' if len(results) == 1 else 's'} scored" if results else "none scored"
        kept = f"; {scored} in {args.out} (finished: false)" if args.out else ""
        print(f"lspo-eval: interrupted{kept}", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        pool.close()
    save(True)
    print(evaluation.format_results(results, run.eval.ks))
    if args.out:
        print(f"results: {args.out}")
    if samples:
        print(f"samples: {samples}")
    return 0


def _write_results(path: str | None, output: dict, finished: bool) -> None:
    """``output`` with ``finished`` into ``path`` (none: nothing), replaced whole: a stop mid-write leaves the last
    complete file."""
    if not path:
        return
    with open(path + ".tmp", "w") as f:
        json.dump({"finished": finished, **output}, f, indent=1)
    os.replace(path + ".tmp", path)


def _eval_benchmark(run, generator, params, name, examples, pool, seeds, write, stop=None) -> dict:
    """One benchmark's record (``evaluation.benchmark_result``): a repeat with each seed, its samples written
    through ``write`` as each repeat is graded. A seed's key depends on the benchmark's name alone besides it
    (``evaluation.benchmark_key``), so one seed gives a benchmark the same samples in any company. ``stop``: a
    ``StopFlag``; once it is set the sampling ends at its next decode segment (``evaluation.ValidationStopped``)."""
    import time

    import jax

    from lspo_jax.job import evaluation

    start, repeats = time.perf_counter(), []
    for seed in seeds:
        print(f"lspo-eval: {name}: sampling {len(examples)} problems x {run.eval.n} (seed {seed})", file=sys.stderr)
        key = evaluation.benchmark_key(jax.random.key(seed), name)
        check = None if stop is None else (lambda: stop.requested)
        repeats.append(evaluation.grade(run, generator, params, examples, pool, key, seed, check))
        write(evaluation.sample_records(name, examples, repeats[-1], generator.tokenizer))
    seconds = round(time.perf_counter() - start, 1)
    return {**evaluation.benchmark_result(examples, repeats, run.eval.ks), "seconds": seconds}


@contextlib.contextmanager
def _json_lines(path: str | None):
    """A function that writes records to ``path`` as JSON lines (no path: one that drops them)."""
    if path is None:
        yield lambda records: None
        return
    with open(path, "w") as f:

        def write(records) -> None:
            f.writelines(json.dumps(record) + "\n" for record in records)

        yield write


def eval_mesh():
    """This process's devices that a call's rows split over evenly, the rows split over them; None (the first
    device) when that is one. The sampler rounds a call's problems up to a power of two, so a mesh of another size
    would hold every row on every device: the largest power of two of them, the rest left idle and said so."""
    import jax

    from lspo_jax.models import sharding

    devices = jax.local_devices()
    used = evenly_splitting(len(devices))
    if used < len(devices):
        print(f"lspo-eval: sampling on {used} of the {len(devices)} devices (a call's rows split over a power of two)",
              file=sys.stderr)  # fmt: skip
    return None if used == 1 else sharding.make_mesh(sharding.MeshConfig(1, -1, 1), devices[:used])


def evenly_splitting(devices: int) -> int:
    """The largest power of two up to ``devices``."""
    return 1 << (devices.bit_length() - 1)


def _eval_output(model: str, step, run, seeds: list[int], sampled_on: dict, results: dict) -> dict:
    """The JSON of ``--out``: what was evaluated, the protocol named (its stated settings and each deviation of the
    settings used), the settings used, the seeds, the sampler and its device count, the packages' versions and the
    benchmarks' records."""
    from lspo_jax.job import evaluation

    used = evaluation.sampling_settings(run)
    return {
        "model": model, "checkpoint_step": step, "protocol": _protocol_record(run), **used, "ks": list(run.eval.ks),
        "seeds": seeds, **sampled_on, "versions": evaluation.package_versions(),
        "require_think_close": run.reward.require_think_close, "benchmarks": results,
    }  # fmt: skip


def _protocol_record(run) -> dict | None:
    """``eval.protocol``'s name, description, source, stated settings and the deviations from them; None unnamed."""
    from lspo_jax.job import evaluation
    from lspo_jax.options import eval_protocol

    if run.eval.protocol is None:
        return None
    protocol = eval_protocol(run.eval.protocol)
    deviations = protocol.deviations(evaluation.sampling_settings(run))
    return {"name": protocol.name, "description": protocol.description, "source": protocol.source,
            "settings": protocol.settings(), "deviations": deviations}  # fmt: skip


def _warn_about_protocol(run) -> None:
    """A score sampled otherwise than its protocol states is not that protocol's: say how it differs."""
    record = _protocol_record(run)
    if record and record["deviations"]:
        differ = ", ".join(f"{key} {d['used']} (protocol: {d['protocol']})" for key, d in record["deviations"].items())
        print(f"lspo-eval: not quite the {record['name']} protocol: {differ}", file=sys.stderr)


def _warn_about_rows(name: str, report: dict) -> None:
    """Each benchmark's rows as read, and where some were lost at load time, how: a benchmark that lost problems is
    not the published benchmark."""
    from lspo_jax.tasks.data_report import DataReport

    line = DataReport(**report).losses() or f"{report['rows']} rows, all kept"
    print(f"lspo-eval: {name}: {line}", file=sys.stderr)


def export_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lspo-export", description="Checkpoint of a run -> Hugging Face directory.")
    p.add_argument("run_dir", help="a training run's --out directory")
    p.add_argument("out", help="directory to write (config.json, model.safetensors, tokenizer files)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA RL run's policy adapter as a PEFT directory (default: the merged model)")  # fmt: skip
    args = p.parse_args(argv)
    return _run_command("lspo-export", _export, args, "interrupted; nothing was exported")


def _export(args) -> int:
    """SIGTERM and Ctrl-C set a flag (``StopFlag``), read after the restore and after each tensor and file written,
    as ``lspo-eval`` reads it: a ``KeyboardInterrupt`` could land wherever Python happened to be, XLA's callbacks
    included. The files are written beside OUT (``export._staged``), so a stop leaves OUT as it was."""
    return _until_stopped("lspo-export", "after the current tensor or file", "exported", _export_until_stopped, args)


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
