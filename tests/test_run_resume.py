"""A run's records, checkpoints and resume, end to end on a tiny random policy: a resumed run is exactly the
uninterrupted one (after a stop, a kill or a damaged checkpoint), validation and training records, base-only
checkpoints and their export, lspo-eval on a finished run, what a resume keeps, says and refuses, and a run that is
not overwritten.

The shared setup (one set of shapes, so each program compiles once per process; a fake verifier that places the
cliffs) is described in ``run_fixtures``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_fixtures import (
    PAPER_CONFIG,
    FakeVerifier,
    K,
    assert_trees_equal,
    cli_verifier,
    flag_adapter,
    hash_rule,
    one_line,
    run_steps,
    too_long_rows,
    train_records,
    write_jsonl,
)

from lspo_jax.job import cli, compiles, evaluation
from lspo_jax.job import run as run_module
from lspo_jax.job.cli import format_summary
from lspo_jax.job.config import load_config
from lspo_jax.job.export import export_checkpoint
from lspo_jax.job.metrics_log import read_metrics
from lspo_jax.job.run import Run
from lspo_jax.job.summary import surpass_distribution
from lspo_jax.models import model
from lspo_jax.rl.checkpoint import Checkpointer, checkpoint_state
from lspo_jax.tasks import toy
from lspo_jax.train_config import ConfigError

pytestmark = pytest.mark.slow  # whole training runs


# ----------------------------------------------------------------------- resume, checkpoints, export
def test_resume_is_exact(tmp_path, make_config, train_file, easy_rule, trained_run):
    out = str(tmp_path)
    run_steps(make_config(steps=2, eval__benchmarks=[train_file]), out, easy_rule)
    config = make_config(steps=4, eval__benchmarks=[train_file])
    verifier = FakeVerifier(easy_rule, hash_rule)
    resumed = Run(config, out, resume=True, verifier=verifier)
    flag_adapter(resumed, verifier)
    assert resumed.state.step == 2 and resumed.prompts.order.state() == {"epoch": 0, "position": 4}
    resumed.train()
    resumed.close()
    assert_trees_equal(checkpoint_state(resumed.state.params, resumed.state.opt_state), trained_run["state"])

    def train_records(path):
        records = read_metrics(os.path.join(path, "metrics.jsonl"))
        return [{k: v for k, v in r.items() if not k.startswith("time_") and k not in compiles.KEYS}
                for r in records if r["kind"] == "train"]  # fmt: skip

    records = train_records(out)
    assert records == train_records(trained_run["dir"])
    evals = [r["step"] for r in read_metrics(os.path.join(out, "metrics.jsonl")) if r["kind"] == "eval"]
    assert evals == [0, 2, 4]  # the resumed run did not validate step 2 again
    # Re-rolls scored by content: the resumed steps really sampled, scaffolded and spliced the same rows.
    assert [r["step"] for r in records] == [1, 2, 3, 4] and sum(r["spliced_rows"] for r in records[2:]) > 0


def test_checkpoints_hold_no_adapter(trained_run):
    directory = os.path.join(trained_run["dir"], "checkpoints")
    assert sorted(int(name) for name in os.listdir(directory) if name.isdigit()) == [2, 4]
    for step in ("2", "4"):
        # Not even a name: the RL state is stored as its leaves, so no adapter placeholder is listed either.
        with open(os.path.join(directory, step, "state", "_METADATA")) as f:
            tree = json.load(f)["tree_metadata"]
        assert any("'embed'" in key for key in tree)
        stored = [key for key, entry in tree.items() if entry["value_metadata"]["value_type"] != "None"]
        assert len(stored) == len(jax.tree.leaves(trained_run["state"]))  # nothing beside base and RL state
        assert not any("lora" in key for key in tree)
        for root, _, files in os.walk(os.path.join(directory, step)):
            for name in files:
                assert "lora" not in os.path.join(root, name)
                if name != "_METADATA":
                    with open(os.path.join(root, name), "rb") as f:
                        assert b"lora" not in f.read()
    checkpointer = Checkpointer(directory)
    target = jax.tree.map(jnp.asarray, trained_run["state"])
    restored, meta = checkpointer.restore(None, target)
    assert set(restored) == {"base", "rl_opt"} and meta["step"] == 4
    assert not any("lora" in jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(restored))
    assert_trees_equal(restored, target)
    with pytest.raises(ValueError, match="adapter"):
        checkpointer.save(5, {"base": restored["base"], "lora": {}}, {"step": 5})
    checkpointer.close()


def test_export_loads_in_transformers(trained_run, model_dir, tmp_path, monkeypatch, capsys):
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    out = export_checkpoint(trained_run["dir"], str(tmp_path / "latest"))
    weights = load_file(os.path.join(out, "model.safetensors"))
    assert weights and not any("lora" in name for name in weights)
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    text = toy.char_tokenizer().encode("12+34=46;7+5=12", add_special_tokens=False)
    tokens = np.array([[toy.BOS_ID, *text], [toy.BOS_ID, *text[::-1]]], np.int32)
    hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf_model(input_ids=torch.from_numpy(tokens).long()).logits.numpy()
    policy = trained_run["job"].policy
    ours = np.asarray(model.forward(policy.config, {"base": trained_run["state"]["base"]}, jnp.asarray(tokens)))
    np.testing.assert_allclose(theirs, ours, atol=1e-5)
    # The export is the trained base of step 4, not the initial model and not the step-2 checkpoint.
    initial = load_file(os.path.join(model_dir, "model.safetensors"))
    monkeypatch.chdir(tmp_path)  # the command line prints the absolute path of a relative OUT
    assert cli.export_main([trained_run["dir"], "step2", "--step", "2"]) == 0
    assert json.loads(capsys.readouterr().out) == {"exported": str(tmp_path / "step2")}
    step2 = load_file(str(tmp_path / "step2" / "model.safetensors"))
    for other in (initial, step2):
        assert other.keys() == weights.keys()
        assert any(not np.array_equal(weights[name], other[name]) for name in weights)


def copy_run(run_dir: str, dest) -> str:
    return str(shutil.copytree(run_dir, dest))


def damage_newest_checkpoint(run_dir: str) -> int:
    """Cut the largest file of the newest checkpoint to 100 bytes (a disk error, a copy cut short)."""
    checkpoints = os.path.join(run_dir, "checkpoints")
    newest = max(int(name) for name in os.listdir(checkpoints) if name.isdigit())
    files = [os.path.join(d, f) for d, _, names in os.walk(os.path.join(checkpoints, str(newest))) for f in names]
    os.truncate(max(files, key=os.path.getsize), 100)
    return newest


def eval_steps(path):
    return [r["step"] for r in read_metrics(os.path.join(path, "metrics.jsonl")) if r["kind"] == "eval"]


def test_a_damaged_checkpoint_is_named_and_resume_falls_back(trained_run, tmp_path, capsys, monkeypatch, easy_rule):
    run_dir = copy_run(trained_run["dir"], tmp_path / "run")
    assert damage_newest_checkpoint(run_dir) == 4
    assert cli.export_main([run_dir, str(tmp_path / "hf")]) == 2
    err = one_line(capsys, "lspo-export")
    assert "checkpoint step 4 in" in err and "is unreadable" in err and "readable steps: 2 (pass --step)" in err
    assert cli.eval_main(["--model", run_dir, "--limit", "1"]) == 2
    assert "readable steps: 2" in one_line(capsys, "lspo-eval")
    # --resume takes step 2, says so, sets step 4 aside and trains steps 3 and 4 again.
    with cli_verifier(monkeypatch, easy_rule):
        assert cli.train_main(["--out", run_dir, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "checkpoint step 4" in err and "resuming from step 2, the newest readable checkpoint" in err
    assert os.listdir(os.path.join(run_dir, "checkpoints.unreadable")) == ["4"]
    assert train_records(run_dir) == train_records(trained_run["dir"])  # as if it had never stopped
    assert eval_steps(run_dir) == [0, 4]


# ---------------------------------------------------------------------------- validation and records
def test_validation_before_and_after(trained_run):
    evals = [r for r in read_metrics(os.path.join(trained_run["dir"], "metrics.jsonl")) if r["kind"] == "eval"]
    # One record per benchmark and validation; the benchmark is named after its file (train.jsonl).
    assert [(r["step"], r["benchmark"]) for r in evals] == [(0, "train"), (4, "train")]
    summary = trained_run["job"].summary
    assert set(summary["held_out_before"]) == set(summary["held_out_after"]) == {"train"}
    assert summary["held_out_after"]["train"] == {
        k: v for k, v in evals[1].items() if k not in ("kind", "step", "benchmark")
    }
    before = summary["held_out_before"]["train"]
    assert {"pass@1", "pass@2", "pass@1_unbiased", "pass@2_unbiased", "accuracy", "problems", "gold_logprob",
            "gold_logprob_seq", "gold_solutions", "gold_tokens", "answer_entropy"} == set(before)  # fmt: skip
    assert before["gold_solutions"] == 2 and before["gold_logprob"] < 0
    # eval.limit = 2: prompt 0 is a cliff (never passes) and prompt 1 passes in one of its two samples.
    assert before["problems"] == 2 and before["pass@2"] == 0.5 and before["accuracy"] == 0.25
    assert summary["held_out_data"]["train"]["rows"] == summary["held_out_data"]["train"]["kept"] == 2  # eval.limit
    assert "held-out train (2 problems): accuracy before 25.0%" in format_summary(summary)
    assert f"gold nats/token before {before['gold_logprob']:.3f}, after " in format_summary(summary)


def test_the_per_step_surpass_rate_distribution_by_hand():
    # Steps 1 and 4 attempted no cliff and are left out; of the 4 that did, one at 0.0 and two at 1.0.
    pairs = [(0, None), (2, 0.0), (1, 1.0), (0, None), (4, 0.5), (3, 1.0)]
    train_records = [{"scaffold_attempted": n, "surpass_rate": rate} for n, rate in pairs]
    spread = surpass_distribution(train_records)
    assert spread == {"steps": 4, "at_0": 0.25, "at_1": 0.5}
    assert surpass_distribution(train_records[:1]) is None
    summary = {"steps": 6, "seconds": 1.0, "stopped_early": False, "cliff_groups": 10, "scaffold_attempted": 10,
               "scaffold_no_solution": 0, "surpassed_groups": 5, "surpass_rate": 0.5, "rescue_pass_rate": 0.1,
               "rerolls_passed": 8, "rerolls": 80, "surpass_rate_per_step": spread}  # fmt: skip
    assert "per-step surpass rate over 4 cliff-bearing steps: 25.0% of them at 0, 50.0% at 1" in format_summary(summary)


def test_train_records_hold_the_documented_keys(trained_run):
    keys = {"step", "accuracy_mean", "reward_mean", "cliff_groups", "surpassed_groups", "spliced_rows",
            "rescue_pass_rate", "spliced_ratio_mean", "spliced_log_ratio_q50", "spliced_token_share",
            "clip_frac_low", "clip_frac_high", "entropy",
            "response_len_mean", "overlong_frac", "time_sample", "time_reward", "time_sft", "time_reroll",
            "time_logprob", "time_update", "lr", "loss", "grad_norm", "rerolls", "rerolls_passed",
            "scaffold_attempted"}  # fmt: skip
    records = read_metrics(os.path.join(trained_run["dir"], "metrics.jsonl"))
    train_records = [r for r in records if r["kind"] == "train"]
    assert len(train_records) == 4
    for record in train_records:
        assert keys <= set(record), keys - set(record)
        assert all(record[f"time_{p}"] >= 0 for p in ("sample", "reward", "sft", "reroll", "logprob", "update"))
        assert record["lr"] == pytest.approx(1e-3, rel=1e-6)  # make_config's optim.lr, no warm-up
        # One cliff a step with a worked solution, re-rolled K times (see easy_rule).
        assert record["scaffold_attempted"] == 1 and record["rerolls"] == K


def test_eval_limit_takes_the_first_rows_of_the_file_and_says_what_it_dropped(trained_run, tmp_path, capsys,
                                                                              monkeypatch):  # fmt: skip
    seen = []

    def no_sampling(run, policy, params, examples, pool, key, stop=None):
        seen.append([ex.id for ex in examples])
        return np.zeros((len(examples), run.eval.n), bool), np.zeros(len(examples))

    monkeypatch.setattr(evaluation, "graded_samples", no_sampling)
    rows = too_long_rows(1)  # dropped at load
    rows += [{"id": f"p{i}", "problem": f"{i}+{i}=", "answer": str(2 * i), "solution": "\\boxed{0}"} for i in (1, 2, 3)]
    bench = write_jsonl(tmp_path / "bench.jsonl", rows)
    argv = ["--model", trained_run["dir"], "--benchmarks", bench, "--limit", "2", "--workers", "0"]
    assert cli.eval_main(argv) == 0
    assert seen == [["p1"]]  # the first two rows of the file, of which one is too long; not p1 and p2
    assert "lspo-eval: bench: 1 of 2 rows kept; {'prompt_skipped': 1}" in capsys.readouterr().err


# --------------------------------------------------------------------------- refusals of overwriting
def test_a_finished_run_is_not_overwritten_without_resume(trained_run, make_config, easy_rule):
    with pytest.raises(FileExistsError, match="already holds a run .* pass --resume"):
        Run(make_config(steps=4), trained_run["dir"], verifier=FakeVerifier(easy_rule))


def test_refusals_leave_the_runs_config_as_it_was(trained_run, make_config, easy_rule):
    path = os.path.join(trained_run["dir"], "config.yaml")
    with open(path) as f:
        before = f.read()
    with pytest.raises(FileExistsError):
        Run(make_config(steps=4, seed=7), trained_run["dir"], verifier=FakeVerifier(easy_rule))
    # Another model would not fit the checkpoint: refused with the key named, before anything is loaded.
    with pytest.raises(ConfigError, match=r"model\.path '/no/such/model' is not the run's"):
        Run(make_config(model__path="/no/such/model"), trained_run["dir"], resume=True, verifier=None)
    with open(path) as f:
        assert f.read() == before


def test_a_run_directory_has_one_writer(trained_run, tmp_path, capsys):
    """Two runs into one --out at once once both exited 0 with the second's config, records and checkpoints: the
    first was lost. Another process holding the directory (here a bare lock holder) refuses a new run and a resume."""
    import subprocess
    import sys

    run_dir = copy_run(trained_run["dir"], tmp_path / "run")
    hold = "import sys, time; from lspo_jax.job.run_lock import RunLock; RunLock(sys.argv[1]); print('held', flush=True); time.sleep(120)"  # noqa: E501
    holder = subprocess.Popen([sys.executable, "-c", hold, run_dir], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        for argv in (["--out", run_dir, "--resume"], ["--config", PAPER_CONFIG, "--out", run_dir]):
            assert cli.train_main(argv) == 2
            err = one_line(capsys, "lspo-train")
            assert f"--out {run_dir} is being written by another run (pid {holder.pid} on " in err, err
    finally:
        holder.kill()
        holder.wait()
    with (
        open(os.path.join(run_dir, "metrics.jsonl")) as f,
        open(os.path.join(trained_run["dir"], "metrics.jsonl")) as g,
    ):
        assert f.read() == g.read()  # untouched by the refused commands


# -------------------------------------------------------------------------------- resume bookkeeping
def test_resume_without_config_takes_the_runs_own(trained_run, monkeypatch):
    seen = []
    record = lambda config, out, resume, **_: seen.append((config, resume)) or {}  # noqa: E731
    monkeypatch.setattr(run_module, "train_run", record)
    monkeypatch.setattr(cli, "format_summary", lambda summary: "")
    monkeypatch.setattr(cli, "_plot", lambda out: None)
    assert cli.train_main(["--out", trained_run["dir"], "--resume", "steps=6"]) == 0
    ((config, resume),) = seen
    saved = load_config(os.path.join(trained_run["dir"], "config.yaml"))
    assert resume and config == dataclasses.replace(saved, steps=6) and saved.steps == 4


def test_print_config_shows_what_would_run(trained_run, capsys):
    import yaml

    assert cli.train_main(["--out", trained_run["dir"], "--resume", "--print-config", "steps=9"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    saved = load_config(os.path.join(trained_run["dir"], "config.yaml"))
    assert printed["steps"] == 9 and printed["model"]["path"] == saved.model.path
    assert cli.train_main(["--config", PAPER_CONFIG, "--out", "unused", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["rollout"]["group_size"] == 16 and printed["log"]["wandb"] is False  # with the defaults
    assert not os.path.exists("unused")
    # A new run's config prints without --out; training or resuming without one is refused in one line.
    assert cli.train_main(["--config", PAPER_CONFIG, "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == printed
    # Options and overrides in any order: every override is taken, before and after --out.
    argv = ["--config", PAPER_CONFIG, "steps=4", "--out", "unused", "rollout.group_size=4", "--print-config"]
    assert cli.train_main(argv) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (printed["steps"], printed["rollout"]["group_size"]) == (4, 4)
    for argv in (["--config", PAPER_CONFIG], ["--resume", "--print-config"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.train_main(argv)
        assert exit_info.value.code == 2 and "--out is required" in capsys.readouterr().err


def test_a_run_killed_after_a_checkpoint_resumes_as_if_it_never_stopped(trained_run, tmp_path, easy_rule):
    # What a SIGKILL during step 4 leaves: the checkpoint of step 2, records of steps 1-3, no summary.
    run_dir = copy_run(trained_run["dir"], tmp_path / "run")
    shutil.rmtree(os.path.join(run_dir, "checkpoints", "4"))
    os.remove(os.path.join(run_dir, "summary.json"))
    path = os.path.join(run_dir, "metrics.jsonl")
    kept = [r for r in read_metrics(path) if r["step"] <= 3 and r["kind"] == "train" or r["step"] == 0]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    config = load_config(os.path.join(run_dir, "config.yaml"))
    job = run_steps(config, run_dir, easy_rule, resume=True)
    assert train_records(run_dir) == train_records(trained_run["dir"])  # step 3 once, not twice
    assert eval_steps(run_dir) == [0, 4]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    uninterrupted = trained_run["job"].summary
    for key in ("cliff_groups", "scaffold_attempted", "surpassed_groups", "rerolls", "rerolls_passed", "rollouts",
                "surpass_rate", "rescue_pass_rate", "held_out_before", "held_out_after"):  # fmt: skip
        assert summary[key] == uninterrupted[key], key  # the whole run, not the resumed half
    assert summary["held_out_before"] is not None and job.summary["cliff_groups"] == 4


def test_resuming_a_finished_run_adds_nothing_and_fewer_steps_are_refused(trained_run, tmp_path, capsys,
                                                                           monkeypatch, easy_rule):  # fmt: skip
    run_dir = copy_run(trained_run["dir"], tmp_path / "run")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        before = f.read()
    with cli_verifier(monkeypatch, easy_rule) as verifier:
        for _ in range(2):
            assert cli.train_main(["--out", run_dir, "--resume"]) == 0
            assert "is at step 4 of steps=4: nothing to train" in capsys.readouterr().err
        verifier.closed = False
        assert cli.train_main(["--out", run_dir, "--resume", "steps=2"]) == 2
        assert verifier.closed  # started before the learner, whose restore refused: closed, not left running
        refusal = "steps: 2 is below the run's step 4 (its checkpoint); pass steps=4 or more"
        assert refusal in one_line(capsys, "lspo-train")

        def close_fails():
            raise RuntimeError("its pool is gone")

        verifier.close = close_fails  # a close that fails too does not hide the refusal behind its own error
        assert cli.train_main(["--out", run_dir, "--resume", "steps=2"]) == 2
    err = one_line(capsys, "lspo-train")
    assert refusal in err and "closing the verifier after a failed start also failed: its pool is gone" in err
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        assert f.read() == before  # no second final validation
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["held_out_after"] == trained_run["job"].summary["held_out_after"]


def test_a_resume_that_changes_the_run_says_so(trained_run, tmp_path, capsys, monkeypatch, easy_rule):
    import yaml

    run_dir = copy_run(trained_run["dir"], tmp_path / "run")
    config, records = os.path.join(run_dir, "config.yaml"), os.path.join(run_dir, "metrics.jsonl")
    with open(config) as f:
        original = f.read()
    # An override that the checkpoints cannot hold is named as the override, not as unreadable checkpoints.
    assert cli.train_main(["--out", run_dir, "--resume", "scaffold.adapter=persistent"]) == 2
    err = one_line(capsys, "lspo-train")
    assert "--resume: scaffold.adapter 'persistent' cannot continue the run's checkpoints, written with 'fresh'" in err
    os.rename(config, config + ".away")
    assert cli.train_main(["--out", run_dir, "--resume"]) == 2
    assert f"--resume: {config} is missing (the run's own settings)" in one_line(capsys, "lspo-train")
    os.rename(config + ".away", config)
    with cli_verifier(monkeypatch, easy_rule):
        # A changed setting keeps the config the steps so far ran with, beside the new one.
        assert cli.train_main(["--out", run_dir, "--resume", "seed=7"]) == 0
        err = capsys.readouterr().err
        assert f"--resume changes seed 42 -> 7; steps 1-4 ran with {run_dir}/config.step4.yaml" in err, err
        with open(os.path.join(run_dir, "config.step4.yaml")) as f:
            assert f.read() == original
        with open(config) as f:
            assert yaml.safe_load(f)["seed"] == 7
        # The training file changed in place, and the records lost: both said, the run still resumes.
        changed = tmp_path / "train.jsonl"
        shutil.copy(load_config(config).data.train, changed)
        with open(changed, "a") as f:
            f.write(json.dumps({"id": "new", "problem": "1+1=", "answer": "2"}) + "\n")
        with open(config) as f:
            text = f.read().replace(load_config(config).data.train, str(changed))
        with open(config, "w") as f:
            f.write(text)
        os.remove(records)
        assert cli.train_main(["--out", run_dir, "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"data.train {changed} is not the data the run's checkpoint was trained on (its files changed)" in err
    assert f"{records} is missing: the records of steps 1-4 are lost, and the summary counts the steps from 5" in err


def test_validation_writes_the_coverage_pass_into_its_eval_record(make_config, train_file, tmp_path):
    out = str(tmp_path / "run")
    job = Run(make_config(eval__benchmarks=[train_file], eval__coverage_n=4), out, verifier=FakeVerifier(hash_rule))
    try:
        job.validate()  # step 0: always a coverage step
    finally:
        job.close()
    (record,) = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if r["kind"] == "eval"]
    assert record["coverage/n"] == 4 and record["coverage/problems"] == record["problems"] == 2
    assert {f"coverage/pass@{k}{e}" for k in (1, 2, 4) for e in ("", "_unbiased")} <= set(record)
    assert record["coverage/pass@1_unbiased"] == record["coverage/accuracy"]
