"""Data-loader throughput at DeepMath-103K's scale: generated rows in its schema, loaded as a run loads them.

DeepMath-103K itself cannot be downloaded here, so ``--rows`` rows (default 103,022, its size) are written in its
schema (``question``, ``final_answer``, ``difficulty``, ``topic``, ``r1_solution_1..3``) as parquet, its format:
questions are the shared benchmark files' problems, answers their gold answers, and each R1 solution is built from
the shared worked solutions, joined until it reaches a length drawn from a log-normal in characters (default median
15,000 and p90 35,000, about 4.4k and 10k tokens: R1's traces). Then each load runs in a fresh process, as a
run loads its data (the paper recipe's data config, the real Qwen2 vocabulary from ``qwen_vocab``), and draws
the first batch of 32 prompts with their solutions tokenised, as the scaffold does for cliffs:

- ``first``: ``example_store.load_examples`` with no store yet: it reads and checks the rows, parses the gold
  answers, renders and tokenises the prompts and writes the store; solutions stay text until used;
- ``second``: the same call again, as a resume or a later run makes it: it memory-maps the store built by
  ``first``;
- ``--eager`` instead: ``data.load_examples``, every solution tokenised (truncated at 8192 tokens) at start.

Prints each load's seconds to the first batch, rows/s and the process's peak resident memory.

    .venv/bin/python -m tools.bench_loader [--rows 103022] [--data-dir ../shared/data] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 (pa.compute)

from lspo_jax.rl import packing, prompts
from lspo_jax.tasks import data, example_store
from lspo_jax.train_config import ConfigError, DataConfig
from tools import qwen_vocab

if not __package__:  # run by its path: the repository root, where the package ``tools`` is, is not on sys.path
    sys.exit("tools/bench_loader.py: run it from the repository root as python -m tools.bench_loader ...")
from tools import SHARED_DATA, run_main  # noqa: E402

SOURCES = ("math500", "aime_1983_2023", "gsm8k_train", "gsm8k_test")


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def generate(path: str, rows: int, data_dir: str, median_chars: float, p90_chars: float, seed: int) -> None:
    """``rows`` DeepMath-schema rows as one parquet file at ``path``, written in row groups of ``GROUP`` rows."""
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    pool = [r for name in SOURCES for r in read_jsonl(os.path.join(data_dir, f"{name}.jsonl"))]
    texts = [r["solution"] for r in pool if r.get("solution")]

    def trace(chars: int) -> str:
        parts, total = [], 0
        while total < chars:
            parts.append(texts[rng.integers(len(texts))])
            total += len(parts[-1]) + 2
        return "\n\n".join(parts)[:chars]

    writer = None
    for first in range(0, rows, GROUP):
        n = min(GROUP, rows - first)
        pick = rng.integers(0, len(pool), n)
        lengths = packing.lognormal_lengths(3 * n, median_chars, p90_chars, 10**6, rng).reshape(3, n)
        table = pa.table({
            "question": [pool[i]["problem"] for i in pick],
            "final_answer": [str(pool[i]["answer"]) for i in pick],
            "difficulty": rng.uniform(3.0, 9.0, n).round(1).tolist(),
            "topic": ["Mathematics -> Algebra"] * n,
            **{f"r1_solution_{k + 1}": [trace(int(c)) for c in lengths[k]] for k in range(3)},
        })  # fmt: skip
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()


GROUP = 10_000


def main(argv: list[str] | None = None) -> int:
    return run_main("bench_loader", _bench, argv)


def _bench(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=103_022)
    p.add_argument("--data-dir", default=str(SHARED_DATA))
    p.add_argument("--median-chars", type=float, default=15_000)
    p.add_argument("--p90-chars", type=float, default=35_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eager", action="store_true", help="time data.load_examples, every solution tokenised at start")
    p.add_argument("--load", metavar="PARQUET", help=argparse.SUPPRESS)  # one timed load, in a fresh process
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    p.add_argument("--json", help="write the figures to this JSON file")
    args = p.parse_args(argv)
    if args.load:
        print(json.dumps(timed_load(args.load, args.cache_dir, args.eager)))
        return 0
    missing = [n for n in SOURCES if not os.path.isfile(os.path.join(args.data_dir, f"{n}.jsonl"))]
    if missing:
        raise FileNotFoundError(f"no {', '.join(missing)} in {args.data_dir}")
    try:
        qwen_vocab.r1_tokenizer()
    except ImportError as err:  # the vocabulary's package missing: one line, as a missing extra is
        raise ConfigError(str(err)) from err
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "deepmath_generated.parquet")
        start = time.perf_counter()
        generate(path, args.rows, args.data_dir, args.median_chars, args.p90_chars, args.seed)
        out = {"rows": args.rows, "generate_s": time.perf_counter() - start, "file_mb": os.path.getsize(path) / 1e6}
        runs = ("eager",) if args.eager else ("first", "second")
        for run in runs:  # the second finds the store the first built, as a resume or a later run does
            out[run] = load_in_fresh_process(path, os.path.join(tmp, "store"), args.eager)
            print(run, ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in out[run].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def load_in_fresh_process(path: str, cache_dir: str, eager: bool) -> dict:
    """``timed_load`` in a fresh Python process: its peak resident memory is the load's alone."""
    command = [sys.executable, __file__, "--load", path, "--cache-dir", cache_dir] + ["--eager"] * eager
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"the timed load failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def timed_load(path: str, cache_dir: str, eager: bool) -> dict:
    """Load as a run does (the paper recipe's data config, the R1 tokenizer), then draw the first batch of
    ``PROMPTS`` prompts with their solutions tokenised, as the scaffold would for cliffs. Seconds from the start
    of the load to that batch, the load's report and the process's peak resident memory."""
    start = time.perf_counter()
    tokenizer = qwen_vocab.r1_tokenizer()
    tokenizer_s = time.perf_counter() - start
    config = DataConfig(
        format="deepmath", solution_field="r1_solution_1", max_prompt_tokens=1024, prompt_policy="skip",
        max_solution_tokens=8192, solution_policy="truncate", cache_dir=cache_dir,
    )  # fmt: skip
    start = time.perf_counter()
    load = data.load_examples if eager else example_store.load_examples
    examples, report = load(path, tokenizer, config)
    load_s = time.perf_counter() - start
    batch = prompts.ShuffledPrompts(examples, PROMPTS, seed=0).next_batch(None, None, None).examples
    solution_tokens = sum(len(ex.solution_ids) for ex in batch if ex.solution_ids is not None)
    first_batch_s, peak = time.perf_counter() - start, peak_rss_gb()
    if eager:
        prompt_tokens = sum(len(ex.prompt_ids) for ex in examples)
    else:  # from the store's column: building every example would page in the solutions' text too
        prompt_tokens = pa.compute.sum(pa.compute.list_value_length(examples.table.column("prompt_ids"))).as_py()
    return {"tokenizer_s": tokenizer_s, "load_s": load_s, "first_batch_s": first_batch_s, "kept": report.kept,
            "rows_per_s": report.rows / load_s, "prompt_tokens": prompt_tokens,
            "batch_solution_tokens": solution_tokens, "solutions_encoded": report.solutions_encoded,
            "peak_rss_gb": peak}  # fmt: skip


def peak_rss_gb() -> float:
    """This process's peak resident memory: ``VmHWM`` belongs to the address space, so unlike ``ru_maxrss`` it
    does not carry the parent's peak across the fork and exec that started this process."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib * 1024 / 1e9


PROMPTS = 32  # the paper's prompts a step


if __name__ == "__main__":
    raise SystemExit(main())
