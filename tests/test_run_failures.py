"""What goes wrong in a run, end to end on a tiny random policy: bad data rows, non-finite updates, a SIGTERM
before, during or after a step, a stop agreed by every process, and the one-line errors of lspo-train, lspo-eval and
lspo-export (a missing config, unusable files, bad paths, Ctrl-C during start-up, a read-only disk, out of memory).

The shared setup (one set of shapes, so each program compiles once per process; a fake verifier that places the
cliffs) is described in ``run_fixtures``.
"""

from __future__ import annotations

import json
import os
import signal

import jax
import numpy as np
import pytest
from jax.experimental import multihost_utils
from run_fixtures import (
    LONG_PROBLEM,
    PAPER_CONFIG,
    FakeVerifier,
    K,
    assert_trees_equal,
    cli_verifier,
    copy_tree,
    one_line,
    run_steps,
    too_long_rows,
    trees_differ,
    wrap,
    write_jsonl,
)

from lspo_jax.job import cli, errors, evaluation
from lspo_jax.job import run as run_module
from lspo_jax.job.build import AgreedVerifier
from lspo_jax.job.metrics_log import read_metrics
from lspo_jax.job.run import Run, RunStopped
from lspo_jax.rl import staleness, train
from lspo_jax.rl.checkpoint import Checkpointer, checkpoint_state

# A new run of the paper's recipe (PAPER_CONFIG), its paths overridden: the paper's lengths (1024 + 8192 tokens) are
# beyond the test models' 256 positions, and refused as such first.
WITHIN_256 = ("rollout.max_new_tokens=64", "eval.max_new_tokens=64", "reward.overlong_buffer=16")


# ----------------------------------------------------------------------------- bad input, non-finite
@pytest.mark.parametrize("policy", ["skip", "truncate"])
def test_bad_rows_are_counted_not_fatal(tmp_path, make_config, train_rows, policy):
    rows = [
        {"id": "long", "problem": LONG_PROBLEM, "answer": "45", "solution": "\\boxed{45}"},
        {"id": "no-solution", "problem": train_rows[0]["problem"], "answer": train_rows[0]["answer"]},
        *train_rows[1:4],
    ]
    config = make_config(data__train=write_jsonl(tmp_path / "rows.jsonl", rows), data__prompt_policy=policy, steps=1)
    # Every group a cliff; re-roll 1 of each passes, whatever was sampled.
    job = run_steps(config, str(tmp_path / "run"), lambda *_: False, reroll_rule=lambda response, gold, slot: slot == 1)
    report = job.summary["data"]
    assert (report["rows"], report["solution_missing"]) == (5, 1)
    if policy == "skip":
        assert (report["kept"], report["prompt_skipped"], report["prompt_truncated"]) == (4, 1, 0)
        assert [ex.id for ex in job.examples[:2]] == ["no-solution", "add-0-1"]
    else:
        assert (report["kept"], report["prompt_skipped"], report["prompt_truncated"]) == (5, 0, 1)
        long = job.examples[0]
        assert len(long.prompt_ids) == 16 and job.policy.tokenizer.decode(long.prompt_ids).endswith("8+9=")
    (step,) = [r for r in read_metrics(os.path.join(job.out_dir, "metrics.jsonl")) if r["kind"] == "train"]
    # Both prompts of step 1 are cliffs; the one without a worked solution is left out of the scaffold.
    assert (step["cliff_groups"], step["scaffold_no_solution"], step["rescue_pass_rate"] is not None) == (2, 1, True)
    assert job.summary["rerolls"] == K
    # The surpass rate is over the cliffs the scaffold attempted (1 of the 2, surpassed: 1 / 1, where over all
    # cliff groups it would read 1 / 2), in the step and the summary alike.
    summary = job.summary
    assert (summary["cliff_groups"], summary["scaffold_attempted"], summary["scaffold_no_solution"]) == (2, 1, 1)
    assert summary["surpass_rate"] == step["surpass_rate"] == summary["surpassed_groups"] / 1 == 1.0


