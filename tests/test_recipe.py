"""The paper's recipe end to end, as a user runs it: ``configs/lspo_deepmath_r1_distill_qwen_1p5b.yaml`` with its
own keys, a tiny random Qwen2 carrying the real R1 tokenizer (``qwen_vocab``), DeepMath-schema parquet rows and
the recipe's benchmarks: the three the package ships, and ``aime26`` from a data directory the test writes (where the
recipe would otherwise fetch MathArena's from the hub), through the installed console commands in their own processes.

The first run is stopped by SIGTERM while it validates before step 1: it must end that validation at its next batch
of samples, checkpoint step 0 and exit 75 without writing any of the validation's records. ``--resume`` then
validates step 0 again, trains a step and validates after it; ``lspo-eval`` scores the run's checkpoint and
``lspo-export`` writes a directory that transformers loads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from lspo_jax.job.metrics_log import read_metrics
from tools import recipe_toy  # the tool builds the same model and rows

pytestmark = pytest.mark.slow  # the paper's recipe end to end

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER_CONFIG = recipe_toy.PAPER_CONFIG

BIN = os.path.dirname(sys.executable)  # the console commands installed beside this interpreter
STEPS = 1
TIMEOUT_S = 300
# The stop is asked for while the first sampling chunk compiles; it is honoured before the next chunk. 60 s is
# that compile's worst case on the loaded 2-core machine; a validation that ignores the stop samples the rest of
# its four benchmarks and scores their gold solutions (minutes).
STOP_S = 60
# The recipe's shape, made tiny: the model, the batch and the lengths; every other key is the paper's.
OVERRIDES = [
    "model.compute_dtype=float32",  # bfloat16 matmuls are emulated (slow) on CPU
    "data.max_prompt_tokens=256",  # a row is max_prompt_tokens + max_new_tokens wide: 1040 at the recipe's 1024
    "data.max_solution_tokens=64",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=16",
    "reward.overlong_buffer=4",
    "reward.workers=1",
    "loss.micro_batches=1",
    "eval.limit=1",
    "eval.n=2",
    "eval.ks=[1,2]",
    "eval.max_new_tokens=16",
    f"eval.every={STEPS}",
    f"checkpoint.every={STEPS}",
    f"steps={STEPS}",
]


def command(name: str, *argv: str, log: str) -> subprocess.Popen:
    """The console command ``name`` in its own process, its output to ``log`` (a pipe nobody reads until the end
    could fill and block it)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    out = open(log, "w")  # closed by wait()
    proc = subprocess.Popen([os.path.join(BIN, name), *argv], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    proc.log = out
    return proc


def wait(proc: subprocess.Popen, timeout_s: float) -> str:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.log.close()
    with open(proc.log.name) as f:
        return f.read()


def wait_for_line(proc: subprocess.Popen, text: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with open(proc.log.name) as f:
            if text in f.read():
                return True
        time.sleep(0.2)
    return False


def records(run_dir: str, kind: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    return [r for r in read_metrics(path) if r["kind"] == kind] if os.path.exists(path) else []


def checkpoint_steps(run_dir: str) -> list[int]:
    return sorted(int(name) for name in os.listdir(os.path.join(run_dir, "checkpoints")) if name.isdigit())


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """Run 1 stopped mid-validation, then ``--resume`` to the end: the run directory and both runs' outcomes."""
    tmp = tmp_path_factory.mktemp("recipe")
    model = recipe_toy.tiny_r1_model(str(tmp / "r1_tiny"))
    train = recipe_toy.deepmath_parquet(str(tmp / "deepmath.parquet"))
    aime26 = {"id": "2026-I-1", "problem": "Find the remainder when 2026 is divided by 1000.", "answer": "26"}
    (tmp / "data").mkdir()
    (tmp / "data" / "aime26.jsonl").write_text(json.dumps(aime26) + "\n")
    run_dir = str(tmp / "run")
    argv = ["--config", PAPER_CONFIG, "--out", run_dir, f"model.path={model}", f"data.train={train}",
            f"eval.data_dir={tmp / 'data'}", *OVERRIDES]  # fmt: skip
    first = command("lspo-train", *argv, log=str(tmp / "first.log"))
    validating = wait_for_line(first, "lspo-train: validating at step 0", TIMEOUT_S)
    stopped_at = time.monotonic()
    if validating:
        first.send_signal(signal.SIGTERM)
    first_out = wait(first, STOP_S if validating else 0)
    assert validating, "the first run never began validating:\n" + first_out[-3000:]
    outcome = {"dir": run_dir, "first": (first.returncode, time.monotonic() - stopped_at, first_out)}
    outcome["first_evals"] = records(run_dir, "eval")
    outcome["first_checkpoints"] = checkpoint_steps(run_dir)
    second = command("lspo-train", "--out", run_dir, "--resume", log=str(tmp / "second.log"))
    second_out = wait(second, TIMEOUT_S)
    outcome["second"] = (second.returncode, second_out)
    return outcome


def test_a_stop_during_validation_ends_it_checkpoints_and_exits_75(recipe):
    code, seconds, out = recipe["first"]
    assert code == 75, out[-3000:]
    assert seconds < STOP_S and "Traceback" not in out, out[-3000:]
    assert recipe["first_checkpoints"] == [0]  # step 0 saved: the resume starts from it
    assert recipe["first_evals"] == []  # the cut validation wrote nothing, so the resume runs it whole


def test_the_resumed_recipe_validates_trains_and_validates_again(recipe):
    code, out = recipe["second"]
    assert code == 0 and "Traceback" not in out, out[-3000:]
    run_dir = recipe["dir"]
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, STEPS + 1))
    evals = {(r["step"], r["benchmark"]) for r in records(run_dir, "eval")}
    names = ("math500", "aime24", "aime25", "aime26")  # the recipe's four benchmarks, before and after training
    assert evals == {(step, name) for step in (0, STEPS) for name in names}
    assert checkpoint_steps(run_dir)[-1] == STEPS
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["data"]["kept"] == 64 and summary["data"]["rows"] == 64


def test_the_recipe_checkpoint_evaluates_and_exports_for_transformers(recipe, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = recipe["dir"]
    results = str(tmp_path / "eval.json")
    # The validation's shape (one problem, 2 samples of 16 tokens): its programs are read back from the compile cache.
    argv = ["--model", run_dir, "--benchmarks", "math500", "--limit", "1", "--n", "2", "--ks", "1,2",
            "--max-new-tokens", "16", "--workers", "0", "--out", results]  # fmt: skip
    proc = command("lspo-eval", *argv, log=str(tmp_path / "eval.log"))
    out = wait(proc, TIMEOUT_S)
    assert proc.returncode == 0, out[-3000:]
    scored = json.load(open(results))
    assert "math500" in json.dumps(scored) and "pass@2" in json.dumps(scored)
    exported = str(tmp_path / "hf")
    proc = command("lspo-export", run_dir, exported, log=str(tmp_path / "export.log"))
    out = wait(proc, TIMEOUT_S)
    assert proc.returncode == 0, out[-3000:]
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert model.config.vocab_size == 151_936 and not model.config.tie_word_embeddings
    assert not any("lora" in name for name, _ in model.named_parameters())  # the deliverable is base-only
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    assert text == "<｜begin▁of▁sentence｜><｜User｜>What is 2 + 2?<｜Assistant｜><think>\n"  # R1's template, kept
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids) == text
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 151_936) and torch.isfinite(logits).all()
