"""``lspo-eval``: pass@k of a model on math benchmarks, sampled with the JAX sampler. Its options (``parser``), the
settings they make of the run's config or a Hugging Face model's (``_eval_settings``), the refusals before any
work (an output that could not be written, a seed given twice, a protocol or benchmark that names none), and the
sampling and scoring of each benchmark with its record written as it goes (``evaluate``). ``cli.eval_main`` runs
it through the commands' funnel (``errors.run_command``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from lspo_jax.job.errors import EXIT_CONFIG, EXIT_INTERRUPTED, describe, has_checkpoint, until_stopped

DEFAULT_BENCHMARKS = "math500,aime24,aime25"  # the three that ship inside the package


def parser() -> argparse.ArgumentParser:
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
    from lspo_jax.job.config_io import apply_overrides, from_dict, to_dict
    from lspo_jax.options import eval_protocol
    from lspo_jax.train_config import EvalConfig

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


def evaluate(args) -> int:
    """``lspo-eval`` on ``parser()``'s ``args``: its exit status. SIGTERM and Ctrl-C set a flag (``StopFlag``), read
    between the parts of loading and between the sampler's decode segments. A ``KeyboardInterrupt`` raised wherever
    Python happened to be could leave the process while XLA still ran the last call dispatched to it (JAX dispatches
    asynchronously), the interpreter finalising under XLA's threads, which sometimes crashed (exit 139 for the 130 of
    an interrupt); the flag ends the command between two calls, each waited for."""
    return until_stopped("lspo-eval", "at the next point of loading", "evaluated", _eval_until_stopped, args)


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
