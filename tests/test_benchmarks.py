"""Benchmarks by name (``tasks.benchmarks``): the three that ship inside the package, checked against their manifest,
and the order a bare name is looked up in (an explicit directory or ``$LSPO_JAX_DATA_DIR``, the package, the hub)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest

from lspo_jax.tasks import benchmarks, data_report, rewards, sources, templates


@pytest.mark.parametrize("name, rows", [("math500", 500), ("aime24", 30), ("aime25", 30)])
def test_a_packaged_benchmark_loads_whole_with_its_licence(name, rows):
    path = benchmarks.benchmark_path(name)
    assert path == str(benchmarks.PACKAGED_DIR / f"{name}.jsonl")
    report = data_report.DataReport()
    loaded = sources.read_rows(path, report=report)
    assert len(loaded) == rows == benchmarks.manifest()[name]["rows"] and report.rows_invalid == 0
    assert len({r["id"] for r in loaded}) == rows  # ids are unique: per-problem records are keyed by them
    assert rewards.parse_golds((r["id"], r["answer"]) for r in loaded).n_bad == 0
    entry = benchmarks.manifest()[name]
    assert entry["license"] == "MIT" and entry["license_files"]
    for licence in entry["license_files"]:
        assert "Permission is hereby granted" in (benchmarks.PACKAGED_DIR / licence).read_text()


def test_a_damaged_packaged_file_is_refused(tmp_path, monkeypatch):
    copy = tmp_path / "benchmarks"
    shutil.copytree(benchmarks.PACKAGED_DIR, copy)
    text = (copy / "aime25.jsonl").read_text()
    (copy / "aime25.jsonl").write_text(text.replace('"answer": "70"', '"answer": "71"', 1))  # one gold changed
    monkeypatch.setattr(benchmarks, "PACKAGED_DIR", copy)
    assert benchmarks.benchmark_path("aime24") == str(copy / "aime24.jsonl")  # the others still load
    with pytest.raises(benchmarks.BenchmarkNotFound, match="aime25.jsonl: its sha256 .* is not the manifest's"):
        benchmarks.benchmark_path("aime25")


def test_the_manifest_holds_each_file_s_sha256():
    for name, entry in benchmarks.manifest().items():
        digest = hashlib.sha256((benchmarks.PACKAGED_DIR / entry["file"]).read_bytes()).hexdigest()
        assert digest == entry["sha256"], name


def test_an_explicit_directory_then_the_environment_come_before_the_package(tmp_path, monkeypatch):
    mine, env = tmp_path / "mine", tmp_path / "env"
    for folder in (mine, env):
        folder.mkdir()
        (folder / "math500.jsonl").write_text(json.dumps({"id": "a", "problem": "1+1=", "answer": "2"}) + "\n")
    monkeypatch.delenv(benchmarks.DATA_DIR_VAR, raising=False)
    assert benchmarks.benchmark_path("math500", mine) == str(mine / "math500.jsonl")
    monkeypatch.setenv(benchmarks.DATA_DIR_VAR, str(env))
    assert benchmarks.benchmark_path("math500") == str(env / "math500.jsonl")
    assert benchmarks.benchmark_path("math500", mine) == str(mine / "math500.jsonl")  # the explicit one wins
    # A name the directory lacks falls through to the package.
    assert benchmarks.benchmark_path("aime24", mine) == str(benchmarks.PACKAGED_DIR / "aime24.jsonl")


def test_an_unknown_name_names_every_place_it_looked(tmp_path, monkeypatch):
    monkeypatch.delenv(benchmarks.DATA_DIR_VAR, raising=False)
    with pytest.raises(benchmarks.BenchmarkNotFound) as info:
        benchmarks.benchmark_path("olympiad", tmp_path)
    message = str(info.value)
    assert str(tmp_path / "olympiad.jsonl") in message and "math500, aime24, aime25" in message
    assert "aime26" in message and "--data-dir" in message and len(message.splitlines()) == 1


def test_paths_hub_names_and_generated_tasks_are_taken_as_given():
    for spec in ("dir/file.jsonl", "HuggingFaceH4/MATH-500", "toy:heldout", "math500.jsonl"):
        assert benchmarks.benchmark_path(spec) == spec
    assert [benchmarks.benchmark_name(s) for s in ("dir/x.jsonl", "toy:heldout", "org/MATH-500:test")] == [
        "x", "toy_heldout", "MATH-500_test"
    ]  # fmt: skip


def test_lspo_eval_reads_the_packaged_benchmarks_whole(capsys, monkeypatch):
    """``lspo-eval --benchmarks math500,aime24,aime25`` on the shipped demo model, with nothing but the package: every
    row of each is read (500, 30, 30) and reported; the character-level demo model holds the problems of up to 200
    characters (the rest are counted as skipped, not lost silently) and scores about nothing on them."""
    from lspo_jax.job import cli

    monkeypatch.setenv("LSPO_JAX_COMPILATION_CACHE", "")
    monkeypatch.delenv(benchmarks.DATA_DIR_VAR, raising=False)
    argv = ["--model", "toy", "--benchmarks", "math500,aime24,aime25", "--n", "1", "--max-new-tokens", "8",
            "--workers", "0", "data.max_prompt_tokens=200"]  # fmt: skip
    assert cli.eval_main(argv) == 0
    captured = capsys.readouterr()
    for name, rows in (("math500", 500), ("aime24", 30), ("aime25", 30)):
        assert re.search(rf"^lspo-eval: {name}: \d+ of {rows} rows kept", captured.err, re.MULTILINE), captured.err
        assert f"| {name} | " in captured.out and f"lspo-eval: {name}: sampling " in captured.err


def test_lspo_eval_refuses_an_empty_out_and_a_config_beside_a_run(tmp_path, capsys):
    from lspo_jax.job import cli, errors

    assert cli.eval_main(["--model", "toy", "--out", ""]) == errors.EXIT_CONFIG
    assert "--out '': name a file to write" in capsys.readouterr().err
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("steps: 1\n")
    assert cli.eval_main(["--model", str(run_dir), "--config", "configs/demo.yaml"]) == errors.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "is a training run, evaluated with its own config.yaml" in err and len(err.strip().splitlines()) == 1


def test_bench_packing_reads_the_packaged_prompts_where_the_data_folder_lacks_them(tmp_path, monkeypatch):
    from tools import bench_packing, qwen_vocab

    # A prompt's "tokens" are its characters here: what is checked is which file is read, not the vocabulary.
    monkeypatch.setattr(qwen_vocab, "r1_tokenizer", lambda: None)
    monkeypatch.setattr(templates, "render_prompt", lambda tokenizer, text: list(text))
    with open(benchmarks.packaged_file("aime24")) as f:
        packaged = [json.loads(line)["problem"] for line in f if line.strip()]
    lengths = bench_packing.r1_prompt_lengths(str(tmp_path), "aime24")  # nothing in tmp_path: the package's file
    assert len(lengths) == len(packaged) == 30
    (tmp_path / "aime24.jsonl").write_text(json.dumps({"problem": "x"}) + "\n")  # a file in --data-dir wins
    assert len(bench_packing.r1_prompt_lengths(str(tmp_path), "aime24")) == 1
    with pytest.raises(FileNotFoundError, match="nosuch.jsonl"):
        bench_packing.r1_prompt_lengths(str(tmp_path), "nosuch")
