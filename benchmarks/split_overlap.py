"""Sampling beside learning on this machine's devices: the demo with the sampling on devices of its own
(``rollout.placement: split``, one update stale) against the serial colocated step (``max_staleness: 0``), same
seed, one run each, side by side.

Each arm trains in a process of its own, with ``--devices`` host devices (``--xla_force_host_platform_device_count``;
a GPU machine's own devices where there are some), the demo's config and the given overrides; each step's
``Run.one_step`` is timed there (wall clock, ``time.perf_counter``). Then per arm, over the steps after the first
``--skip`` (compiles): seconds a step, the update's and the wait for the rollouts (the records' ``time_update`` and
``time_sample``), the sampler thread's seconds, the base's push; the step-time ratio split / colocated; and the
share of the split run's step time in which both sides were busy: the sampler thread's seconds that overlapped the
step it ran beside (``rollout/overlap_s`` of the next step's record, measured from the thread's and the step's
timestamps) over that step's wall time. A third arm, the serial step on the learner's share of the devices alone
(``learner_devices_k0``), separates what the smaller learner mesh does by itself from what the overlap does.

    .venv/bin/python -m benchmarks.split_overlap --devices 8 --sampler-devices 4 --steps 12 --out runs/split_bench \\
        [--json runs/split_bench/split.json] [dotted.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ARMS = {
    "colocated_k0": ["rollout.max_staleness=0"],
    "split_k1": ["rollout.max_staleness=1", "loss.tis_cap=2.0", "rollout.placement=split"],
    # The serial step on the learner's share of the devices alone: what the smaller mesh does by itself.
    "learner_devices_k0": ["rollout.max_staleness=0"],
}
# No validation and no checkpoint inside the timed steps: a scheduled checkpoint makes the step after it on-policy.
QUIET = ["eval.every=0", "eval.benchmarks=[]", "checkpoint.every=1000"]


def child(out: str, overrides: list[str]) -> None:
    """Train the demo into ``out`` with ``overrides``, each step timed; the times go to ``out/steps.json``."""
    from lspo_jax.job.config import load_config
    from lspo_jax.job.run import Run, train_run

    times, real = [], Run.one_step

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        result = real(self, *args, **kwargs)
        times.append((start, time.perf_counter()))
        return result

    Run.one_step = timed
    train_run(load_config("configs/demo.yaml", overrides), out)
    with open(os.path.join(out, "steps.json"), "w") as f:
        json.dump(times, f)


def run_arm(name: str, args: argparse.Namespace) -> dict:
    out = os.path.join(args.out, name)
    overrides = [*QUIET, f"steps={args.steps}", f"seed={args.seed}", *ARMS[name], *args.overrides]
    if name == "split_k1":
        overrides.append(f"rollout.sampler_devices={args.sampler_devices}")
    devices = args.devices - args.sampler_devices if name == "learner_devices_k0" else args.devices
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    # On a GPU machine the host-device flag does nothing: the arm's devices are the first ones the process may see.
    env = {**os.environ, "XLA_FLAGS": flags, "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(devices)))}
    code = f"from benchmarks.split_overlap import child; child({out!r}, {overrides!r})"
    if subprocess.run([sys.executable, "-c", code], env=env).returncode != 0:  # its own error is printed above
        sys.exit(f"split_overlap: arm {name} failed; its run directory is {out}")
    with open(os.path.join(out, "steps.json")) as f:
        walls = [end - start for start, end in json.load(f)]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        train = [r for r in map(json.loads, f) if r.get("kind") == "train"]
    return {"walls": walls, "train": train}


def figures(arm: dict, skip: int) -> dict:
    """Means over the steps after ``skip``; the both-busy share pairs step t's wall time with the overlap the next
    step's record reports (the thread ran beside step t)."""
    walls, train = arm["walls"], arm["train"]
    kept = range(skip, len(walls))
    mean = lambda key: statistics.fmean(float(train[i].get(key) or 0.0) for i in kept)
    both = [float(train[i + 1].get("rollout/overlap_s") or 0.0) for i in kept if i + 1 < len(train)]
    return {
        "step_s": statistics.fmean(walls[i] for i in kept),
        "update_s": mean("time_update"),
        "wait_s": mean("time_sample"),
        "thread_s": mean("rollout/prefetch_s"),
        "push_s": mean("rollout/push_s"),
        "both_busy_share": sum(both) / sum(walls[i] for i in kept if i + 1 < len(train)) if both else 0.0,
        "steps": len(kept),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--sampler-devices", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=2, help="steps left out of the means (compiles)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", default="runs/split_bench")
    p.add_argument("--json", default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if args.steps <= args.skip + 1:
        p.error(f"--steps {args.steps}: more than --skip + 1 ({args.skip + 1}) steps are needed to time any")
    if os.path.exists(args.out):
        p.error(f"--out {args.out} exists; give a new directory")
    result = {name: figures(run_arm(name, args), args.skip) for name in ARMS}
    result["ratio"] = result["split_k1"]["step_s"] / result["colocated_k0"]["step_s"]
    result["ratio_learner_devices"] = result["split_k1"]["step_s"] / result["learner_devices_k0"]["step_s"]
    print("| arm | s / step | update s | wait for rollouts s | sampler thread s | push s | both busy |")
    print("|---|---|---|---|---|---|---|")
    for name in ARMS:
        f = result[name]
        print(f"| {name} | {f['step_s']:.3f} | {f['update_s']:.3f} | {f['wait_s']:.3f} | {f['thread_s']:.3f} | "
              f"{f['push_s']:.4f} | {100 * f['both_busy_share']:.1f}% |")  # fmt: skip
    print(
        f"step-time ratio split / colocated: {result['ratio']:.3f}; split / the learner's devices alone: "
        f"{result['ratio_learner_devices']:.3f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
