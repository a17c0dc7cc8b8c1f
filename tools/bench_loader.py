"""Data-loader throughput at DeepMath-103K's scale: generated rows in its schema, loaded as a run loads them.

DeepMath-103K itself cannot be downloaded here, so ``--rows`` rows (default 103,022, its size) are written in its
schema (``question``, ``final_answer``, ``difficulty``, ``topic``, ``r1_solution_1..3``) as parquet, its format:
questions are the shared benchmark files' problems, answers their gold answers, and each R1 solution is built from
the shared worked solutions, joined until it reaches a length drawn from a log-normal in characters (default median
15,000 and p90 35,000, about 4.4k and 10k tokens: R1's traces). Then ``data.load_examples`` reads it with the
paper recipe's data config and the real Qwen2 vocabulary (``qwen_vocab``): read and check the rows, parse every
gold answer, render the R1 prompts and tokenise the solutions (truncated at 8192 tokens). Prints rows/s and
tokens/s of the whole load, its peak resident memory (the generated table included), and the phases' seconds.

    .venv/bin/python tools/bench_loader.py [--rows 103022] [--data-dir ../shared/data] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

import numpy as np

from lspo_jax import data, evaluation, packing, qwen_vocab, rewards
from lspo_jax.train_config import DataConfig

SOURCES = ("math500", "aime_1983_2023", "gsm8k_train", "gsm8k_test")


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def generate(path: str, rows: int, data_dir: str, median_chars: float, p90_chars: float, seed: int) -> None:
    """``rows`` DeepMath-schema rows as one parquet file at ``path``, written in row groups of ``GROUP`` rows."""
    import pyarrow as pa
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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=103_022)
    p.add_argument("--data-dir", default=str(evaluation.DEFAULT_DATA_DIR))
    p.add_argument("--median-chars", type=float, default=15_000)
    p.add_argument("--p90-chars", type=float, default=35_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures to this JSON file")
    args = p.parse_args(argv)
    missing = [n for n in SOURCES if not os.path.isfile(os.path.join(args.data_dir, f"{n}.jsonl"))]
    if missing:
        print(f"bench_loader: no {', '.join(missing)} in {args.data_dir}", file=sys.stderr)
        return 2
    try:
        tokenizer = qwen_vocab.r1_tokenizer()
    except (ImportError, FileNotFoundError) as err:
        print(f"bench_loader: {err}", file=sys.stderr)
        return 2
    config = DataConfig(
        format="deepmath", solution_field="r1_solution_1", max_prompt_tokens=1024, prompt_policy="skip",
        max_solution_tokens=8192, solution_policy="truncate",
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "deepmath_generated.parquet")
        start = time.perf_counter()
        generate(path, args.rows, args.data_dir, args.median_chars, args.p90_chars, args.seed)
        out = {"rows": args.rows, "generate_s": time.perf_counter() - start, "file_mb": os.path.getsize(path) / 1e6}
        out.update(timed_load(path, tokenizer, config))
    print(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in out.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def timed_load(path: str, tokenizer, config: DataConfig) -> dict:
    """``data.load_examples`` whole, then its reading and gold parsing alone on the same file: the rest of the load
    is the encoding (prompt rendering and tokenisation)."""
    start = time.perf_counter()
    examples, report = data.load_examples(path, tokenizer, config)
    total = time.perf_counter() - start
    tokens = sum(len(e.prompt_ids) + (0 if e.solution_ids is None else len(e.solution_ids)) for e in examples)
    out = {"load_s": total, "kept": report.kept, "rows_per_s": report.rows / total, "tokens": tokens,
           "tokens_per_s": tokens / total, "solution_truncated": report.solution_truncated}  # fmt: skip
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    start = time.perf_counter()
    rows = data.read_rows(path, config)
    out["read_s"] = time.perf_counter() - start
    start = time.perf_counter()
    rewards.parse_golds((str(r["id"]), str(r["answer"])) for r in rows)
    out["parse_golds_s"] = time.perf_counter() - start
    out["encode_s"] = total - out["read_s"] - out["parse_golds_s"]
    return out


if __name__ == "__main__":
    sys.exit(main())