def test_nonfinite_updates_are_skipped_then_stop_the_run(tmp_path, make_config, easy_rule):
    updates = []

    def spy(job):
        state = lambda: copy_tree((job.learner.state.params, job.learner.state.opt_state))

        def poison(batch):  # NaN advantages on steps 1, 3, 4; finite on step 2
            if len(updates) != 1:
                batch["advantages"] = np.full_like(batch["advantages"], np.nan)
            return {"before": state()}

        wrap(job.learner, "rl_step", before=poison, after=lambda _: {"after": state()}, log=updates)

    config = make_config(steps=6, max_nonfinite_in_row=2, checkpoint__every=10)
    out = str(tmp_path)
    with pytest.raises(RunStopped, match="2 non-finite updates in a row at step 4"):
        run_steps(config, out, easy_rule, prepare=spy)
    records = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if r["kind"] == "train"]
    assert [(r["update_skipped"], r["nonfinite_total"], r["loss"] is None) for r in records] == [
        (True, 1, True), (False, 1, False), (True, 2, True), (True, 3, True),
    ]  # fmt: skip
    for step, update in enumerate(updates, 1):
        before, after = update["before"], update["after"]
        if step == 2:
            assert trees_differ(before[0]["base"], after[0]["base"])
        else:  # params and both optimizer states exactly as they came in
            assert_trees_equal(before, after)
    # The stop wrote a checkpoint of step 4 holding the base of step 2's update; resuming keeps the counts.
    resumed = Run(config, out, resume=True, verifier=FakeVerifier(easy_rule))
    try:
        assert (resumed.state.step, resumed.state.nonfinite_in_row, resumed.state.nonfinite_total) == (4, 2, 3)
        assert_trees_equal(resumed.state.params["base"], updates[1]["after"][0]["base"])
    finally:
        resumed.close()


# --------------------------------------------------------------- SIGTERM, stops of several processes
def write_config(path, config) -> str:
    import yaml

    from lspo_jax.job.config_io import to_dict

    with open(path, "w") as f:
        yaml.safe_dump(to_dict(config), f)
    return str(path)


