"""Held-out evaluation: benchmarks by name, ``n`` samples per problem, pass@k by two estimators.

One code path serves validation inside a training run (``Run.validate``, every ``eval.every`` steps) and
``lspo-eval`` on a saved model: ``evaluate_benchmarks`` samples ``eval.n`` responses per problem from the
base policy (a ``learner.Generator``: the JAX sampler, or the run's vLLM engine), scores them with the run's
verifier and reduces the [problems, n] table of passes to pass@k. Benchmarks are scored one by one, so a
result (and a ``metrics.jsonl`` record) is per benchmark. The paper reports the first-k-slice estimator; the
unbiased one is logged beside it. Validation also scores the base's log-likelihood of each benchmark's gold worked
solutions (``gold_logprob``): a signal that moves before pass@k does, on a class that no sample passes yet, and the
spread of the samples' final answers (``answer_entropy``): a policy that sharpens onto one answer a problem, right
or wrong, shows it there before its pass@k falls.
"""

from __future__ import annotations

import collections
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from lspo_jax.rl import packing

ESTIMATORS = {"first_k": "", "unbiased": "_unbiased"}  # estimator -> suffix of its metric key


def pass_at_k(correct: np.ndarray, k: int, estimator: str = "first_k") -> float:
    """Mean over problems of pass@k from ``correct`` [problems, samples] booleans.

    ``first_k``: problem passes iff any of its first k samples passes (the paper's reading of its traces).
    ``unbiased``: ``1 - C(n - c, k) / C(n, k)`` with n samples of which c pass (Chen et al. 2021, eq. 1),
    the expected first-k-slice value over all orderings of the n samples.
    """
    correct = np.asarray(correct, dtype=bool)
    if correct.ndim != 2:
        raise ValueError(f"correct must be [problems, samples], got shape {correct.shape}")
    n = correct.shape[1]
    if not 0 < k <= n:
        raise ValueError(f"k must be in 1..{n} (samples per problem), got {k}")
    if correct.shape[0] == 0:
        raise ValueError("pass_at_k of zero problems is undefined")
    if estimator == "first_k":
        return float(np.mean(np.any(correct[:, :k], axis=1)))
    if estimator == "unbiased":
        c = correct.sum(axis=1)
        fail_all = [math.comb(n - int(ci), k) / math.comb(n, k) for ci in c]
        return float(np.mean(1.0 - np.asarray(fail_all)))
    raise ValueError(f"estimator must be 'first_k' or 'unbiased', got {estimator!r}")


def metric_key(k: int, estimator: str = "first_k") -> str:
    """The name a pass@k value has in results and ``metrics.jsonl``: ``pass@4`` or ``pass@4_unbiased``."""
    return f"pass@{k}{ESTIMATORS[estimator]}"


def pass_at_k_metrics(correct: np.ndarray, ks: Sequence[int]) -> dict[str, float]:
    """pass@k for each k by both estimators, the per-sample ``accuracy`` and the number of ``problems``."""
    out = {metric_key(k, est): pass_at_k(correct, k, est) for est in ESTIMATORS for k in ks}
    out["accuracy"] = float(np.mean(correct))
    out["problems"] = int(np.shape(correct)[0])
    return out


# ---------------------------------------------------------------------------------------------- sampling
def sample_responses(run, generator, params, prompts: Sequence[Sequence[int]], key) -> list[str]:
    """``eval.n`` responses per prompt (n consecutive texts per prompt) from the base policy, decoded for the
    verifier (special tokens dropped); top-p and top-k are the run's rollout settings. ``generator``: a
    ``learner.Generator`` (a run's vLLM engine samples when its context holds the longest prompt plus
    ``eval.max_new_tokens``; else the JAX sampler)."""
    cfg = run.eval
    decoding = generator.decoding(cfg.max_new_tokens, cfg.temperature, run.rollout.top_p, run.rollout.top_k)
    sample = generator.generate(params, prompts, decoding, key=key, n=cfg.n, lora_scale=0.0)
    return [
        generator.tokenizer.decode(tokens[:length], skip_special_tokens=True)
        for tokens, length in zip(sample.tokens, sample.lengths.tolist(), strict=True)
    ]


