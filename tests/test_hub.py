"""Models and datasets by their hub names (``lspo_jax.hub``), resolved offline from a Hugging Face cache the tests lay
out (``hub_cache``): ``model.path=ORG/NAME`` and ``data.train=ORG/DATASET``, benchmark files in the hub's own
schemas (MATH-500, AIME 2024, MathArena's AIME 2026), splits, and a name the cache lacks failing in one line."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hub_cache import files_of, write_repo

from lspo_jax import hub
from lspo_jax.job import build, cli, errors
from lspo_jax.job.config import load_config
from lspo_jax.models import hf
from lspo_jax.tasks import benchmarks, data_report, sources

BIN = os.path.dirname(sys.executable)  # the console commands installed beside this interpreter


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def parquet(rows: list[dict]) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue()


def packaged_rows(name: str) -> list[dict]:
    with open(benchmarks.packaged_file(name)) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", True),
        ("zwhe99/DeepMath-103K@main:train", True),
        ("HuggingFaceH4/MATH-500:test.jsonl", True),
        ("toy", False),
        ("toy:addition", False),
        ("math500", False),
        ("runs/demo/checkpoints", False),  # two levels deep: a path, never a repository
        ("data/train.jsonl", False),  # a data file's name: a missing file, not a repository
    ],
)
def test_what_is_a_hub_name(spec, expected):
    assert hub.is_hub_name(spec) is expected


def test_a_local_path_wins_over_a_hub_name(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not hub.is_hub_name("org/name") and hub.is_hub_name("org/other")


# -------------------------------------------------------------------------------------------------- models
def test_model_path_by_hub_name_loads_the_cached_snapshot(hub_cache, hf_untied_dir, tmp_path):
    snapshot = write_repo(hub_cache, "tiny-org/qwen2", files_of(hf_untied_dir))
    commit = snapshot.name
    for spec in ("tiny-org/qwen2", f"tiny-org/qwen2@{commit}"):
        run = load_config(None, [f"model.path={spec}"])
        assert build.model_dir(run, str(tmp_path)) == str(snapshot)
        policy, params = build.load_policy(run, str(tmp_path))
        _, local = hf.load_pretrained(hf_untied_dir)
        same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), params, local)
        assert all(jax.tree.leaves(same)) and policy.tokenizer.decode(policy.tokenizer.encode("1+2=3")) == "1+2=3"


def test_a_name_missing_from_the_cache_is_one_line_that_says_how_to_fetch_it(hub_cache, capsys):
    code = cli.eval_main(["--model", "nobody/missing-model", "--benchmarks", "math500", "--workers", "0"])
    err = capsys.readouterr().err.strip()
    assert code == errors.EXIT_CONFIG and len(err.splitlines()) == 1, err
    assert "model.path nobody/missing-model" in err and "hf download nobody/missing-model" in err
    assert str(hub_cache) in err  # where it looked


# ------------------------------------------------------------------------------------------------ datasets
def test_math500_in_the_hub_schema_loads_500_rows(hub_cache):
    """``HuggingFaceH4/MATH-500``'s ``test.jsonl``: ``problem, solution, answer, subject, level, unique_id``."""
    rows = packaged_rows("math500")
    hub_rows = [
        {"problem": r["problem"], "solution": r["solution"], "answer": r["answer"], "subject": r["meta"]["subject"],
         "level": r["meta"]["level"], "unique_id": r["id"]}
        for r in rows
    ]  # fmt: skip
    write_repo(hub_cache, "HuggingFaceH4/MATH-500", {"test.jsonl": jsonl(hub_rows), "README.md": b"# MATH-500"},
               repo_type="dataset")  # fmt: skip
    report = data_report.DataReport()
    loaded = sources.read_rows("HuggingFaceH4/MATH-500", report=report)
    assert len(loaded) == 500 and report.rows_invalid == 0
    assert [r["id"] for r in loaded] == [r["id"] for r in rows]
    assert [r["answer"] for r in loaded] == [r["answer"] for r in rows]
    assert loaded[0]["meta"] == {"subject": rows[0]["meta"]["subject"], "level": rows[0]["meta"]["level"]}
    assert benchmarks.benchmark_name("HuggingFaceH4/MATH-500") == "MATH-500"