def test_sigterm_checkpoints_and_exits_with_the_resumable_status(tmp_path, make_config, easy_rule, monkeypatch,
                                                                  capsys):  # fmt: skip
    real_step = train.train_step

    def step_then_sigterm(*args, **kwargs):  # a scheduler's SIGTERM arriving during step 1
        metrics = real_step(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return metrics

    monkeypatch.setattr(staleness, "train_step", step_then_sigterm)  # the step as the run takes it
    config = write_config(tmp_path / "c.yaml", make_config(steps=5, checkpoint__every=10))
    with cli_verifier(monkeypatch, easy_rule):
        assert cli.train_main(["--config", config, "--out", str(tmp_path / "r")]) == errors.EXIT_STOPPED == 75
    assert "stopped at step 1 with a checkpoint; --resume continues it" in capsys.readouterr().err
    with open(tmp_path / "r" / "summary.json") as f:
        summary = json.load(f)
    assert summary["stopped_early"] and summary["steps"] == 1
    checkpointer = Checkpointer(str(tmp_path / "r" / "checkpoints"))
    assert checkpointer.latest_step() == 1  # written although checkpoint.every is 10
    checkpointer.close()


def test_sigterm_mid_step_abandons_it_and_resumes_where_it_left(tmp_path, make_config, easy_rule):
    steps, scored, finished = [], [], []

    def sigterm_at_step_2s_rerolls(_):
        scored.append(len(steps))
        if scored.count(2) == 2:  # step 2's re-rolls: its adapter SFT has run, donating the params
            os.kill(os.getpid(), signal.SIGTERM)

    def prepare(job):
        learner = job.learner
        wrap(job.prompts, "next_batch", before=lambda *args: steps.append(learner.state.step))
        wrap(learner, "score", after=sigterm_at_step_2s_rerolls)
        after = lambda _: finished.append(copy_tree(checkpoint_state(learner.state.params, learner.state.opt_state)))
        wrap(learner, "rl_step", after=after)

    config = make_config(steps=5, checkpoint__every=10)
    job = run_steps(config, str(tmp_path), easy_rule, prepare=prepare)
    assert job.summary["stopped_early"] and job.summary["steps"] == 1 and len(finished) == 1
    assert job.checkpointer.latest_step() == 1
    assert [r["step"] for r in read_metrics(os.path.join(tmp_path, "metrics.jsonl")) if r["kind"] == "train"] == [1]
    resumed = Run(config, str(tmp_path), resume=True, verifier=FakeVerifier(easy_rule))
    try:  # step 1's base and RL state, and the order after its 2 prompts: step 2 draws the same prompts again
        assert resumed.state.step == 1 and resumed.prompts.order.state() == {"epoch": 0, "position": 2}
        assert_trees_equal(checkpoint_state(resumed.state.params, resumed.state.opt_state), finished[0])
    finally:
        resumed.close()


def test_a_sigterm_after_training_lets_the_run_finish_and_a_second_ends_it(capsys):
    """Once training has ended the run closes and plots: a SIGTERM then is neither a stop during start-up (the
    interrupted line, 130) nor a reason to leave the engine and verifier processes behind."""
    before = signal.getsignal(signal.SIGTERM)
    with errors._terminate_as_interrupt():
        with pytest.raises(KeyboardInterrupt):  # during start-up
            os.kill(os.getpid(), signal.SIGTERM)
        cli._finish_on_terminate()  # what train_run calls once training has ended
        os.kill(os.getpid(), signal.SIGTERM)  # let finish, said
        assert "finishing the run" in capsys.readouterr().err
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # a second one ends the process
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_verifier_of_several_processes_gives_process_0s_scores(monkeypatch):
    sent = []

    def broadcast(x):  # the collective: every process gets process 0's array
        sent.append(np.asarray(x).tolist())
        return np.array([1.0, 0.0, 1.0], np.float32)

    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", broadcast)
    local = FakeVerifier(lambda response, gold, slot: False)
    agreed = AgreedVerifier(local)
    assert agreed.score(["a", "b", "c"], ["1", "2", "3"]).tolist() == [1.0, 0.0, 1.0]
    assert sent == [[0.0, 0.0, 0.0]] and agreed.score([], []).tolist() == [] and len(sent) == 1
    agreed.close()  # the rest of the verifier's interface is the wrapped one's
    assert local.closed


@pytest.mark.parametrize("flags, expected", [([0, 0], False), ([0, 1], True)])
def test_a_stop_is_agreed_by_every_process(monkeypatch, flags, expected):
    gathered = []

    def allgather(x):  # this process (not asked to stop) and one other, as the collective returns them
        gathered.append(int(x))
        return np.asarray(flags, np.int32)

    from jax.experimental import multihost_utils

    from lspo_jax.job.signals import StopFlag

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    assert StopFlag().agreed() is expected and gathered == [0]


# ---------------------------------------------------- failure paths through the console entry points
def test_a_new_run_needs_a_config_and_a_resume_needs_a_run(tmp_path, capsys):
    # The built-in defaults are the paper's shape (32 x 16 x 8192 tokens): refused rather than run out of memory.
    assert cli.train_main(["--out", str(tmp_path / "new"), "steps=1"]) == 2
    assert "--config: a new run needs a config file" in one_line(capsys, "lspo-train")
    assert cli.train_main(["--out", str(tmp_path / "none"), "--resume"]) == 2
    assert f"nothing to resume in {tmp_path / 'none'}" in one_line(capsys, "lspo-train")
    assert cli.train_main(["--config", PAPER_CONFIG, "--out", str(tmp_path), "--resume"]) == 2
    assert "nothing to resume" in one_line(capsys, "lspo-train")
    assert not os.listdir(tmp_path)  # nothing written by any of them


def test_an_unusable_data_file_is_one_line_and_leaves_no_run(model_dir, tmp_path, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": "a", "problem": "1+1="}, {"id": "b", "problem": "2+2="}])
    out = tmp_path / "run"
    argv = ["--config", PAPER_CONFIG, "--out", str(out), f"model.path={model_dir}", f"data.train={bad}",
            "data.max_prompt_tokens=64", *WITHIN_256]  # fmt: skip
    assert cli.train_main(argv) == 2
    err = capsys.readouterr().err
    assert "none of its 2 rows is usable" in err and "line 1 (id a): missing answer" in err and "Traceback" not in err
    assert not (out / "config.yaml").exists()


def test_an_l2rr_target_without_a_usable_example_is_one_line(model_dir, train_file, tmp_path, capsys):
    row = {"id": "t", "problem": LONG_PROBLEM, "answer": "45", "solution": "\\boxed{45}"}
    target = write_jsonl(tmp_path / "target.jsonl", [row, {**row, "id": "u"}])
    argv = ["--config", PAPER_CONFIG, "--out", str(tmp_path / "run"), f"model.path={model_dir}",
            f"data.train={train_file}", "eval.benchmarks=[]",
            "data.instruction_position=none", "data.max_prompt_tokens=16", "l2rr.enabled=true",
            f"l2rr.target={target}", *WITHIN_256]  # fmt: skip
    assert cli.train_main(argv) == 2  # the paper's 32 prompts a step from a file of 8
    assert f"prompts a step, but data.train {train_file} has 8 usable ones" in capsys.readouterr().err
    assert cli.train_main([*argv, "rollout.prompts_per_step=2"]) == 2
    err = capsys.readouterr().err
    assert f"l2rr.target {target}: no example with a worked solution; 0 of 2 rows kept" in err
    assert "'prompt_skipped': 2" in err and "Traceback" not in err


def test_training_refuses_a_benchmark_that_keeps_no_problem(make_config, tmp_path, capsys, monkeypatch, easy_rule):
    config = make_config(eval__benchmarks=[write_jsonl(tmp_path / "long.jsonl", too_long_rows(2))])
    with cli_verifier(monkeypatch, easy_rule):
        assert (
            cli.train_main(["--config", write_config(tmp_path / "c.yaml", config), "--out", str(tmp_path / "r")]) == 2
        )
    assert "eval.benchmarks: long keeps no problem to validate on (2 rows" in one_line(capsys, "lspo-train")


def test_export_refuses_bad_paths_in_one_line(trained_run, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    cases = {
        (trained_run["dir"], str(tmp_path / "file")): ("exists and is not a directory",),
        (str(tmp_path), str(tmp_path / "out")): ("is not a training run",),
        (trained_run["dir"], str(tmp_path / "out"), "--step", "99"): ("no checkpoint at step 99 in", "its steps: 2, 4"),
    }
    for argv, messages in cases.items():
        assert cli.export_main(list(argv)) == 2
        err = one_line(capsys, "lspo-export")
        assert all(message in err for message in messages), err
    assert not (tmp_path / "out").exists()


def test_eval_refuses_an_unwritable_out_and_an_empty_benchmark_before_any_work(trained_run, tmp_path, capsys,
                                                                               monkeypatch):  # fmt: skip
    def no_sampling(*args, **kwargs):
        raise AssertionError("evaluation started")

    monkeypatch.setattr(evaluation, "graded_samples", no_sampling)
    base = ["--model", trained_run["dir"], "--limit", "1"]
    assert cli.eval_main([*base, "--out", str(tmp_path)]) == 2
    assert "is a directory" in one_line(capsys, "lspo-eval")
    assert cli.eval_main([*base, "--out", str(tmp_path / "no" / "such" / "r.json")]) == 2
    assert "no directory" in one_line(capsys, "lspo-eval")
    too_long = write_jsonl(tmp_path / "long.jsonl", too_long_rows(2))
    assert cli.eval_main([*base, "--benchmarks", too_long]) == 2
    assert "long: no problem is left to evaluate (rows read: 1; " in one_line(capsys, "lspo-eval")  # --limit 1
    assert cli.eval_main([*base, "--ks", "1,a"]) == 2
    assert "config error: --ks 1,a: not a comma-separated list of integers" in one_line(capsys, "lspo-eval")


def test_ctrl_c_during_start_up_is_one_line(trained_run, tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    from lspo_jax.job import build, export

    for module in (run_module, build, export):  # the run's start, lspo-eval's and lspo-export's
        monkeypatch.setattr(module, "load_policy", interrupted)
    assert cli.train_main(["--config", PAPER_CONFIG, "--out", str(tmp_path / "r")]) == 130
    assert "interrupted during start-up" in one_line(capsys, "lspo-train")
    assert cli.eval_main(["--model", trained_run["dir"]]) == 130
    assert "interrupted" in one_line(capsys, "lspo-eval")
    assert cli.export_main([trained_run["dir"], str(tmp_path / "hf")]) == 130
    assert "interrupted" in one_line(capsys, "lspo-export")
    # SIGTERM (a scheduler's stop) during start-up is the same stop, not a silent exit 143. lspo-train reads it as a
    # flag at start-up's next point (here, once the model has loaded); the others stop at once.
    real_load = build.load_policy

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_load(*args, **kwargs)

    for module in (run_module, build, export):
        monkeypatch.setattr(module, "load_policy", terminated)
    before = signal.getsignal(signal.SIGTERM)
    assert cli.train_main(["--config", PAPER_CONFIG, "--out", str(tmp_path / "r2")]) == 130
    assert "interrupted during start-up" in one_line(capsys, "lspo-train")
    assert cli.eval_main(["--model", trained_run["dir"]]) == 130
    assert "interrupted" in one_line(capsys, "lspo-eval")
    assert signal.getsignal(signal.SIGTERM) is before  # the handler was the command's alone


def test_describe_says_what_failed_without_calling_a_read_a_write():
    import errno

    from lspo_jax.rl.checkpoint import CheckpointError
    from lspo_jax.tasks.data_report import DataError

    denied = PermissionError(errno.EACCES, "Permission denied", "/data/x.jsonl")
    assert errors.describe(denied) == "cannot use /data/x.jsonl: Permission denied; check its permissions"
    try:  # a data file that cannot be read: its own line, not advice about writing
        raise DataError("/data/x.jsonl: cannot be opened (PermissionError: Permission denied)") from denied
    except DataError as err:
        assert errors.describe(err) == "/data/x.jsonl: cannot be opened (PermissionError: Permission denied)"
    try:  # space is only ever a write's, found through the causes
        raise CheckpointError("checkpoint step 3 could not be written") from OSError(errno.ENOSPC, "No space", "/c")
    except CheckpointError as err:
        assert errors.describe(err).startswith("cannot write /c: No space; free some space")


def test_the_machine_refusing_a_write_is_one_line_and_the_traceback_is_there_when_asked(tmp_path, capsys,
                                                                                        monkeypatch):  # fmt: skip
    import errno

    from lspo_jax.job import run_lock

    def read_only(path, *args):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    monkeypatch.setattr(run_lock.os, "open", read_only)
    argv = ["--config", PAPER_CONFIG, "--out", str(tmp_path / "r")]
    assert cli.train_main(argv) == 2
    lock = tmp_path / "r" / run_lock.LOCK_NAME
    assert one_line(capsys, "lspo-train").strip() == (
        f"lspo-train: cannot write {lock}: Read-only file system; choose a writable --out"
    )
    monkeypatch.setenv(errors.DEBUG_VAR, "1")
    assert cli.train_main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1].startswith(f"lspo-train: cannot write {lock}")
    monkeypatch.delenv(errors.DEBUG_VAR)

    def out_of_memory(*args, **kwargs):  # what XLA raises on an accelerator for a batch it cannot allocate
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.\nmore")

    monkeypatch.setattr(run_module, "train_run", out_of_memory)
    assert cli.train_main(argv) == 2
    assert one_line(capsys, "lspo-train").startswith(
        "lspo-train: the devices ran out of memory (RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
        "1.00GiB.); raise loss.micro_batches"
    )