class ValidationStopped(Exception):
    """Validation was asked to stop (``stop()`` became true) and ended before its next batch of samples."""


def _check(stop: Callable[[], bool] | None) -> None:
    if stop is not None and stop():
        raise ValidationStopped("stopped during validation")


def correct_table(run, generator, params, examples: Sequence[Any], pool, key, stop=None) -> np.ndarray:
    """[problems, eval.n] booleans: which samples of each problem pass, in sampling order.

    Problems are sampled ``rollout.prompts_per_step`` at a time, each chunk with its own key; ``stop`` (a
    callable) is asked before each chunk, and when it answers true ``ValidationStopped`` is raised.
    """
    return graded_samples(run, generator, params, examples, pool, key, stop)[0]


def graded_samples(run, generator, params, examples, pool, key, stop=None) -> tuple[np.ndarray, np.ndarray]:
    """``correct_table``'s booleans and, per problem, the entropy of its samples' final answers
    (``answer_entropy``)."""
    n, chunk_size = run.eval.n, run.rollout.prompts_per_step
    rows, spread = [], []
    for start in range(0, len(examples), chunk_size):
        _check(stop)
        chunk = examples[start : start + chunk_size]
        prompts = [ex.prompt_ids for ex in chunk]
        texts = sample_responses(run, generator, params, prompts, jax.random.fold_in(key, start))
        accuracy = np.asarray(pool.score(texts, [ex.answer for ex in chunk for _ in range(n)]))
        rows.append(accuracy.reshape(len(chunk), n) > 0)
        spread.extend(answer_entropy(texts[i : i + n]) for i in range(0, len(texts), n))
    if not rows:
        return np.zeros((0, n), bool), np.zeros(0)
    return np.concatenate(rows), np.asarray(spread)


def answer_entropy(responses: Sequence[str]) -> float:
    """The entropy (nats) of the final answers among one problem's samples: 0 when every sample gives the same
    answer, ``ln n`` when all ``n`` differ. The answer is the last ``\\boxed{}``'s content, compared verbatim; the
    samples without one count as one more answer, shared by all of them (so samples cut off before any answer read as
    agreeing). With one sample a problem it is always 0."""
    from lspo_jax.tasks.rewards import last_boxed

    counts = np.fromiter(collections.Counter(last_boxed(r) for r in responses).values(), float)
    p = counts / counts.sum()
    return float(max(0.0, -(p * np.log(p)).sum()))  # max: -0.0 when all agree


def evaluate(run, generator, params, examples: Sequence[Any], pool, key, logprobs=None, stop=None) -> dict[str, float]:
    """pass@k (first-k slice and unbiased) over ``eval.n`` samples per problem, for each k of ``eval.ks``, and the
    mean over problems of ``answer_entropy``; with ``logprobs`` (see ``gold_logprob``) also the gold solutions'
    log-likelihood. ``stop``: see ``correct_table``."""
    correct, spread = graded_samples(run, generator, params, examples, pool, key, stop)
    metrics = pass_at_k_metrics(correct, run.eval.ks)
    metrics["answer_entropy"] = float(spread.mean())
    if logprobs is not None:
        # As many rows a pass as the RL step's batch, which the log-prob pass's micro-batches are sized for.
        rows = run.rollout.prompts_per_step * run.rollout.group_size
        limits = run.data.max_prompt_tokens, run.data.max_solution_tokens
        metrics.update(gold_logprob(logprobs, examples, *limits, rows, stop=stop))
    return metrics


def benchmark_key(key, name: str):
    """A benchmark's own key, derived from its name: adding or reordering benchmarks changes no other's draws."""
    return jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)


