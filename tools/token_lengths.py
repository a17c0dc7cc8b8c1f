"""Token lengths of the shared benchmark and training files in the real Qwen2 vocabulary (``tools.qwen_vocab``).

For each file: the problems' tokens, the R1 prompts' (the chat template and the recipe's instruction, as
``templates.render_prompt`` makes them: what a rollout row's prompt part holds) and the worked solutions' where the
file has them; median, 90th percentile (linear interpolation) and maximum. Input for the packing design: how
much of a fixed ``[max_prompt_tokens | max_new_tokens]`` row is padding.

    .venv/bin/python -m tools.token_lengths [--data-dir ../shared/data] [--files math500 aime24 ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from lspo_jax.tasks import templates
from lspo_jax.train_config import ConfigError, DataConfig
from tools import qwen_vocab

if not __package__:  # run by its path: the repository root, where the package ``tools`` is, is not on sys.path
    sys.exit("tools/token_lengths.py: run it from the repository root as python -m tools.token_lengths ...")
from tools import SHARED_DATA, run_main, write_json  # noqa: E402

FILES = ("math500", "aime24", "aime25", "aime26", "aime_1983_2023", "gsm8k_test", "gsm8k_train")


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def stats(lengths: list[int]) -> dict[str, float]:
    x = np.asarray(lengths, np.float64)
    return {"n": len(x), "median": float(np.median(x)), "p90": float(np.percentile(x, 90)), "max": int(x.max())}


def file_lengths(tokenizer, rows: list[dict]) -> dict[str, dict]:
    """Length statistics of one file's problems, R1 prompts and (where present) solutions."""
    encode = lambda text: len(tokenizer.encode(text, add_special_tokens=False))
    config = DataConfig()  # the recipe's instruction after the question
    out = {
        "problem": stats([encode(r["problem"]) for r in rows]),
        "r1_prompt": stats(
            [len(templates.render_prompt(tokenizer, templates.prompt_text(r["problem"], config))) for r in rows]
        ),
    }
    solutions = [r["solution"] for r in rows if r.get("solution")]
    if solutions:
        out["solution"] = stats([encode(s) for s in solutions])
    return out


def markdown(results: dict[str, dict]) -> str:
    lines = ["| file | part | n | median | p90 | max |", "|---|---|---|---|---|---|"]
    for name, parts in results.items():
        for part, s in parts.items():
            lines.append(f"| {name} | {part} | {s['n']} | {s['median']:g} | {s['p90']:.1f} | {s['max']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_main("token_lengths", _lengths, argv)


def _lengths(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=str(SHARED_DATA))
    p.add_argument("--files", nargs="+", default=list(FILES), help="file names in --data-dir, without .jsonl")
    p.add_argument("--json", help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    paths = {name: os.path.join(args.data_dir, f"{name}.jsonl") for name in args.files}
    missing = [path for path in paths.values() if not os.path.isfile(path)]
    if missing:
        raise FileNotFoundError(f"no such file: {', '.join(missing)}")
    start = time.perf_counter()
    try:
        tokenizer = qwen_vocab.r1_tokenizer()
    except ImportError as err:  # the vocabulary's package missing: one line, as a missing extra is
        raise ConfigError(str(err)) from err
    print(f"tokenizer built in {time.perf_counter() - start:.1f} s ({len(tokenizer)} tokens)", file=sys.stderr)
    results = {name: file_lengths(tokenizer, read_rows(path)) for name, path in paths.items()}
    print(markdown(results))
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
