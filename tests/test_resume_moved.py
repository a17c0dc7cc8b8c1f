"""A run resumed with its model somewhere else (``--resume model.path=NEW``): the same model (its shapes and
vocabulary) is accepted, said, and recorded in config.yaml; another model is refused in one line naming what differs,
whether the run's own directory is still there, only the checkpoint's record of its shapes is, or neither (a run from
before the record: the restore then refuses what does not fit). Runs are copies of ``trained_run`` (run_fixtures)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import pytest
import yaml
from hub_cache import files_of, write_repo
from run_fixtures import cli_verifier, one_line

from lspo_jax.job import cli, toy_model
from lspo_jax.job.run_dir import model_shapes, recorded_model_shapes
from lspo_jax.models import hf, specs


@pytest.fixture(scope="module")
def narrower_model(tmp_path_factory, model_dir) -> str:
    """The run's model with hidden_size 64 (the run's has 128): the same tokenizer, other shapes."""
    config = dataclasses.replace(toy_model.model_config(), hidden_size=64)
    path = str(tmp_path_factory.mktemp("narrower") / "model")
    hf.save_pretrained(path, config, {"base": specs.init_params(config, jax.random.key(1))["base"]})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(model_dir, name), path)
    return path


def run_copy(trained_run, tmp_path, *, model_path: str | None = None, recorded: bool = True) -> str:
    """A copy of the trained run; ``model_path`` replaces its config.yaml's (a directory since gone), and without
    ``recorded`` its checkpoints hold no record of the model's shapes (as those written before the record)."""
    run_dir = str(shutil.copytree(trained_run["dir"], tmp_path / "run"))
    if model_path is not None:
        config = os.path.join(run_dir, "config.yaml")
        with open(config) as f:
            saved = yaml.safe_load(f)
        saved["model"]["path"] = model_path
        with open(config, "w") as f:
            yaml.safe_dump(saved, f, sort_keys=False)
    for step in ("2", "4") if not recorded else ():
        path = os.path.join(run_dir, "checkpoints", step, "meta", "metadata")
        with open(path) as f:
            meta = json.load(f)
        del meta["model"]
        with open(path, "w") as f:
            json.dump(meta, f)
    return run_dir


def saved_model_path(run_dir: str, name: str = "config.yaml") -> str:
    with open(os.path.join(run_dir, name)) as f:
        return yaml.safe_load(f)["model"]["path"]


def test_a_copied_model_resumes_and_the_run_records_where(trained_run, model_dir, tmp_path, capsys, monkeypatch,
                                                          easy_rule):  # fmt: skip
    moved = str(shutil.copytree(model_dir, tmp_path / "moved"))
    run_dir = run_copy(trained_run, tmp_path)
    with cli_verifier(monkeypatch, easy_rule):
        assert cli.train_main(["--out", run_dir, "--resume", f"model.path={moved}"]) == 0
    err = capsys.readouterr().err
    said = f"lspo-train: model.path moved from {model_dir} to {moved}: the same model (shapes and vocabulary); resuming"
    assert said in err.splitlines(), err
    kept = f"{run_dir}/config.step4.yaml"
    assert f"--resume changes model.path {model_dir!r} -> {moved!r}; steps 1-4 ran with {kept}" in err
    assert saved_model_path(run_dir) == moved and saved_model_path(run_dir, "config.step4.yaml") == model_dir


def test_checkpoints_record_the_shapes_of_their_model(trained_run, model_dir):
    recorded = recorded_model_shapes(trained_run["dir"])
    assert recorded == model_shapes(model_dir)
    assert recorded["hidden_size"] == 128 and recorded["tokenizer_vocab_size"] == 55 and recorded["tie_word_embeddings"]


@pytest.mark.parametrize("where", ["own directory", "record", "own directory, no record"])
def test_a_model_of_other_shapes_is_refused_in_one_line(where, trained_run, narrower_model, tmp_path, capsys):
    # The run's own directory gone, the checkpoints' record answers; the record missing, the directory does.
    gone = str(tmp_path / "gone")
    run_dir = run_copy(trained_run, tmp_path, model_path=gone if where == "record" else None,
                       recorded=where != "own directory, no record")  # fmt: skip
    with open(os.path.join(run_dir, "config.yaml")) as f:
        before = f.read()
    assert cli.train_main(["--out", run_dir, "--resume", f"model.path={narrower_model}"]) == 2
    err = one_line(capsys, "lspo-train")
    assert f"--resume: model.path {narrower_model}: hidden_size 64, the run's model had 128 (at " in err, err
    assert "vocab" not in err.split("hidden_size")[1]  # the only field that differs
    with open(os.path.join(run_dir, "config.yaml")) as f:
        assert f.read() == before


def test_a_run_without_a_record_and_its_model_gone_resumes_unchecked(trained_run, model_dir, narrower_model, tmp_path,
                                                                     capsys, monkeypatch, easy_rule):  # fmt: skip
    gone = str(tmp_path / "gone")
    run_dir = run_copy(trained_run, tmp_path, model_path=gone, recorded=False)
    # Other shapes: nothing to compare before the restore, which refuses the arrays; no checkpoint is set aside.
    assert cli.train_main(["--out", run_dir, "--resume", f"model.path={narrower_model}"]) == 2
    err = one_line(capsys, "lspo-train")
    assert f"model.path moved from {gone} to {narrower_model}: the shapes could not be compared" in err
    assert (f"--resume: the run's checkpoint does not fit the model at model.path {narrower_model} (moved from "
            f"{gone}, its shapes not compared): ValueError: Requested shape: " in err), err  # fmt: skip
    assert "is not compatible with the stored shape" in err  # orbax's check of each array
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["2", "4"]
    assert not os.path.exists(os.path.join(run_dir, "checkpoints.unreadable"))
    # The same model: resumed, said, and its shapes recorded at the next checkpoint.
    moved = str(shutil.copytree(model_dir, tmp_path / "moved"))
    with cli_verifier(monkeypatch, easy_rule):
        assert cli.train_main(["--out", run_dir, "--resume", f"model.path={moved}", "steps=5"]) == 0
    err = capsys.readouterr().err
    assert f"lspo-train: model.path moved from {gone} to {moved}: the shapes could not be compared ({gone} cannot " \
           "be read, and the run's checkpoints do not record them); resuming" in err, err  # fmt: skip
    assert recorded_model_shapes(run_dir) == model_shapes(model_dir) and saved_model_path(run_dir) == moved


def test_a_hub_name_of_the_same_model_resumes(trained_run, model_dir, tmp_path, hub_cache, capsys, monkeypatch,
                                              easy_rule):  # fmt: skip
    write_repo(hub_cache, "acme/toy-policy", files_of(model_dir))
    run_dir = run_copy(trained_run, tmp_path, recorded=False)  # compared with the run's own directory
    with cli_verifier(monkeypatch, easy_rule):
        assert cli.train_main(["--out", run_dir, "--resume", "model.path=acme/toy-policy"]) == 0
    err = capsys.readouterr().err
    assert f"model.path moved from {model_dir} to acme/toy-policy: the same model (shapes and vocabulary)" in err, err
    assert saved_model_path(run_dir) == "acme/toy-policy"
