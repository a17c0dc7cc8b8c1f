"""A reference for learning that this project did not write: TRL's ``GRPOTrainer`` on the demo's model, prompts
and reward, validated on the demo's held-out classes the way ``lspo-train`` validates, beside the DAPO arm.

TRL (``pip install -e '.[reference]'``) trains the demo's warm-started Qwen2 in PyTorch with the DAPO settings
of the config: its ``dapo`` loss (token mean over the batch), eps_low/eps_high, no KL (beta 0), one iteration
per batch (so the ratio is 1 and ``old_logp`` is the policy's own), AdamW with the config's lr, warm-up,
betas, weight decay and clipping, ``prompts_per_step`` x ``group_size`` completions per step, rewards scaled
by the group's std, the same shaped reward (math-verify accuracy plus DAPO's overlong penalty). Every
``eval.every`` steps a callback samples ``eval.n`` completions per held-out problem at the eval temperature
and writes pass@k records in ``metrics.jsonl`` as ``lspo-train`` does, so ``tools/compare_runs.py`` reads
the run (arm ``trl``). ``--dapo DIR ...`` draws the DAPO arm's runs beside it in ``OUT/trl_vs_dapo.png``.

    .venv/bin/python -m tools.trl_reference --config configs/demo.yaml --out runs/trl [--dapo runs/arms/dapo_seed42] \\
        [--no-train] [dotted.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from lspo_jax.job import evaluation
from lspo_jax.job.build import model_dir, validation_specs
from lspo_jax.job.config import load_config
from lspo_jax.job.config_io import to_dict
from lspo_jax.job.metrics_log import read_metrics
from lspo_jax.models import hf
from lspo_jax.tasks import benchmarks, rewards, sources
from lspo_jax.train_config import ConfigError
from tools import tables

if not __package__:  # run by its path: the repository root, where the package ``tools`` is, is not on sys.path
    sys.exit("tools/trl_reference.py: run it from the repository root as python -m tools.trl_reference ...")
from tools import run_main  # noqa: E402
from tools.compare_runs import parse_run  # noqa: E402


def held_out(run, tokenizer) -> dict[str, list]:
    """The run's held-out benchmarks as rows (the demo's classes when the config names none)."""
    specs = validation_specs(run)
    paths = {benchmarks.benchmark_name(s): benchmarks.benchmark_path(s, run.eval.data_dir) for s in specs}
    return {name: sources.read_rows(path, seed=run.seed, max_rows=run.eval.limit) for name, path in paths.items()}


def prompt_text(row: dict, tokenizer) -> str:
    """What ``lspo-train`` sends for a generated task: BOS and the problem, with no instruction."""
    return tokenizer.bos_token + row["problem"]


class Validator:
    """Samples ``eval.n`` completions per held-out problem from the torch policy and writes ``eval`` records."""

    def __init__(self, run, tokenizer, benchmarks: dict[str, list], log):
        self.run, self.tokenizer, self.benchmarks, self.log = run, tokenizer, benchmarks, log

    def __call__(self, model, step: int) -> None:
        import torch

        cfg = self.run.eval
        model.eval()
        for name, rows in self.benchmarks.items():
            table = []
            for start in range(0, len(rows), self.run.rollout.prompts_per_step):
                chunk = rows[start : start + self.run.rollout.prompts_per_step]
                enc = self.tokenizer([prompt_text(r, self.tokenizer) for r in chunk], return_tensors="pt",
                                     padding=True, padding_side="left", add_special_tokens=False)  # fmt: skip
                with torch.no_grad():
                    out = model.generate(**enc, do_sample=True, temperature=cfg.temperature, top_k=0, top_p=1.0,
                                         max_new_tokens=cfg.max_new_tokens, num_return_sequences=cfg.n,
                                         pad_token_id=self.tokenizer.pad_token_id)  # fmt: skip
                texts = self.tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
                golds = [r["answer"] for r in chunk for _ in range(cfg.n)]
                table.append(np.array([rewards.math_reward(t, g) for t, g in zip(texts, golds, strict=True)]) > 0)
            correct = np.concatenate(table).reshape(len(rows), cfg.n)
            self.log({"kind": "eval", "step": step, "benchmark": name,
                      **evaluation.pass_at_k_metrics(correct, cfg.ks)})  # fmt: skip
        model.train()


def grpo_config(run, out: str):
    from trl import GRPOConfig

    o, r = run.optim, run.rollout
    return GRPOConfig(
        output_dir=out, max_steps=run.steps, seed=run.seed, learning_rate=o.lr,
        max_grad_norm=o.max_grad_norm or 0.0,
        per_device_train_batch_size=r.prompts_per_step * r.group_size, num_generations=r.group_size,
        max_completion_length=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        loss_type="dapo", epsilon=run.loss.eps_low, epsilon_high=run.loss.eps_high, beta=0.0, num_iterations=1,
        scale_rewards="group", mask_truncated_completions=False, use_cpu=True, bf16=False, fp16=False,
        logging_steps=1, save_strategy="no", report_to=[], disable_dropout=True, log_completions=False,
    )  # fmt: skip


def optimizer(run, model):
    """AdamW as ``lspo-train`` steps it: weight decay on every parameter (the Trainer's own spares biases and
    norms) and ``lr * min(1, (t + 1) / warmup)`` from the first step (the Trainer's warm-up starts at 0)."""
    import torch

    o = run.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.b1, o.b2), eps=o.eps, weight_decay=o.weight_decay)
    warm = max(o.warmup_steps, 1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / warm))


