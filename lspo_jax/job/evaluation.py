"""Held-out evaluation: benchmarks by name, ``n`` samples per problem, pass@k by two estimators.

One code path serves validation inside a training run (``Run.validate``, every ``eval.every`` steps) and
``lspo-eval`` on a saved model: ``evaluate_benchmarks`` samples ``eval.n`` responses per problem from the
base policy (a ``generator.Generator``: the JAX sampler, or the run's vLLM engine), scores them with the run's
verifier and reduces the [problems, n] table of passes to pass@k. Benchmarks are scored one by one, so a
result (and a ``metrics.jsonl`` record) is per benchmark. The paper reports the first-k-slice estimator; the
unbiased one is logged beside it. Validation also scores the base's log-likelihood of each benchmark's gold worked
solutions (``gold_logprob``): a signal that moves before pass@k does, on a class that no sample passes yet, and the
spread of the samples' final answers (``answer_entropy``): a policy that sharpens onto one answer a problem, right
or wrong, shows it there before its pass@k falls. On chosen steps a coverage pass (``eval.coverage_n`` samples a
problem, ``coverage``) adds pass@k up to k = 256 or more and the distinct correct completions to those records: does
training widen what the base can solve at all, or only sharpen what it already could?

``lspo-eval`` reports more of each benchmark (``grade``, ``benchmark_result``): the standard error of the accuracy
over problems, the share of samples cut off at the token budget, the accuracy of the samples that ended, and, over
repeats with other seeds, each metric's mean and standard error; ``sample_records`` are its per-sample lines.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.metadata
import math
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from lspo_jax.rl import packing

ESTIMATORS = {"first_k": "", "unbiased": "_unbiased"}  # estimator -> suffix of its metric key


def pass_at_k(correct: np.ndarray, k: int, estimator: str = "first_k") -> float:
    """Mean over problems of pass@k from ``correct`` [problems, samples] booleans.

    ``first_k``: problem passes iff any of its first k samples passes (the paper's reading of its traces).
    ``unbiased``: ``1 - C(n - c, k) / C(n, k)`` with n samples of which c pass (Chen et al. 2021, eq. 1),
    the expected first-k-slice value over all orderings of the n samples; computed as
    ``(C(n, k) - C(n - c, k)) / C(n, k)`` in Python's exact integers, one rounding at the division, so it is exact
    to float precision and never overflows, whatever n (C(2048, 1024) ~ 1e615 is far beyond a float's 1.8e308).
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
        counts = correct.sum(axis=1).tolist()
        per_count = {c: _unbiased(n, c, k) for c in set(counts)}  # one exact computation per distinct count
        return float(np.mean([per_count[c] for c in counts]))
    raise ValueError(f"estimator must be 'first_k' or 'unbiased', got {estimator!r}")


def _unbiased(n: int, c: int, k: int) -> float:
    """``1 - C(n - c, k) / C(n, k)``: the chance that k of n samples drawn without replacement hold one of the c that
    pass. Int / int in Python rounds once, correctly, however large the ints (no float comb, no overflow)."""
    total = math.comb(n, k)
    return (total - math.comb(n - c, k)) / total


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
def sampling_settings(run) -> dict[str, Any]:
    """What held-out samples are drawn with: ``eval.n``, ``eval.temperature``, ``eval.top_p`` (null:
    ``rollout.top_p``), ``eval.max_new_tokens``, and ``rollout.top_k``."""
    cfg = run.eval
    top_p = run.rollout.top_p if cfg.top_p is None else cfg.top_p
    return {"n": cfg.n, "temperature": cfg.temperature, "top_p": top_p, "max_new_tokens": cfg.max_new_tokens,
            "top_k": run.rollout.top_k}  # fmt: skip


def sample_responses(run, generator, params, prompts: Sequence[Sequence[int]], key, cancel=None) -> list[str]:
    """``eval.n`` responses per prompt (n consecutive texts per prompt) from the base policy, decoded for the
    verifier (special tokens dropped), drawn with ``sampling_settings``. ``generator``: a ``generator.Generator`` (a
    run's vLLM engine samples when its context holds the longest prompt plus ``eval.max_new_tokens``; else the JAX
    sampler). ``cancel``: asked between the JAX sampler's decode segments; True cuts every row short there, for a
    caller that drops them."""
    s = sampling_settings(run)
    decoding = generator.decoding(s["max_new_tokens"], s["temperature"], s["top_p"], s["top_k"])
    options = {} if cancel is None else {"cancel": cancel}
    sample = generator.generate(params, prompts, decoding, key=key, n=s["n"], lora_scale=0.0, **options)
    return [decode(generator.tokenizer, tokens[:length])
            for tokens, length in zip(sample.tokens, sample.lengths.tolist(), strict=True)]  # fmt: skip


def decode(tokenizer, tokens) -> str:
    """A response's text as the verifier reads it: special tokens (the EOS) dropped."""
    return tokenizer.decode(tokens, skip_special_tokens=True)


class ValidationStopped(Exception):
    """Validation was asked to stop (``stop()`` became true) and ended before its next batch of samples."""


def _check(stop: Callable[[], bool] | None) -> None:
    if stop is not None and stop():
        raise ValidationStopped("stopped during validation")


def _cancel(stop: Callable[[], bool] | None) -> Callable[[], bool] | None:
    """``stop`` as the sampler's ``cancel``, asked between decode segments, so a stop waits for one segment, not a
    whole batch of long samples. One process only: with several, ``stop`` is a collective, and the segment at which
    each process's sampler asks is not held equal."""
    return stop if stop is not None and jax.process_count() == 1 else None


def correct_table(run, generator, params, examples: Sequence[Any], pool, key, stop=None) -> np.ndarray:
    """[problems, eval.n] booleans: which samples of each problem pass, in sampling order.

    Problems are sampled ``rollout.prompts_per_step`` at a time, each chunk with its own key; ``stop`` (a
    callable) is asked before each chunk, and when it answers true ``ValidationStopped`` is raised.
    """
    return graded_samples(run, generator, params, examples, pool, key, stop)[0]


def graded_samples(run, generator, params, examples, pool, key, stop=None) -> tuple[np.ndarray, np.ndarray]:
    """``correct_table``'s booleans and, per problem, the entropy of its samples' final answers
    (``answer_entropy``)."""
    correct, spread, _ = _graded(run, generator, params, examples, pool, key, stop, run.rollout.prompts_per_step)
    return correct, spread


def _graded(run, generator, params, examples, pool, key, stop, chunk_size: int) -> tuple[np.ndarray, ...]:
    """``graded_samples``'s two arrays and, per problem, its ``distinct_correct`` count; ``run.eval.n`` samples
    a problem, ``chunk_size`` problems a batch."""
    n = run.eval.n
    rows, spread, distinct = [], [], []
    for start in range(0, len(examples), chunk_size):
        _check(stop)
        chunk = examples[start : start + chunk_size]
        prompts = [ex.prompt_ids for ex in chunk]
        cancel = _cancel(stop)
        chunk_key = jax.random.fold_in(key, start)
        texts = sample_responses(run, generator, params, prompts, chunk_key, **({"cancel": cancel} if cancel else {}))
        _check(stop)  # a call cut short by the stop holds rows cut short: dropped, not graded
        accuracy = np.asarray(pool.score(texts, [ex.answer for ex in chunk for _ in range(n)]))
        rows.append(accuracy.reshape(len(chunk), n) > 0)
        spread.extend(answer_entropy(texts[i : i + n]) for i in range(0, len(texts), n))
        distinct.extend(distinct_correct(texts[i * n : (i + 1) * n], row) for i, row in enumerate(rows[-1]))
    if not rows:
        return np.zeros((0, n), bool), np.zeros(0), np.zeros(0, int)
    return np.concatenate(rows), np.asarray(spread), np.asarray(distinct)


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
    run, generator, params, benchmarks: Mapping[str, Sequence[Any]], pool, key, logprobs=None, stop=None, step=None
) -> dict[str, dict]:
    """``evaluate`` on each benchmark with at least one problem: name -> its metrics, with the ``coverage`` pass's
    where ``coverage_due(run, step)`` (a validation during training at ``step``; None: never). ``stop``: see
    ``correct_table``; a stopped validation returns nothing."""
    covered = coverage_names(run, benchmarks) if coverage_due(run, step) else ()
    results = {}
    for name, examples in benchmarks.items():
        if examples:
            results[name] = evaluate(run, generator, params, examples, pool, benchmark_key(key, name), logprobs, stop)
            if name in covered:
                results[name].update(coverage(run, generator, params, examples, pool, benchmark_key(key, name), stop))
    return results


# -------------------------------------------------------------------------------------------------- coverage
COVERAGE = "coverage/"  # the prefix of the coverage pass's keys in a benchmark's ``eval`` record
_COVERAGE_DRAWS = zlib.crc32(b"coverage")  # folded into a benchmark's key: draws apart from its validation's


def coverage_due(run, step: int | None) -> bool:
    """Whether validation at ``step`` adds the coverage pass: ``eval.coverage_n`` set, and ``step`` 0, the last
    (``steps``) or a multiple of ``eval.coverage_every``. Every such step is a validation step
    (``EvalConfig`` checks), and the pass's keys are in that step's ``eval`` records: a resumed run that finds them
    does not repeat it, and one that does not (stopped or killed before they were written) does it again."""
    cfg = run.eval
    if cfg.coverage_n is None or step is None:
        return False
    return step in (0, run.steps) or bool(cfg.coverage_every and step % cfg.coverage_every == 0)


def coverage_names(run, benchmarks: Mapping[str, Any]) -> tuple[str, ...]:
    """``eval.coverage_benchmarks`` (empty: every benchmark of ``benchmarks``); its names were checked against the
    benchmarks validated at start-up (``build.check_coverage_names``)."""
    return tuple(run.eval.coverage_benchmarks or benchmarks)


def coverage_ks(n: int) -> list[int]:
    """The ks of the coverage pass: the powers of two up to n, and n itself (n = 256: 1, 2, 4, ..., 256)."""
    return sorted({2**j for j in range(n.bit_length()) if 2**j <= n} | {n})


def distinct_correct(texts: Sequence[str], correct: Sequence[bool]) -> int:
    """How many different passing completions one problem's samples hold: the passing texts, each with its runs of
    whitespace made one space, counted once each.

    Texts rather than extracted answers: a problem has one gold answer, so the distinct correct answers are 1 (or a
    few equivalent spellings of it) wherever the problem is solved, which pass@n already says. The distinct correct
    texts tell apart a policy that reaches the answer by one memorised path, many samples of it (sharpened: 1),
    from one that finds several ways to it (many); whitespace alone does not make a path new."""
    return len({" ".join(text.split()) for text, ok in zip(texts, correct, strict=True) if ok})


def coverage(run, generator, params, examples: Sequence[Any], pool, key, stop=None) -> dict[str, Any]:
    """``eval.coverage_n`` samples a problem (each with the validation's sampling settings), as ``COVERAGE`` keys:
    pass@k by both estimators for each of ``coverage_ks`` (``pass_at_k_metrics``: also ``accuracy`` and
    ``problems``), ``n``, ``distinct_correct`` (the mean over problems of ``distinct_correct``, 0 for an unsolved
    one) and ``distinct_correct_solved`` (the mean over the solved problems alone; None when none is). Problems are
    sampled as many at a time as keep a batch's rows at validation's (``prompts_per_step * eval.n``), at least one."""
    n = run.eval.coverage_n
    wide = dataclasses.replace(run, eval=dataclasses.replace(run.eval, n=n, ks=(n,)))
    chunk = max(1, run.rollout.prompts_per_step * run.eval.n // n)
    correct, _, distinct = _graded(wide, generator, params, examples, pool, jax.random.fold_in(key, _COVERAGE_DRAWS),
                                   stop, chunk)  # fmt: skip
    metrics = {**pass_at_k_metrics(correct, coverage_ks(n)), "n": n, "distinct_correct": float(distinct.mean())}
    solved = distinct[correct.any(axis=1)]
    metrics["distinct_correct_solved"] = float(solved.mean()) if solved.size else None
    return {COVERAGE + key: value for key, value in metrics.items()}


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


# ------------------------------------------------------------------------------------------- lspo-eval's report
class Recorder:
    """A generator that keeps each batch it samples: the token ids and EOS flags behind the texts that
    ``graded_samples`` grades, in its order (chunk after chunk, n rows a problem). Through it ``lspo-eval`` reports
    per sample what validation reduces to passes, sampled and graded by validation's own code."""

    def __init__(self, generator):
        self.generator, self.batches = generator, []

    @property
    def tokenizer(self) -> Any:
        return self.generator.tokenizer

    def decoding(self, *args) -> Any:
        return self.generator.decoding(*args)

    def generate(self, *args, **kwargs) -> Any:
        batch = self.generator.generate(*args, **kwargs)
        self.batches.append(batch)
        return batch


@dataclasses.dataclass(frozen=True)
class Graded:
    """One repeat of a benchmark (sampled with ``seed``), graded: ``correct`` [problems, n] in sampling order and
    ``answer_entropy`` [problems]; ``tokens`` each sample's ids, problem after problem (an EOS kept), and
    ``terminated`` [problems, n] whether it ended on an EOS token rather than at ``eval.max_new_tokens``. Those two
    are None when the texts came from no batch of the generator's (a test's scripted responses)."""

    seed: int
    correct: np.ndarray
    answer_entropy: np.ndarray
    tokens: list[np.ndarray] | None = None
    terminated: np.ndarray | None = None


def grade(run, generator, params, examples: Sequence[Any], pool, key, seed: int, stop=None) -> Graded:
    """``graded_samples`` with each sample's tokens and ending kept (``Recorder``); ``stop``: see ``correct_table``."""
    recorder = Recorder(generator)
    correct, spread = graded_samples(run, recorder, params, examples, pool, key, stop)
    batches = recorder.batches
    tokens = [batch.tokens[row, :length] for batch in batches for row, length in enumerate(batch.lengths.tolist())]
    if not tokens or len(tokens) != correct.size:
        return Graded(seed, correct, spread)
    ended = np.concatenate([np.asarray(batch.eos, bool) for batch in batches]).reshape(correct.shape)
    return Graded(seed, correct, spread, tokens, ended)


def mean_stderr(values: Sequence[float]) -> tuple[float, float | None]:
    """The mean of m values and its standard error ``s / sqrt(m)``, s the sample standard deviation (ddof = 1);
    the error is None (null in the output) for a single value, which says nothing of the spread."""
    values = np.asarray(values, np.float64)
    stderr = float(values.std(ddof=1) / math.sqrt(values.size)) if values.size > 1 else None
    return float(values.mean()), stderr


def completion_metrics(correct: np.ndarray, terminated: np.ndarray | None) -> dict[str, float | None]:
    """``truncation_rate``: the share of samples that reached the token budget without ending (no EOS);
    ``completed_accuracy``: the share that pass AND ended (Marin's "completed" score: a pass is not counted when
    the text ran out of budget). Both None when it is not known which samples ended."""
    if terminated is None:
        return {"truncation_rate": None, "completed_accuracy": None}
    return {"truncation_rate": float(np.mean(~terminated)), "completed_accuracy": float(np.mean(correct & terminated))}


def repeat_metrics(graded: Graded, ks: Sequence[int]) -> dict[str, Any]:
    """One repeat's metrics: ``pass_at_k_metrics``; ``accuracy_stderr``, the standard error over problems of the
    per-problem pass fraction ``c_p / n`` whose mean is ``accuracy`` (``mean_stderr``: None with one problem);
    ``completion_metrics``; the mean ``answer_entropy``."""
    metrics = pass_at_k_metrics(graded.correct, ks)
    metrics["accuracy_stderr"] = mean_stderr(graded.correct.mean(axis=1))[1]
    metrics.update(completion_metrics(graded.correct, graded.terminated))
    metrics["answer_entropy"] = float(graded.answer_entropy.mean())
    return metrics


REPEATED = ("accuracy", "completed_accuracy", "truncation_rate")  # with each pass@k: summarised over seeds


def over_repeats(repeats: Sequence[Mapping[str, Any]], ks: Sequence[int]) -> dict[str, Any]:
    """Over repeats with different seeds (evalchemy's protocol), each of ``REPEATED`` and each pass@k (both
    estimators): ``{"mean", "stderr"}``, the stderr ``std(ddof=1) / sqrt(repeats)`` (None with one repeat; both
    None where a repeat lacks the value)."""
    summary: dict[str, Any] = {"repeats": len(repeats)}
    for key in (*REPEATED, *(metric_key(k, est) for est in ESTIMATORS for k in ks)):
        values = [r[key] for r in repeats]
        mean, stderr = (None, None) if None in values else mean_stderr(values)
        summary[key] = {"mean": mean, "stderr": stderr}
    return summary


def benchmark_result(examples: Sequence[Any], repeats: Sequence[Graded], ks: Sequence[int]) -> dict[str, Any]:
    """A benchmark's record in ``lspo-eval``'s output. Its metrics are each repeat's ``repeat_metrics`` averaged
    over the repeats (one repeat: its own), except ``accuracy_stderr``: over problems, of each problem's pass
    fraction over all its samples of every seed. Then ``repeats`` (each seed's metrics), ``over_seeds``
    (``over_repeats``) and ``per_problem``: each problem's id, its samples' passes seed after seed (n a seed) and
    its ``answer_entropy`` averaged over the seeds."""
    each = [{"seed": graded.seed, **repeat_metrics(graded, ks)} for graded in repeats]
    correct = np.concatenate([graded.correct for graded in repeats], axis=1)
    spread = np.mean([graded.answer_entropy for graded in repeats], axis=0)
    averaged = {key: _mean_or_none([r[key] for r in each]) for key in each[0] if key not in ("seed", "problems")}
    averaged["accuracy_stderr"] = mean_stderr(correct.mean(axis=1))[1]
    per_problem = [{"id": ex.id, "correct": row.tolist(), "answer_entropy": h}
                   for ex, row, h in zip(examples, correct, spread.tolist(), strict=True)]  # fmt: skip
    return {"problems": len(examples), **averaged, "repeats": each, "over_seeds": over_repeats(each, ks),
            "per_problem": per_problem}  # fmt: skip


def _mean_or_none(values: Sequence[float | None]) -> float | None:
    return None if None in values else float(np.mean(values))


def sample_records(benchmark: str, examples: Sequence[Any], graded: Graded, tokenizer) -> Iterator[dict[str, Any]]:
    """One repeat's per-sample lines: ``benchmark``, ``seed``, the problem's ``id`` and ``gold`` answer, ``sample``
    (its index among the problem's n), ``text`` (as the verifier read it), ``tokens``, ``extracted_answer`` (the
    last ``\\boxed{}``'s content, None without one), ``reward`` (0 or 1), ``length`` (tokens, an EOS counted) and
    ``terminated`` (ended on an EOS). No line at all where the samples' tokens were not seen (``Graded``)."""
    from lspo_jax.tasks.rewards import last_boxed

    n = graded.correct.shape[1]
    for i, tokens in enumerate(graded.tokens or ()):
        problem, sample = divmod(i, n)
        text = decode(tokenizer, tokens)
        yield {"benchmark": benchmark, "seed": graded.seed, "id": examples[problem].id,
               "gold": examples[problem].answer, "sample": sample, "text": text, "tokens": tokens.tolist(),
               "extracted_answer": last_boxed(text), "reward": int(graded.correct[problem, sample]),
               "length": len(tokens), "terminated": bool(graded.terminated[problem, sample])}  # fmt: skip


VERSIONED = ("lspo_jax", "jax", "jaxlib", "transformers", "math-verify")  # the packages a score depends on


def package_versions(names: Sequence[str] = VERSIONED) -> dict[str, str | None]:
    """The installed version of each of ``names`` (None: not installed)."""
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


# ----------------------------------------------------------------------------------------------- output
def format_results(results: Mapping[str, Mapping[str, Any]], ks: Sequence[int]) -> str:
    """A Markdown table: per benchmark, pass@k (%) for each k by each estimator, the sample accuracy (with its
    standard error over problems where the record has one), the share of samples truncated at the token budget
    and the completed-only accuracy (n/a where the record lacks them); below it, for a benchmark repeated over
    several seeds, the mean and standard error over the seeds."""
    head = "| benchmark | problems | estimator | " + " | ".join(f"pass@{k}" for k in ks)
    lines = [head + " | accuracy | truncated | completed |", "|" + "---|" * (6 + len(ks))]
    for name, result in results.items():
        stderr = result.get("accuracy_stderr")
        accuracy = _pct(result.get("accuracy")) + ("" if stderr is None else f" ± {_pct(stderr)}")
        tail = [accuracy, _pct(result.get("truncation_rate")), _pct(result.get("completed_accuracy"))]
        for est in ESTIMATORS:
            cells = [_pct(result.get(metric_key(k, est))) for k in ks] + tail
            lines.append(f"| {name} | {result.get('problems', '')} | {est} | " + " | ".join(cells) + " |")
    for name, result in results.items():
        seeds = result.get("over_seeds") or {}
        if seeds.get("repeats", 1) > 1:
            cells = [f"{key} {_pct(seeds[key]['mean'])} ± {_pct(seeds[key]['stderr'])}" for key in REPEATED]
            lines.append(f"{name} over {seeds['repeats']} seeds (mean ± stderr, %): " + ", ".join(cells))
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}"
