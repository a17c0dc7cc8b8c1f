"""Whether two trees train the same runs: every value of every record of each run's ``metrics.jsonl`` compared, the
timings and compile counts left out (they move with the machine, not the code).

A change that only moves code (a module split, a class taken out of another) must leave the records as they were.
Train the same cases from both trees into two folders, ``OUT/CASE`` each, then compare them:

    .venv/bin/python -m tools.same_records --train OUT            # the three cases below, from this tree
    .venv/bin/python -m tools.same_records BEFORE AFTER           # exit 1 when any record differs

The cases: ``demo`` (``configs/demo.yaml`` as shipped), ``stale`` (6 steps one update stale, validation every 3) and
``split`` (the same on 8 host devices, 4 of them sampling).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

if not __package__:  # run by its path: the repository root, where the package ``tools`` is, is not on sys.path
    sys.exit("tools/same_records.py: run it from the repository root as python -m tools.same_records ...")
from tools import run_main  # noqa: E402

SHORT = ["steps=6", "eval.every=3", "checkpoint.every=100", "rollout.max_staleness=1", "loss.tis_cap=2.0"]
CASES = {
    "demo": ([], {}),
    "stale": (SHORT, {}),
    "split": ([*SHORT, "rollout.placement=split", "rollout.sampler_devices=4"],
              {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}),
}  # fmt: skip
# Parts of a key that mark a timing or a compile count.
UNTIMED = ("time_", "seconds", "compile", "_s", "overlap_share")


def kept(record: dict) -> dict:
    """``record`` without its timings and compile counts."""
    return {k: v for k, v in record.items() if not any(part in k for part in UNTIMED)}


def differences(before: list[dict], after: list[dict]) -> list[str]:
    """Each difference between two runs' records, as ``record N: key before -> after`` (a record missing on one
    side is one difference)."""
    found = [f"{len(before)} records before, {len(after)} after"] if len(before) != len(after) else []
    for i, (a, b) in enumerate(zip(before, after)):  # noqa: B905 (their counts are compared above)
        a, b = kept(a), kept(b)
        changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        found += [f"record {i}: {k} {a.get(k)!r} -> {b.get(k)!r}" for k in changed]
    return found


def read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train(out: str) -> None:
    """Each case from this tree into ``out/CASE``, in a process of its own (the split needs its device count set
    before JAX starts)."""
    for case, (overrides, env) in CASES.items():
        argv = ["--config", "configs/demo.yaml", "--no-plots", "--out", os.path.join(out, case), *overrides]
        code = f"import sys; from lspo_jax.job.cli import train_main; sys.exit(train_main({argv!r}))"
        print(f"same_records: training {case}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, **env})


def main(argv: list[str] | None = None) -> int:
    return run_main("same_records", _same, argv)


def _same(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--train", metavar="OUT", help="train the cases from this tree into OUT/CASE")
    p.add_argument("runs", nargs="*", metavar="BEFORE AFTER", help="two folders of the cases' runs to compare")
    args = p.parse_args(argv)
    if args.train:
        train(args.train)
        return 0
    if len(args.runs) != 2:
        p.error("give --train OUT, or the two folders BEFORE AFTER")
    status = 0
    for case in CASES:
        paths = [os.path.join(root, case, "metrics.jsonl") for root in args.runs]
        if not all(os.path.exists(path) for path in paths):
            print(f"{case}: not in both folders")
            continue
        before, after = map(read, paths)
        found = differences(before, after)
        values = sum(len(kept(r)) for r in before)
        print(f"{case}: {len(before)} records, {values} values compared: "
              + ("identical" if not found else f"{len(found)} differences: " + "; ".join(found[:5])))  # fmt: skip
        status = status or (1 if found else 0)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