def test_aime24_as_hub_parquet_and_aime26_by_its_bare_name(hub_cache):
    """``HuggingFaceH4/aime_2024`` (parquet: ``id`` an int, ``problem, solution, answer, url, year``) and MathArena's
    AIME 2026 (``problem_idx, problem, answer``, both ints), which ``aime26`` names when no file is found first."""
    rows = packaged_rows("aime24")
    aime24 = [{"id": 60 + i, "problem": r["problem"], "solution": r["solution"], "answer": r["answer"],
               "url": "https://artofproblemsolving.com", "year": "2024"} for i, r in enumerate(rows)]  # fmt: skip
    write_repo(hub_cache, "HuggingFaceH4/aime_2024", {"data/train-00000-of-00001.parquet": parquet(aime24)},
               repo_type="dataset")  # fmt: skip
    loaded = sources.read_rows("HuggingFaceH4/aime_2024")
    assert [r["id"] for r in loaded] == [str(60 + i) for i in range(30)] and loaded[5]["answer"] == rows[5]["answer"]
    aime26 = [{"problem_idx": i + 1, "problem": f"Find {i}.", "answer": 100 + i} for i in range(30)]
    write_repo(hub_cache, "MathArena/aime_2026", {"data/train-00000-of-00001.parquet": parquet(aime26)},
               repo_type="dataset")  # fmt: skip
    spec = benchmarks.benchmark_path("aime26")
    assert spec == "MathArena/aime_2026"
    loaded = sources.read_rows(spec)
    assert [(r["id"], r["answer"]) for r in loaded[:2]] == [("1", "100"), ("2", "101")] and len(loaded) == 30


def test_data_train_by_hub_name_reads_deepmath_parquet_shards(hub_cache, hf_untied_dir, tmp_path):
    shards = {
        f"data/train-0000{i}-of-00002.parquet": parquet(
            [
                {
                    "question": f"{i}{j}+1=",
                    "final_answer": str(10 * i + j + 1),
                    "difficulty": 3.0,
                    "topic": "arith",
                    "r1_solution_1": f"so\n</think>\n\\boxed{{{10 * i + j + 1}}}",
                }
                for j in range(3)
            ]  # fmt: skip
        )
        for i in range(2)
    }
    write_repo(hub_cache, "tiny-org/deepmath", {**shards, "README.md": b"card"}, repo_type="dataset")
    run = load_config(None, ["data.train=tiny-org/deepmath", f"model.path={hf_untied_dir}", "data.cache_dir=null"])
    policy, _ = build.load_policy(run, str(tmp_path))
    examples, report = build.load_examples(run, policy, run.data.train, run.seed)
    # Shard 0 then shard 1, ids their position in the whole source, as for DeepMath-103K read from a directory.
    assert [(e.id, e.answer) for e in examples] == [(str(k), str(a)) for k, a in enumerate([1, 2, 3, 11, 12, 13])]
    assert report.rows == 6 and all(e.solution_ids is not None for e in examples)


def test_a_dataset_of_several_splits_asks_for_one(hub_cache):
    train = parquet([{"problem": "1+1=", "answer": "2"}])
    test = parquet([{"problem": "2+2=", "answer": "4"}, {"problem": "3+3=", "answer": "6"}])
    files = {"data/train-00000-of-00001.parquet": train, "data/test-00000-of-00001.parquet": test}
    write_repo(hub_cache, "tiny-org/sums", files, repo_type="dataset")
    with pytest.raises(FileNotFoundError, match=r"holds the splits test, train; name one, e.g. tiny-org/sums:test"):
        sources.read_rows("tiny-org/sums")
    assert [r["answer"] for r in sources.read_rows("tiny-org/sums:test")] == ["4", "6"]
    assert [r["answer"] for r in sources.read_rows("tiny-org/sums:data/train-00000-of-00001.parquet")] == ["2"]
    with pytest.raises(FileNotFoundError, match="no data file or split of tiny-org/sums is 'dev'"):
        sources.read_rows("tiny-org/sums:dev")


def test_lspo_eval_with_a_hub_model_and_a_hub_benchmark_in_its_own_process(hub_cache, hf_untied_dir, tmp_path):
    """The installed command, its own process reading ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` from the environment."""
    write_repo(hub_cache, "tiny-org/qwen2", files_of(hf_untied_dir))
    rows = [{"unique_id": f"p{i}", "problem": f"{i}+1=", "answer": str(i + 1), "solution": None} for i in range(3)]
    write_repo(hub_cache, "tiny-org/sums", {"test.jsonl": jsonl(rows)}, repo_type="dataset")
    out = tmp_path / "results.json"
    argv = ["--model", "tiny-org/qwen2", "--benchmarks", "tiny-org/sums", "--n", "1", "--max-new-tokens", "4",
            "--workers", "0", "--out", str(out), "data.max_prompt_tokens=64"]  # fmt: skip
    env = {**os.environ, "LSPO_JAX_COMPILATION_CACHE": ""}
    done = subprocess.run([os.path.join(BIN, "lspo-eval"), *argv], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["model"] == "tiny-org/qwen2"
    assert [p["id"] for p in result["benchmarks"]["sums"]["per_problem"]] == ["p0", "p1", "p2"]
