"""``metrics.jsonl`` with an offline Weights & Biases run beside it, read back from W&B's own ``.wandb`` file."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from lspo_jax.job.config import load_config
from lspo_jax.job.metrics_log import MetricsError, MetricsLog, read_metrics, wandb_options
from lspo_jax.train_config import ConfigError

RECORDS = [
    {"kind": "eval", "step": 0, "benchmark": "math500", "accuracy": 0.25, "pass@1": 0.5},
    {"kind": "train", "step": 1, "loss": 0.5, "entropy": float("nan"), "update_skipped": False},
    {"kind": "train", "step": 2, "loss": 0.25},
    {"kind": "train", "step": 1, "loss": 9.0},  # a resume re-logging step 1: in the JSON log, not in W&B
]


def wandb_history(path: Path) -> list[dict]:
    """The history rows of a ``.wandb`` file: a ``:W&B`` header (7 bytes), then records framed as in LevelDB's
    log (crc32c 4, length 2, type 1) holding ``wandb_internal_pb2.Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    rows, pos = [], 7
    while pos + 7 <= len(data):
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        assert kind == 1, "a record split over 32 KiB blocks: this small reader does not join them"
        record = wandb_internal_pb2.Record.FromString(data[pos + 7 : pos + 7 + length])
        if record.WhichOneof("record_type") == "history":
            items = record.history.item  # "train/loss" is stored as a nested key
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
        pos += 7 + length
    return rows


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # leave pytest's capture of stdout alone
    return {"project": "lspo_jax_test", "mode": "offline", "config": {"steps": 2}}


def test_offline_wandb_run_holds_the_logged_steps(tmp_path, offline_wandb):
    import wandb

    run_dir = tmp_path / "run"
    for _ in range(2):  # the second pass is a resumed run: the same W&B id, the same JSON log
        log = MetricsLog(str(run_dir), wandb=offline_wandb)
        for record in RECORDS:
            log.write(record)
        log.close()
        # finish() can return before W&B's service process has written the file; teardown waits for it.
        wandb.teardown()
    assert len(read_metrics(str(run_dir / "metrics.jsonl"))) == 2 * len(RECORDS)
    run_id = (run_dir / "wandb_id").read_text()
    # Both passes wrote under the stored id. Each pass writes its own folder (offline-run-TIME-ID, and W&B adds a
    # "-1" to the second when both start within one second), so the id is read from the .wandb files' names.
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert files and {f.name for f in files} == {f"run-{run_id}.wandb"}
    history = wandb_history(files[0])
    assert [row["_step"] for row in history] == [0, 1, 2]
    assert history[0]["eval/math500/pass@1"] == 0.5 and history[0]["eval/math500/accuracy"] == 0.25
    assert history[1]["train/loss"] == 0.5 and "train/entropy" not in history[1]  # NaN is null: not a number
    assert history[2]["train/loss"] == 0.25 and all(row.get("train/loss") != 9.0 for row in history)


def test_wandb_options_follow_the_log_section(monkeypatch):
    assert wandb_options(load_config(None)) is None
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: `import wandb` raises ImportError
    with pytest.raises(ConfigError, match=r"^log\.wandb: wandb is not installed"):
        wandb_options(load_config(None, ["log.wandb=true"]))
    with pytest.raises(ConfigError, match=r"^log\.wandb_mode: must be one of \('online', 'offline'\), got 'cloud'$"):
        load_config(None, ["log.wandb_mode=cloud"])


def test_wandb_options_carry_project_mode_and_config():
    pytest.importorskip("wandb")
    options = wandb_options(load_config(None, ["log.wandb=true", "log.wandb_mode=online", "steps=7"]))
    assert options["project"] == "lspo_jax" and options["mode"] == "online"
    assert options["config"]["steps"] == 7 and options["config"]["log"]["wandb"] is True


def test_a_cut_off_last_line_is_left_out_and_a_bad_line_elsewhere_is_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    whole = [{"kind": "train", "step": 1, "loss": 0.5}, {"kind": "eval", "step": 1, "benchmark": "x", "pass@1": 0.25}]
    text = "".join(json.dumps(r) + "\n" for r in whole)
    cut = '{"kind": "train", "step": 2, "lo'
    path.write_text(text + cut)  # what a kill during the write leaves
    said = []
    assert read_metrics(str(path), said.append) == whole
    assert said == [f"{path}: its last line was cut off mid-write ({len(cut)} characters); it is left out"]
    path.write_text(text + "\n")  # blank lines are no records
    assert read_metrics(str(path), said.append) == whole and len(said) == 1
    path.write_text('{"kind": "train", "st\n' + text)
    with pytest.raises(MetricsError, match=r"metrics\.jsonl: line 1 is not a JSON record \(Unterminated string"):
        read_metrics(str(path))
    path.write_text(text + "[1, 2]\n")
    with pytest.raises(MetricsError, match=r"metrics\.jsonl: line 3 is not a metrics record \(no integer step\)"):
        read_metrics(str(path))


def test_lspo_eval_refuses_zero_samples_instead_of_taking_the_default():
    from lspo_jax.job import eval_command

    args = eval_command.parser().parse_args(["--model", "toy", "--n", "0"])
    with pytest.raises(ConfigError, match=r"^eval\.(n|ks)"):
        eval_command._eval_settings(load_config(None), args)
    default = eval_command._eval_settings(load_config(None), eval_command.parser().parse_args(["--model", "toy"]))
    assert default.eval.n == load_config(None).eval.n