def evaluate_benchmarks(
    run, generator, params, benchmarks: Mapping[str, Sequence[Any]], pool, key, logprobs=None, stop=None
) -> dict[str, dict]:
    """``evaluate`` on each benchmark with at least one problem: name -> its metrics. ``stop``: see
    ``correct_table``; a stopped validation returns nothing."""
    return {
        name: evaluate(run, generator, params, examples, pool, benchmark_key(key, name), logprobs, stop)
        for name, examples in benchmarks.items()
        if examples
    }


# ---------------------------------------------------------------------------------------- gold log-likelihood
GOLD_KEYS = ("gold_logprob", "gold_logprob_seq")  # the log-likelihood metrics, higher is better


def gold_logprob(
    logprobs: Callable[[packing.Rows], np.ndarray],
    examples: Sequence[Any],
    max_prompt_tokens: int,
    max_solution_tokens: int,
    max_rows: int,
    *,
    stop: Callable[[], bool] | None = None,
) -> dict[str, float]:
    """The teacher-forced log-likelihood of the examples' gold worked solutions (``solution_ids``) after their
    prompts, examples without one left out; ``{}`` when none has one (a benchmark shipped without solutions).

        gold_logprob      sum over every gold token of log p(token | prompt, gold before it) / gold tokens
        gold_logprob_seq  mean over solutions of the solution's summed log-prob
        gold_solutions, gold_tokens   what was scored

    ``gold_logprob`` pools the tokens (nats per token; ``exp(-gold_logprob)`` is the gold text's perplexity)
    rather than averaging each solution's mean, so a long solution weighs by its length and the two metrics
    differ by the constant factor ``gold_tokens / gold_solutions``. ``logprobs`` maps ``packing.pack_sft`` rows
    to per-token log-probs aligned with their tokens (``logprobs.sequence_logprobs``), at most ``max_rows`` rows
    a call; the rows are as long as the longest prompt and solution need (``packing.sft_slots``). ``stop`` is
    asked before each call, as in ``correct_table``.
    """
    scored = [ex for ex in examples if ex.solution_ids is not None and len(ex.solution_ids)]
    if not scored:
        return {}
    prompts, solutions = [ex.prompt_ids for ex in scored], [ex.solution_ids for ex in scored]
    slots = packing.sft_slots(prompts, solutions, max_prompt_tokens, max_solution_tokens)
    sums, tokens = [], 0
    for start in range(0, len(scored), max_rows):
        _check(stop)
        rows = packing.pack_sft(prompts[start : start + max_rows], solutions[start : start + max_rows], *slots)
        gold = rows["mask"] > 0
        logp = np.asarray(logprobs(rows), np.float64)  # float64 sums: a benchmark holds up to millions of tokens
        sums.append(np.sum(np.where(gold, logp, 0.0), axis=1))
        tokens += int(gold.sum())
    total = np.concatenate(sums)
    return {"gold_logprob": float(total.sum() / tokens), "gold_logprob_seq": float(total.mean()),
            "gold_solutions": len(scored), "gold_tokens": tokens}  # fmt: skip


# ----------------------------------------------------------------------------------------------- output
def format_results(results: Mapping[str, Mapping[str, Any]], ks: Sequence[int]) -> str:
    """A Markdown table: per benchmark, pass@k (%) for each k by each estimator, and the sample accuracy."""
    head = "| benchmark | problems | estimator | " + " | ".join(f"pass@{k}" for k in ks) + " | accuracy |"
    lines = [head, "|" + "---|" * (4 + len(ks))]
    for name, result in results.items():
        for est in ESTIMATORS:
            cells = [_pct(result.get(metric_key(k, est))) for k in ks]
            lines.append(f"| {name} | {result.get('problems', '')} | {est} | " + " | ".join(cells)
                         + f" | {_pct(result.get('accuracy'))} |")  # fmt: skip
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}"