def train(run, out: str) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOTrainer

    path = model_dir(run, os.path.join(out, "cache"))
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = hf.load_tokenizer(path)
    rows = sources.read_rows(run.data.train, seed=run.seed)
    dataset = Dataset.from_list([{"prompt": prompt_text(r, tokenizer), "answer": r["answer"]} for r in rows])
    log_file = open(os.path.join(out, "metrics.jsonl"), "w")

    def log(record: dict) -> None:
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()

    def reward(completions, answer, completion_ids, **_):
        accuracy = np.array([rewards.math_reward(c, g) for c, g in zip(completions, answer, strict=True)])
        lengths = np.array([len(ids) for ids in completion_ids])  # EOS counted, as the project counts it
        r = run.reward
        shaped = rewards.shaped_rewards(
            accuracy, lengths, max_len=run.rollout.max_new_tokens, buffer=r.overlong_buffer, factor=r.overlong_factor
        )
        return [float(x) for x in shaped.reward]

    validate = Validator(run, tokenizer, held_out(run, tokenizer), log)

    class Callbacks(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **_):
            validate(model, 0)

        def on_log(self, args, state, control, logs=None, **_):
            if logs and "reward" in logs:
                lengths = logs.get("completions/mean_length")
                log({"kind": "train", "step": state.global_step, "reward_mean": logs["reward"],
                     "entropy": logs.get("entropy"), "response_len_mean": lengths})  # fmt: skip

        def on_step_end(self, args, state, control, model=None, **_):
            every = run.eval.every
            if (every and state.global_step % every == 0) or state.global_step == run.steps:
                validate(model, state.global_step)

    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=grpo_config(run, out), train_dataset=dataset,
        processing_class=tokenizer, callbacks=[Callbacks()], optimizers=optimizer(run, model),
    )  # fmt: skip
    trainer.train()
    log_file.close()


def main(argv: list[str] | None = None) -> int:
    return run_main("trl_reference", _reference, argv)


def _reference(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--out", default="runs/trl")
    p.add_argument("--dapo", action="append", default=[], help="a DAPO-arm run directory to draw beside TRL's run")
    p.add_argument("--no-train", action="store_true", help="reuse OUT's recorded run: only draw and tabulate")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    try:
        import trl  # noqa: F401
    except ImportError as err:
        raise ConfigError("TRL is not installed; pip install -e '.[reference]'") from err
    run = load_config(args.config, [*args.overrides, "scaffold.enabled=false"])
    if not args.no_train:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "config.json"), "w") as f:
            json.dump(to_dict(run), f, indent=1)
        train(run, args.out)
    evals = tuple(r for r in read_metrics(os.path.join(args.out, "metrics.jsonl")) if r.get("kind") == "eval")
    runs = [tables.RunTrace("trl", run.seed, evals, steps=run.steps)] + [parse_run(d) for d in args.dapo]
    print(tables.markdown(tables.peak_table(runs, baseline="trl")))
    print(f"trl_reference: wrote {tables.plot_curves(runs, os.path.join(args.out, 'trl_vs_dapo.png'))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
