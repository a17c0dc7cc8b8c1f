"""The paper's recipe at toy size, as a new user first tries it: a random Qwen2 with R1-Distill's 151,936-word
vocabulary and the real R1 tokenizer, DeepMath-schema parquet rows, and the time of each step with what it compiled.

    .venv/bin/python -m tools.recipe_toy --out /tmp/recipe_toy [--hidden 64] [--steps 3] [override ...]

writes ``OUT/model`` and ``OUT/deepmath.parquet``, runs ``lspo-train`` on
``configs/lspo_deepmath_r1_distill_qwen_1p5b.yaml`` with the shape of ``SHAPE`` (4 x 4 rollouts of 256 + 48 tokens,
solutions cut at 256, no validation) and the overrides given, and prints per step its seconds, its phases and
its compiles (``compiles.CompileCount``). ``--json`` keeps them. The model and the rows are also the fixtures of
``tests/test_recipe.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

if not __package__:  # run by its path: the repository root, where the package ``tools`` is, is not on sys.path
    sys.exit("tools/recipe_toy.py: run it from the repository root as python -m tools.recipe_toy ...")
from tools import run_main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER_CONFIG = os.path.join(ROOT, "configs", "lspo_deepmath_r1_distill_qwen_1p5b.yaml")
SHAPE = [
    "model.compute_dtype=float32",  # bfloat16 matmuls are emulated (slow) on CPU
    "data.max_prompt_tokens=256",
    "data.max_solution_tokens=256",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=48",
    "reward.overlong_buffer=8",
    "reward.workers=1",
    "loss.micro_batches=1",
    "eval.benchmarks=[]",
]


def tiny_r1_model(path: str, hidden: int = 32, layers: int = 2) -> str:
    """A random Qwen2 with R1-Distill's vocabulary size (151,936) and untied head, and the real R1 tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tools import qwen_vocab

    torch.manual_seed(0)
    tokenizer = qwen_vocab.r1_tokenizer()
    config = Qwen2Config(
        vocab_size=151_936, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    assert len(tokenizer) <= config.vocab_size
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def deepmath_parquet(path: str, rows: int = 64) -> str:
    """DeepMath-103K's schema (question, final_answer, difficulty, topic, r1_solution_1..3): sums, with worked
    R1-style solutions, in one parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    pairs = rng.integers(10, 99, (rows, 2)).tolist()
    solution = [f"<think>\n{x} + {y} = {x + y}\n</think>\nThe sum is $\\boxed{{{x + y}}}$." for x, y in pairs]
    table = pa.table({
        "question": [f"What is {x} + {y}?" for x, y in pairs],
        "final_answer": [str(x + y) for x, y in pairs],
        "difficulty": rng.uniform(1.0, 3.0, rows).round(1).tolist(),
        "topic": ["Mathematics -> Algebra -> Prealgebra"] * rows,
        **{f"r1_solution_{k}": solution for k in (1, 2, 3)},
    })  # fmt: skip
    pq.write_table(table, path)
    return path


def step_lines(metrics_path: str) -> list[dict]:
    """Per train record: the step, its phases' and compiling seconds, and its compiles."""
    with open(metrics_path) as f:
        train = [r for r in map(json.loads, f) if r["kind"] == "train"]
    keep = lambda key: key.startswith("time_") or key in ("step", "compiles", "compiles_cached")
    return [{k: round(v, 2) if isinstance(v, float) else v for k, v in r.items() if keep(k)} for r in train]


def main(argv: list[str] | None = None) -> int:
    return run_main("recipe_toy", _recipe, argv)


def _recipe(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="a directory for the model, the rows and the run (replaced)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", default=None, help="write the per-step figures here")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    model = os.path.join(args.out, "model")
    if not os.path.exists(os.path.join(model, "config.json")):
        tiny_r1_model(model, args.hidden, args.layers)
    rows = deepmath_parquet(os.path.join(args.out, "deepmath.parquet"))
    run_dir = os.path.join(args.out, "run")
    subprocess.run(["rm", "-rf", run_dir], check=True)
    overrides = [f"model.path={model}", f"data.train={rows}", *SHAPE, f"steps={args.steps}",
                 f"checkpoint.every={args.steps}", *args.overrides]  # fmt: skip
    lspo_train = os.path.join(os.path.dirname(sys.executable), "lspo-train")
    done = subprocess.run([lspo_train, "--config", PAPER_CONFIG, "--out", run_dir, *overrides])
    if done.returncode != 0:
        print(f"recipe_toy: lspo-train exited {done.returncode}", file=sys.stderr)
        return done.returncode
    lines = step_lines(os.path.join(run_dir, "metrics.jsonl"))
    for line in lines:
        print(json.dumps(line))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"overrides": overrides, "steps": lines}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
