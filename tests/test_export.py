"""lspo-export's OUT is the whole export or as it was: the files are written beside it and renamed into place, so a
stop or a failure while writing leaves nothing behind, an OUT that exists is replaced whole (or refused, when it
holds more than a model), and the run's own directory or its checkpoints are never an OUT.

The loading of an export in transformers is tested in test_run_resume.py (``test_export_loads_in_transformers``)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import time

import pytest
from run_fixtures import one_line
from safetensors.numpy import load_file

from lspo_jax.job import cli, errors, export
from lspo_jax.models import hf


def listing(path) -> list[str]:
    """Every file and directory under ``path``, relative to it."""
    return sorted(os.path.relpath(os.path.join(d, name), path) for d, ds, fs in os.walk(path) for name in ds + fs)


@pytest.fixture
def run_dir(trained_run, tmp_path) -> str:
    """A copy of the trained run (checkpoints at steps 2 and 4), alone in ``tmp_path``."""
    return str(shutil.copytree(trained_run["dir"], tmp_path / "run"))


def interrupt():
    raise KeyboardInterrupt


def terminate():
    os.kill(os.getpid(), signal.SIGTERM)  # the command's flag is set: the export ends at its next check


def disk_full():
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "model.safetensors")


@pytest.mark.parametrize(
    ("stop", "status", "line"),
    [
        (interrupt, 130, "lspo-export: interrupted; nothing was exported"),
        (terminate, 130, "lspo-export: interrupted; nothing was exported"),
        (disk_full, 2, "lspo-export: cannot write model.safetensors: No space left on device"),
    ],
)
def test_a_stop_or_failure_while_writing_leaves_nothing(run_dir, tmp_path, capsys, monkeypatch, stop, status, line):
    written = []

    def save_pretrained(path, *args, **kwargs):  # the first file written, then the stop
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            f.write("{}")
        written.append(path)
        stop()

    monkeypatch.setattr(hf, "save_pretrained", save_pretrained)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "exports" / "hf"  # its parent, made for the export, goes with it
    assert cli.export_main([run_dir, str(out)]) == status
    assert line in one_line(capsys, "lspo-export")
    assert written and os.listdir(tmp_path) == ["run"]  # no OUT, no OUT.partial-*, no exports/
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_stop_after_the_first_tensor_ends_the_export_with_nothing_exported(run_dir, tmp_path, capsys, monkeypatch):
    """SIGTERM while the first tensor is copied from the device: the flag is read before the next one, the command
    exits 130 at once with its two lines (the stop, then nothing exported), and OUT and its staging are gone."""
    real, gathered, sent = hf.to_hf_state_dict, [], []

    def first_then_terminate(*args):
        for name, tensor in real(*args):
            if not gathered:
                sent.append(time.perf_counter())
                os.kill(os.getpid(), signal.SIGTERM)
            gathered.append(name)
            yield name, tensor

    monkeypatch.setattr(hf, "to_hf_state_dict", first_then_terminate)
    before = signal.getsignal(signal.SIGTERM)
    assert cli.export_main([run_dir, str(tmp_path / "hf")]) == 130
    assert time.perf_counter() - sent[0] < 30
    err = one_line(capsys, "lspo-export")
    assert "lspo-export: SIGTERM received, stopping after the current tensor or file; nothing is exported" in err
    assert "lspo-export: interrupted; nothing was exported" in err
    assert len(gathered) == 1  # no tensor after the stop
    assert os.listdir(tmp_path) == ["run"] and signal.getsignal(signal.SIGTERM) is before


def test_a_stop_during_the_rename_is_a_success(run_dir, tmp_path, capsys, monkeypatch):
    real, renamed = export._replace, []

    def replace_then_terminate(staging, target):
        real(staging, target)
        renamed.append(target)
        os.kill(os.getpid(), signal.SIGTERM)  # the export is complete: the stop finds nothing left to stop

    monkeypatch.setattr(export, "_replace", replace_then_terminate)
    out = tmp_path / "hf"
    assert cli.export_main([run_dir, str(out)]) == 0
    assert json.loads(capsys.readouterr().out) == {"exported": str(out)} and renamed == [str(out)]
    assert "model.safetensors" in os.listdir(out) and sorted(os.listdir(tmp_path)) == ["hf", "run"]


def test_an_export_over_an_earlier_one_replaces_it_whole(run_dir, tmp_path, capsys):
    records, out = sorted(os.listdir(run_dir)), os.path.join(run_dir, "hf")  # inside the run, beside its records
    assert cli.export_main([run_dir, out, "--step", "2"]) == 0
    assert json.loads(capsys.readouterr().out) == {"exported": out}
    exported = listing(out)
    step2 = load_file(os.path.join(out, "model.safetensors"))
    # An earlier writer's files that this export does not write: a shard and its index, a tokenizer model.
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.model", "README.md"):
        (tmp_path / "run" / "hf" / name).write_text("{}")
    assert cli.export_main([run_dir, out]) == 0
    assert json.loads(capsys.readouterr().out) == {"exported": out}
    assert listing(out) == exported  # the new export's files, none of the old ones
    step4 = load_file(os.path.join(out, "model.safetensors"))
    assert any((step4[name] != step2[name]).any() for name in step2)
    assert sorted(os.listdir(run_dir)) == sorted([*records, "hf"])  # no hf.partial-*, no hf.replaced-* left


def test_export_refuses_the_run_directory_and_an_out_holding_more_than_a_model(run_dir, tmp_path, capsys):
    (tmp_path / "link").symlink_to(run_dir)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "data").mkdir()
    checkpoints = os.path.join(run_dir, "checkpoints")
    cases = {
        run_dir: f"{run_dir} is the run directory {run_dir} or holds it",
        str(tmp_path): f"{tmp_path} is the run directory {run_dir} or holds it",
        str(tmp_path / "link"): f"{tmp_path / 'link'} is the run directory {run_dir} or holds it",
        os.path.join(checkpoints, "hf"): f"{checkpoints}/hf is inside {checkpoints}: export outside the checkpoints",
        str(tmp_path / "notes"): f"{tmp_path / 'notes'} holds no config.json: lspo-export replaces OUT whole",
        str(tmp_path / "model"): f"{tmp_path / 'model'} holds data, not a file: lspo-export replaces OUT whole",
    }
    before = {path: listing(path) for path in (run_dir, tmp_path / "notes", tmp_path / "model")}
    for out, message in cases.items():
        assert cli.export_main([run_dir, out]) == 2
        err = one_line(capsys, "lspo-export")
        assert len(err.splitlines()) == 1 and f"lspo-export: {message}" in err, err
    assert {path: listing(path) for path in before} == before
    assert sorted(os.listdir(tmp_path)) == ["link", "model", "notes", "run"]


def test_an_adapter_asked_of_a_run_that_trained_the_base_is_refused_in_one_line(run_dir, tmp_path, capsys):
    """``--adapter`` of a run with ``optim.train: full``: its checkpoints hold the base alone, no adapter to write."""
    assert cli.export_main([run_dir, str(tmp_path / "hf"), "--adapter"]) == errors.EXIT_CONFIG
    err = one_line(capsys, "lspo-export")
    assert err == "lspo-export: no policy adapter to write: the run trained the base (optim.train: full)\n", err
    assert os.listdir(tmp_path) == ["run"]  # nothing staged, nothing left
