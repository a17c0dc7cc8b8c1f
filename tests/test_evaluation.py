"""pass@k by hand, benchmark names, the gold solutions' log-likelihood (by hand, and in validation against
transformers' logits), and ``lspo-eval`` end to end on a tiny model: from a Hugging Face directory with the JAX
sampler on MATH500, and from a training run's checkpoint with scripted responses."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal

import jax
import numpy as np
import pytest

from lspo_jax.job import cli, errors, eval_command, evaluation, toy_model
from lspo_jax.job.evaluation import pass_at_k
from lspo_jax.models import hf
from lspo_jax.tasks import benchmarks, data
from lspo_jax.tasks.rewards import math_reward
from lspo_jax.train_config import ConfigError

F, T = False, True


# ------------------------------------------------------------------------------------------------ pass@k
def test_pass_at_k_by_hand():
    one = np.array([[F, F, T, F]])  # 4 samples, 1 correct (the third)
    # Unbiased: 1 - C(n - c, k) / C(n, k) = 1 - C(3, 2) / C(4, 2) = 1 - 3/6 = 0.5.
    assert pass_at_k(one, 2, "unbiased") == 0.5
    # First-k slice, in sample order: the first two fail, the first three hold the pass.
    assert [pass_at_k(one, k) for k in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 1.0]
    # Two problems: [F F T F] and [T T F F]. Unbiased pass@2 = (0.5 + (1 - C(2,2)/C(4,2))) / 2 = (0.5 + 5/6) / 2.
    two = np.array([[F, F, T, F], [T, T, F, F]])
    assert pass_at_k(two, 2, "unbiased") == pytest.approx((0.5 + 5 / 6) / 2)
    assert pass_at_k(two, 2) == 0.5  # problem 1 fails its first two samples, problem 2 passes both
    # k = 1: the first-k slice is the mean of the first samples, the unbiased estimator the mean of all samples.
    assert pass_at_k(two, 1) == np.mean(two[:, 0]) == 0.5
    assert pass_at_k(two, 1, "unbiased") == np.mean(two) == 3 / 8
    # k = n: both are "any sample passes".
    assert pass_at_k(two, 4) == pass_at_k(two, 4, "unbiased") == 1.0


def test_unbiased_is_the_first_k_slice_averaged_over_sample_orders():
    correct = np.array([[F, T, F, T, F], [F, F, F, F, T], [T, T, T, F, T]])
    for k in range(1, 6):
        orders = [correct[:, list(p)] for p in itertools.permutations(range(5))]
        mean = np.mean([pass_at_k(c, k) for c in orders])
        assert pass_at_k(correct, k, "unbiased") == pytest.approx(mean)


def test_unbiased_pass_at_k_is_exact_up_to_k_256_and_beyond():
    def one(n, c):  # one problem of n samples, c of them passing
        return np.arange(n)[None, :] < c

    # n = 256, c = 1: pass@k = 1 - C(255, k) / C(256, k) = 1 - (256 - k) / 256 = k / 256.
    assert [pass_at_k(one(256, 1), k, "unbiased") for k in (1, 16, 256)] == [1 / 256, 16 / 256, 1.0]
    # c = 2: pass@16 = 1 - C(254, 16) / C(256, 16) = 1 - (240 * 239) / (256 * 255) = 1 - 57360 / 65280
    # = 7920 / 65280 = 33 / 272 = 0.12132...; pass@1 = 2 / 256; pass@256: every sample drawn, so 1.
    assert [pass_at_k(one(256, 2), k, "unbiased") for k in (1, 16, 256)] == [2 / 256, 33 / 272, 1.0]
    # n = 1024 (C(1024, 512) has 307 digits): c = 1 gives k / 1024 exactly; c = 0 never passes, c = n always does.
    assert [pass_at_k(one(1024, 1), k, "unbiased") for k in (1, 512, 1024)] == [1 / 1024, 0.5, 1.0]
    assert pass_at_k(one(1024, 0), 512, "unbiased") == 0.0 and pass_at_k(one(1024, 1024), 1, "unbiased") == 1.0
    # The first-k slice averaged over every placement of 2 passes among 256 samples (all C(256, 2) = 32640 of them,
    # each as likely under a random order) is the unbiased value: 33 / 272 at k = 16.
    i, j = np.triu_indices(256, 1)
    placements = np.zeros((len(i), 256), bool)
    placements[np.arange(len(i)), i] = placements[np.arange(len(i)), j] = True
    assert pass_at_k(placements, 16) == pytest.approx(33 / 272, rel=1e-12)


def test_pass_at_k_refuses_bad_input():
    with pytest.raises(ValueError, match="k must be in 1..2"):
        pass_at_k(np.ones((3, 2), bool), 3)
    with pytest.raises(ValueError, match="estimator"):
        pass_at_k(np.ones((3, 2), bool), 1, "mean")
    with pytest.raises(ValueError, match="zero problems"):
        pass_at_k(np.ones((0, 2), bool), 1)


def test_metrics_keys_and_table():
    correct = np.array([[F, T], [F, F]])
    metrics = evaluation.pass_at_k_metrics(correct, [1, 2])
    assert metrics == {"pass@1": 0.0, "pass@2": 0.5, "pass@1_unbiased": 0.25, "pass@2_unbiased": 0.5,
                       "accuracy": 0.25, "problems": 2}  # fmt: skip
    # Per-problem fractions 0.5 and 0: stderr = sqrt(2 * 0.25^2 / 1) / sqrt(2) = 0.25. The first samples ended, the
    # second ones ran out of budget: truncated 2/4, and the one pass is a truncated one: completed 0.
    graded = evaluation.Graded(0, correct, np.zeros(2), terminated=np.array([[T, F], [T, F]]))
    lines = evaluation.format_results({"math500": evaluation.repeat_metrics(graded, [1, 2])}, [1, 2]).splitlines()
    assert lines[2:] == [
        "| math500 | 2 | first_k | 0.0 | 50.0 | 25.0 ± 25.0 | 50.0 | 0.0 |",
        "| math500 | 2 | unbiased | 25.0 | 50.0 | 25.0 ± 25.0 | 50.0 | 0.0 |",
    ]
    assert evaluation.format_results({"math500": metrics}, [1]).splitlines()[2].endswith("| 25.0 | n/a | n/a |")


def test_standard_errors_and_completion_by_hand():
    # Per-problem pass fractions 1, 0, 1/2, 1/2: mean 0.5; sample std sqrt((0.5^2 + 0.5^2 + 0 + 0) / 3) = sqrt(1/6);
    # stderr sqrt(1/6) / sqrt(4) = 0.2041.
    correct = np.array([[T, T], [F, F], [T, F], [F, T]])
    terminated = np.array([[T, F], [T, T], [T, T], [F, T]])
    metrics = evaluation.repeat_metrics(evaluation.Graded(7, correct, np.zeros(4), terminated=terminated), [1, 2])
    assert metrics["accuracy"] == 0.5 and metrics["accuracy_stderr"] == pytest.approx(math.sqrt(1 / 6) / 2)
    assert metrics["accuracy_stderr"] == pytest.approx(0.2041, abs=1e-4)
    # 2 of 8 samples did not end; passing and ended: (0, 0) (2, 0) (3, 1), so 3 of 8.
    assert (metrics["truncation_rate"], metrics["completed_accuracy"]) == (0.25, 0.375)
    assert evaluation.mean_stderr([0.5]) == (0.5, None)  # one problem (or one seed): no spread to estimate
    # Two seeds at accuracy 0.5 and 0.7: mean 0.6; std sqrt(2 * 0.1^2 / 1) = 0.1414; stderr 0.1414 / sqrt(2) = 0.1.
    over = evaluation.over_repeats([{**metrics, "accuracy": 0.5}, {**metrics, "accuracy": 0.7}], [1, 2])
    assert over["repeats"] == 2 and over["accuracy"] == pytest.approx({"mean": 0.6, "stderr": 0.1})
    assert over["pass@2_unbiased"] == {"mean": metrics["pass@2_unbiased"], "stderr": 0.0}


# ------------------------------------------------------------------------------------- gold log-likelihood
def test_gold_logprob_by_hand():
    examples = [
        data.Example("a", "1", (5, 6), np.array([7, 8, 9], np.int32)),
        data.Example("b", "1", (5,), None),  # no worked solution: left out
        data.Example("c", "1", (5,), np.array([4], np.int32)),
    ]
    calls = []

    def logprobs(rows):  # every token "scores" -0.5 * its id, so a prompt or pad token counted would show
        calls.append(len(rows["tokens"]))
        return -0.5 * rows["tokens"]

    out = evaluation.gold_logprob(logprobs, examples, max_prompt_tokens=4, max_solution_tokens=8, max_rows=1)
    # Solution a: -(3.5 + 4 + 4.5) = -12; c: -2. Per token, pooled: -14 / 4 = -3.5; per solution: -14 / 2 = -7.
    assert out == {"gold_logprob": -3.5, "gold_logprob_seq": -7.0, "gold_solutions": 2, "gold_tokens": 4}
    assert calls == [1, 1]  # max_rows=1: one call a solution
    assert evaluation.gold_logprob(logprobs, examples[1:2], 4, 8, 1) == {}


def test_validation_scores_gold_solutions_against_transformers(tmp_path, monkeypatch):
    """The eval record's ``gold_logprob`` against log_softmax of transformers' logits of the same model, done
    here in float64 over the gold tokens; at temperature 1 though the rollouts sample at 0.7."""
    import torch
    from transformers import Qwen2ForCausalLM

    from lspo_jax.job.config import load_config
    from lspo_jax.job.run import Run

    sums, bare = tmp_path / "sums.jsonl", tmp_path / "bare.jsonl"
    rows = [("93+67=", "160", "3+7=10;9+6+1=16;\\boxed{160}"), ("12+32=", "44", "2+2=4;1+3=4;\\boxed{44}"),
            ("5+4=", "9", None), ("4821+7395=", "12216", "1+5=6;2+9=11;8+3+1=12;4+7+1=12;\\boxed{12216}")]  # fmt: skip
    sums.write_text("".join(json.dumps({"id": str(i), "problem": p, "answer": a, **({"solution": s} if s else {})})
                            + "\n" for i, (p, a, s) in enumerate(rows)))  # fmt: skip
    bare.write_text("".join(json.dumps({"id": str(i), "problem": p, "answer": a}) + "\n" for i, (p, a, _) in
                            enumerate(rows)))  # fmt: skip
    # The warm start: log-probs near 0 on the 2-digit sums' solutions, nats a token on the 4-digit one's.
    path = toy_model.model_dir(str(tmp_path / "cache"))
    config = load_config(None, [f"model.path={path}", f"data.train={sums}", "data.instruction_position=none",
                                "data.max_prompt_tokens=32", "data.max_solution_tokens=64", "rollout.temperature=0.7",
                                *SHORT,
                                "eval.n=2", "eval.ks=[1]", f"eval.benchmarks=[{sums}, {bare}]"])  # fmt: skip
    sampled = lambda run, g, params, prompts, key, **options: ["x"] * 2 * len(prompts)  # noqa: E731
    monkeypatch.setattr(evaluation, "sample_responses", sampled)
    job = Run(config, str(tmp_path / "run"), verifier=_NoVerifier())
    try:
        results = job.validate()
        examples = [ex for ex in job.held_out["sums"] if ex.solution_ids is not None]
    finally:
        job.close()
    assert "gold_logprob" not in results["bare"]  # no solutions: nothing to score, no key
    assert results["sums"]["answer_entropy"] == 0.0  # every sample "x": no answer, the same for all
    assert [r["benchmark"] for r in job.history] == ["sums", "bare"] and job.history[0]["gold_solutions"] == 3

    hf_model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def by_hand(temperature):
        sums_, tokens = [], 0
        for ex in examples:
            ids = list(ex.prompt_ids) + ex.solution_ids.tolist()
            with torch.no_grad():
                logits = hf_model(torch.tensor([ids])).logits[0].double().numpy() / temperature
            logp = logits - logits.max(-1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
            gold = range(len(ex.prompt_ids), len(ids))  # token t is predicted at position t - 1
            sums_.append(sum(logp[t - 1, ids[t]] for t in gold))
            tokens += len(gold)
        return sum(sums_) / tokens, float(np.mean(sums_))

    per_token, per_solution = by_hand(1.0)
    # JAX and torch in float32 agree on the tiny models' log-probs to ~1e-6 of their scale (conftest; 1.6e-7 was
    # measured here, float32's epsilon being 1.2e-7); the gold tokens' log-probs all have one sign, so their sums
    # keep that relative error, and 2e-5 is the project's float32 bound. A position off by one, prompt tokens
    # counted or the rollout temperature (0.7: -1.64 against -1.16 nats a token here) move it by 1e-1 or more.
    assert results["sums"]["gold_logprob"] == pytest.approx(per_token, rel=2e-5)
    assert results["sums"]["gold_logprob_seq"] == pytest.approx(per_solution, rel=2e-5)
    assert abs(by_hand(0.7)[0] - per_token) > 1e-3 * abs(per_token)


# ---------------------------------------------------------------------------------------------- lspo-eval
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return toy_model.ensure_model(str(tmp_path_factory.mktemp("policy") / "toy"), steps=0)


# The test models hold 256 positions: a run's generation lengths within them (the defaults are a real model's).
SHORT = ("rollout.max_new_tokens=64", "eval.max_new_tokens=64", "reward.overlong_buffer=16")


@pytest.fixture(autouse=True)
def no_disk_cache(monkeypatch):
    monkeypatch.setenv("LSPO_JAX_COMPILATION_CACHE", "")  # eval_main would turn on the on-disk XLA cache


def test_lspo_eval_on_math500_with_the_jax_sampler(model_dir, tmp_path, monkeypatch, capsys):
    sampled = []
    real = evaluation.sample_responses

    def spy(run, policy, params, prompts, key, **options):
        texts = real(run, policy, params, prompts, key, **options)
        sampled.extend(texts)
        return texts

    monkeypatch.setattr(evaluation, "sample_responses", spy)
    out = tmp_path / "results.json"
    argv = ["--model", model_dir, "--benchmarks", "math500", "--limit", "4", "--n", "2", "--max-new-tokens", "8",
            "--workers", "0", "--out", str(out), "data.instruction_position=none",
            "data.max_prompt_tokens=248"]  # fmt: skip
    assert cli.eval_main(argv) == 0
    results = json.loads(out.read_text())
    # --n 2: pass@1 and pass@2 (n itself); the usual 4, 8, 16 do not fit.
    assert (results["n"], results["ks"], results["max_new_tokens"], results["checkpoint_step"]) == (2, [1, 2], 8, None)
    math500 = results["benchmarks"]["math500"]
    with open(benchmarks.benchmark_path("math500")) as f:
        rows = [json.loads(next(f)) for _ in range(4)]
    assert [p["id"] for p in math500["per_problem"]] == [r["id"] for r in rows]
    # 2 samples of at most 8 tokens per problem, graded against the right gold in the right order.
    assert len(sampled) == 8 and all(isinstance(t, str) for t in sampled)
    expected = [[math_reward(sampled[2 * i + j], r["answer"]) == 1.0 for j in range(2)] for i, r in enumerate(rows)]
    assert [p["correct"] for p in math500["per_problem"]] == expected
    # --limit 4 reads the first 4 rows of the file, and the load report covers those (all short enough here).
    assert math500["problems"] == 4 and math500["data"]["rows"] == math500["data"]["kept"] == 4
    assert math500["pass@1"] == np.mean(np.array(expected)[:, 0])
    assert math500["pass@2"] == np.mean(np.array(expected).any(axis=1))  # either of the two samples
    assert math500["pass@1_unbiased"] == math500["accuracy"] == np.mean(expected)
    assert "| math500 | 4 | first_k |" in capsys.readouterr().out


class _EvenLengthPasses:
    """A verifier by a rule the test can check against the texts: a response passes when its length is even."""

    def score(self, responses, golds):
        return np.array([len(r) % 2 == 0 for r in responses], np.float32)

    def close(self):
        pass


SAMPLE_FIELDS = {"benchmark", "seed", "id", "gold", "sample", "text", "tokens", "extracted_answer", "reward", "length",
                 "terminated"}  # fmt: skip


def test_lspo_eval_by_a_protocol_over_two_seeds(model_dir, tmp_path, monkeypatch):
    from lspo_jax.job import build
    from lspo_jax.rollout import generator

    decodings, generate = [], generator.Generator.generate

    def spy(self, params, prompts, decoding, **kwargs):
        decodings.append(decoding)
        return generate(self, params, prompts, decoding, **kwargs)

    monkeypatch.setattr(generator.Generator, "generate", spy)
    monkeypatch.setattr(build, "make_verifier", lambda run: _EvenLengthPasses())
    out = tmp_path / "r.json"
    argv = ["--model", model_dir, "--protocol", "deepscaler", "--benchmarks", "toy:heldout", "--limit", "2", "--n", "2",
            "--max-new-tokens", "8", "--seeds", "1,2", "--workers", "0", "--out", str(out),
            "data.instruction_position=none", "data.max_prompt_tokens=248"]  # fmt: skip
    assert cli.eval_main(argv) == 0
    results = json.loads(out.read_text())
    assert results["protocol"]["settings"] == {"n": 16, "temperature": 0.6, "top_p": 0.95, "max_new_tokens": 32768}
    # --n and --max-new-tokens win and are recorded as deviations; the protocol's temperature and top-p are sampled.
    assert results["protocol"]["deviations"] == {"n": {"protocol": 16, "used": 2},
                                                 "max_new_tokens": {"protocol": 32768, "used": 8}}  # fmt: skip
    assert (results["n"], results["ks"], results["temperature"], results["top_p"]) == (2, [1, 2], 0.6, 0.95)
    assert {(d.temperature, d.top_p, d.max_new_tokens) for d in decodings} == {(0.6, 0.95, 8)}
    assert (results["seeds"], results["engine"], results["versions"]["jax"]) == ([1, 2], "jax", jax.__version__)
    assert results["devices"] == eval_command.evenly_splitting(jax.local_device_count())
    bench = results["benchmarks"]["toy_heldout"]
    lines = [json.loads(line) for line in (tmp_path / "r.samples.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 2 * 2 and all(set(line) == SAMPLE_FIELDS for line in lines)  # problems x n x seeds
    assert all(s["reward"] == (len(s["text"]) % 2 == 0) and s["length"] == len(s["tokens"]) <= 8 for s in lines)
    assert all(s["terminated"] or s["length"] == 8 for s in lines)  # a sample that did not end used the budget
    for repeat in bench["repeats"]:  # the metrics recomputed from the lines
        mine = [s for s in lines if s["seed"] == repeat["seed"]]
        assert repeat["truncation_rate"] == np.mean([not s["terminated"] for s in mine])
        assert repeat["completed_accuracy"] == np.mean([s["reward"] and s["terminated"] for s in mine])
        assert repeat["accuracy"] == np.mean([s["reward"] for s in mine])
    assert [s["tokens"] for s in lines if s["seed"] == 1] != [s["tokens"] for s in lines if s["seed"] == 2]
    # Over the seeds: two values a, b have mean (a + b) / 2 and stderr |a - b| / 2.
    a, b = (r["completed_accuracy"] for r in bench["repeats"])
    assert bench["over_seeds"]["completed_accuracy"] == pytest.approx({"mean": (a + b) / 2, "stderr": abs(a - b) / 2})
    assert bench["completed_accuracy"] == pytest.approx((a + b) / 2)
    # The accuracy's stderr over the 2 problems, of each one's pass fraction over its 4 samples (2 a seed).
    fractions = [np.mean(p["correct"]) for p in bench["per_problem"]]
    assert bench["accuracy_stderr"] == pytest.approx(np.std(fractions, ddof=1) / math.sqrt(2))


def test_lspo_eval_keeps_the_benchmarks_scored_before_a_stop(model_dir, tmp_path, monkeypatch, capsys):
    """The results file is written before sampling and after each benchmark, ``finished`` false until the end: a
    Ctrl-C during the second benchmark exits 130 with the first one's record kept, and an older file at --out is
    never left looking current."""
    from lspo_jax.job import build

    real, calls = eval_command._eval_benchmark, []

    def second_interrupted(*args):
        calls.append(args[3])
        if len(calls) == 2:  # Ctrl-C as the second benchmark starts: its sampling stops at its first check
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args)

    monkeypatch.setattr(eval_command, "_eval_benchmark", second_interrupted)
    monkeypatch.setattr(build, "make_verifier", lambda run: _EvenLengthPasses())
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"finished": True, "benchmarks": {"old": {}}}))  # an earlier evaluation's file
    argv = ["--model", model_dir, "--benchmarks", "toy:heldout,toy:heldout_3digit", "--limit", "2", "--n", "1",
            "--max-new-tokens", "4", "--workers", "0", "--out", str(out), "data.instruction_position=none",
            "data.max_prompt_tokens=248"]  # fmt: skip
    assert cli.eval_main(argv) == errors.EXIT_INTERRUPTED
    results = json.loads(out.read_text())
    assert results["finished"] is False and list(results["benchmarks"]) == ["toy_heldout"] and len(calls) == 2
    assert "lspo-eval: interrupted; the 1 benchmark scored in " in capsys.readouterr().err
    monkeypatch.setattr(eval_command, "_eval_benchmark", real)
    assert cli.eval_main(argv) == 0
    results = json.loads(out.read_text())
    assert results["finished"] is True and list(results["benchmarks"]) == ["toy_heldout", "toy_heldout_3digit"]


def test_lspo_eval_refuses_a_bad_protocol_seeds_or_samples_file_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(eval_command, "_eval_model", lambda args: pytest.fail("the model was loaded"))
    base = ["--model", "toy", "--benchmarks", "toy:heldout"]
    refusals = {
        ("--protocol", "r1"): "--protocol: must be one of deepscaler, deepmath, dapo, lspo (or null), got 'r1'",
        ("--seeds", "3,3"): "--seeds 3,3: a seed given twice",
        ("--samples", str(tmp_path)): f"--samples {tmp_path} is a directory",
        ("--out", str(tmp_path / "r.json"), "--samples", str(tmp_path / "r.json")): "is --out too",
        ("--benchmarks", " , "): "--benchmarks ' , ': names no benchmark",
    }
    for argv, message in refusals.items():
        assert cli.eval_main([*base, *argv]) == 2
        assert message in capsys.readouterr().err
    assert eval_command.samples_path(str(tmp_path / "r.json"), None) == str(tmp_path / "r.samples.jsonl")
    assert eval_command.samples_path(None, None) is None and eval_command.samples_path("r.json", "s.jsonl") == "s.jsonl"


def test_answer_entropy_by_hand():
    boxed = lambda answer: f"so \\boxed{{{answer}}}"
    assert evaluation.answer_entropy([boxed(7)] * 8) == 0.0  # all agree, right or wrong
    assert evaluation.answer_entropy([boxed(a) for a in range(8)]) == pytest.approx(math.log(8))  # all differ
    # 1, 1, 2 and no answer: p = 1/2, 1/4, 1/4, so H = 1/2 ln 2 + 2 * 1/4 ln 4 = 1.5 ln 2. The last box counts.
    responses = [boxed(1), f"{boxed(2)} no, {boxed(1)}", boxed(2), "I give up"]
    assert evaluation.answer_entropy(responses) == pytest.approx(1.5 * math.log(2))
    assert evaluation.answer_entropy([boxed("1/2"), boxed("0.5")]) == pytest.approx(math.log(2))  # verbatim


def test_lspo_eval_from_a_checkpoint(model_dir, tmp_path, monkeypatch):
    from lspo_jax.job.config import load_config
    from lspo_jax.job.run import Run

    rows = [("p0", "2"), ("p1", "3"), ("p2", "5"), ("p3", "2")]
    bench = tmp_path / "sums.jsonl"
    bench.write_text("".join(json.dumps({"id": i, "problem": f"{a}+0=", "answer": a}) + "\n" for i, a in rows))
    config = load_config(None, [f"model.path={model_dir}", f"data.train={bench}", "data.instruction_position=none",
                                "eval.n=2", "eval.ks=[1, 2]", "data.max_prompt_tokens=32", f"eval.benchmarks=[{bench}]",
                                *SHORT])  # fmt: skip
    job = Run(config, str(tmp_path / "run"), verifier=_NoVerifier())
    job.save()  # a checkpoint of step 0: the base as loaded from model_dir
    job.close()
    seen = []

    def scripted(run, policy, params, prompts, key, **options):  # sample 0 answers 2 and 1 answers 3, every problem
        seen.append(params)
        return [f"so \\boxed{{{answer}}}" for _ in prompts for answer in (2, 3)]

    monkeypatch.setattr(evaluation, "sample_responses", scripted)
    out = tmp_path / "results.json"
    argv = ["--model", str(tmp_path / "run"), "--workers", "0", "--out", str(out)]  # the run's own benchmarks
    assert cli.eval_main(argv) == 0
    results = json.loads(out.read_text())
    sums = results["benchmarks"]["sums"]
    assert list(results["benchmarks"]) == ["sums"]
    assert results["checkpoint_step"] == 0 and results["ks"] == [1, 2]
    # Golds 2, 3, 5, 2 against answers (2, 3): [T F], [F T], [F F], [T F].
    assert [p["correct"] for p in sums["per_problem"]] == [[T, F], [F, T], [F, F], [T, F]]
    # first-k: pass@1 = 2/4 (first samples), pass@2 = 3/4; unbiased: pass@1 = 3/8 (all samples), pass@2 = 3/4.
    assert (sums["pass@1"], sums["pass@2"], sums["pass@1_unbiased"], sums["pass@2_unbiased"]) == (
        0.5,
        0.75,
        0.375,
        0.75,
    )
    # Every problem's two samples answer 2 and 3: two answers at 1/2 each, ln 2 nats.
    assert sums["answer_entropy"] == pytest.approx(math.log(2))
    assert [p["answer_entropy"] for p in sums["per_problem"]] == pytest.approx([math.log(2)] * 4)
    # The params sampled from are the checkpoint's, which hold the model directory's weights.
    _, loaded = hf.load_pretrained(model_dir)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(seen[0]["base"]), jax.device_get(loaded["base"]))
    assert math.isclose(sums["accuracy"], 3 / 8)


def test_lspo_eval_reports_a_missing_benchmark(model_dir, tmp_path, capsys):
    argv = ["--model", model_dir, "--benchmarks", "nosuch", "--data-dir", str(tmp_path), "--workers", "0",
            "--max-new-tokens", "8", "data.max_prompt_tokens=32"]  # fmt: skip
    assert cli.eval_main(argv) == 2
    err = capsys.readouterr().err
    assert "benchmark 'nosuch' not found" in err and str(tmp_path / "nosuch.jsonl") in err


class _NoVerifier:
    def score(self, responses, golds):
        return np.zeros(len(responses), np.float32)

    def close(self):
        pass


# ------------------------------------------------------------------------------------------------- coverage
# Three problems, four coverage samples each (answers after "so"; the gold answers are 5, 7 and 9):
#   p0: 5, 5, 5, 6  (the first and second 5 differ only in whitespace) -> [T T T F], 2 distinct correct texts
#   p1: 1, 2, 3, 7                                                      -> [F F F T], 1
#   p2: 1, 2, 3, 4                                                      -> [F F F F], 0
# first-k slice: pass@1 = 1/3 (p0), pass@2 = 1/3 (p0), pass@4 = 2/3 (p0, p1).
# unbiased, 1 - C(4 - c, k) / C(4, k): p0 (c = 3) 3/4, 1, 1; p1 (c = 1) 1/4, 1 - 3/6 = 1/2, 1; p2 0, 0, 0
#   -> pass@1 = 1/3, pass@2 = 1/2, pass@4 = 2/3. accuracy 4/12; distinct correct (2 + 1 + 0) / 3 = 1, solved 3/2.
COVERAGE_TEXTS = {
    0: ["so \\boxed{5}", "so  \\boxed{5}\n", "\\boxed{5}", "so \\boxed{6}"],
    1: ["\\boxed{1}", "\\boxed{2}", "\\boxed{3}", "\\boxed{7}"],
    2: ["\\boxed{1}", "\\boxed{2}", "\\boxed{3}", "\\boxed{4}"],
}


class _BoxedVerifier:
    def score(self, responses, golds):
        from lspo_jax.tasks.rewards import last_boxed

        return [float(last_boxed(r) == g) for r, g in zip(responses, golds, strict=True)]


def _scripted_coverage(run, generator, params, prompts, key, **options):  # the first eval.n of each problem's texts
    return [text for prompt in prompts for text in COVERAGE_TEXTS[prompt[0]][: run.eval.n]]


def test_coverage_by_hand_on_its_schedule_and_benchmarks(monkeypatch):
    from types import SimpleNamespace

    from lspo_jax.job.config import load_config

    monkeypatch.setattr(evaluation, "sample_responses", _scripted_coverage)
    problems = [SimpleNamespace(id=f"p{i}", prompt_ids=[i], answer=a, solution_ids=None) for i, a in enumerate("579")]
    overrides = ["eval.n=2", "eval.ks=[1, 2]", "eval.every=1", "eval.coverage_every=2", "steps=5"]
    run = load_config(None, [*overrides, "eval.coverage_n=4", "eval.coverage_benchmarks=[b]"])

    def at(step, config=run):
        return evaluation.evaluate_benchmarks(config, None, None, {"a": problems, "b": problems}, _BoxedVerifier(),
                                              jax.random.key(0), step=step)  # fmt: skip

    got = at(2)["b"]
    want = {"pass@1": 1 / 3, "pass@2": 1 / 3, "pass@4": 2 / 3, "pass@1_unbiased": 1 / 3, "pass@2_unbiased": 1 / 2,
            "pass@4_unbiased": 2 / 3, "accuracy": 1 / 3, "problems": 3, "n": 4, "distinct_correct": 1.0,
            "distinct_correct_solved": 1.5}  # fmt: skip
    assert {k: v for k, v in got.items() if k.startswith(evaluation.COVERAGE)} == pytest.approx(
        {evaluation.COVERAGE + k: v for k, v in want.items()}
    )
    off = at(None)["b"]  # no step (lspo-eval), a step off the schedule, coverage off: the eval record alone
    assert at(1)["b"] == off and at(3, load_config(None, overrides))["b"] == off and at(2)["a"] == off
    assert not any(k.startswith(evaluation.COVERAGE) for k in off)
    assert [s for s in range(6) if evaluation.coverage_due(run, s)] == [0, 2, 4, 5]


def test_coverage_ks_and_schedule_checks():
    from lspo_jax.job.build import validation_specs
    from lspo_jax.job.config import load_config
    from lspo_jax.options import ConfigError

    assert evaluation.coverage_ks(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert evaluation.coverage_ks(6) == [1, 2, 4, 6]
    with pytest.raises(ConfigError, match="eval.coverage_every"):
        load_config(None, ["eval.every=2", "eval.coverage_every=3"])
    toy_run = ["data.train=toy:addition", "eval.coverage_n=8"]  # validates on the toy's held-out classes
    assert validation_specs(load_config(None, [*toy_run, "eval.coverage_benchmarks=[toy_heldout_3digit]"]))
    with pytest.raises(ConfigError, match=r"^eval.coverage_benchmarks: \['toy_3digit'\] not among"):
        validation_specs(load_config(None, [*toy_run, "eval.coverage_benchmarks=[toy_3digit]"]))


def test_lspo_eval_benchmarks_the_flag_else_the_config_s_else_the_packaged_three():
    assert eval_command._benchmarks("a, b,", ("c",)) == ["a", "b"]  # the flag wins over the config's list
    assert eval_command._benchmarks(None, ("c",)) is None  # None: the config's own list is kept
    assert eval_command._benchmarks(None, ()) == ["math500", "aime24", "aime25"]
    with pytest.raises(ConfigError, match="--benchmarks ',': names no benchmark"):
        eval_command._benchmarks(",", ("c",))


def test_lspo_eval_samples_on_a_power_of_two_of_the_devices():
    # A call's rows are its problems rounded up to a power of two times n: they split over 4 of 6 devices.
    assert [eval_command.evenly_splitting(n) for n in (1, 2, 3, 6, 7, 8, 12, 16)] == [1, 2, 2, 4, 4, 8, 8, 16]
