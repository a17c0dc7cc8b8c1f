"""Data files that cannot be read as a whole: a cut parquet file, a JSONL path that is a directory, a directory
without data files. ``lspo-train`` prints each as one line naming the file (exit 2, no traceback, no run left);
bad lines of a JSONL file, and rows whose fields are of a type no grader reads, stay counted rows."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lspo_jax.job import cli, toy_model
from lspo_jax.tasks import data, data_report, sources

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")
ROW = {"id": "a", "problem": "1+1=", "answer": "2", "solution": "1+1=2"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return toy_model.ensure_model(str(tmp_path_factory.mktemp("policy") / "toy"), steps=0)


def cut_parquet(path: Path) -> str:
    """A real parquet file with its second half (the footer with the schema) cut off."""
    pq.write_table(pa.Table.from_pylist([{**ROW, "id": str(i)} for i in range(50)]), path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return str(path)


def train(model_dir: str, spec: str, out: Path, capsys) -> tuple[int, str]:
    argv = ["--config", DEMO, "--out", str(out), f"model.path={model_dir}", f"data.train={spec}",
            "data.instruction_position=none", "data.max_prompt_tokens=16", "reward.workers=0"]  # fmt: skip
    code = cli.train_main(argv)
    return code, capsys.readouterr().err


def test_a_cut_parquet_file_is_one_line_naming_it(model_dir, tmp_path, capsys):
    bad = cut_parquet(tmp_path / "train-00000.parquet")
    code, err = train(model_dir, bad, tmp_path / "run", capsys)
    assert code == 2 and "Traceback" not in err and not (tmp_path / "run" / "config.yaml").exists()
    assert f"{bad}: not a readable parquet file (ArrowInvalid: Parquet magic bytes not found" in err
    # Inside a directory of shards too, and with the format named (the schema is then read by the reader).
    with pytest.raises(data_report.DataError, match=r"train-00000\.parquet: not a readable parquet file"):
        sources.read_rows(str(tmp_path), data.DataConfig(format="shared"))


def test_a_path_that_cannot_be_opened_and_a_directory_without_data(model_dir, tmp_path, capsys):
    shards = tmp_path / "shards"
    (shards / "part.jsonl").mkdir(parents=True)  # listed as a data file, but a directory
    code, err = train(model_dir, str(shards), tmp_path / "run", capsys)
    assert code == 2 and "Traceback" not in err
    assert f"{shards / 'part.jsonl'}: cannot be opened (IsADirectoryError: " in err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not data")
    code, err = train(model_dir, str(empty), tmp_path / "run", capsys)
    assert code == 2 and "Traceback" not in err and f"no .jsonl or .parquet files in {empty}" in err


def test_bad_jsonl_lines_are_counted_rows_and_a_binary_file_is_one_line(model_dir, tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"".join([json.dumps(ROW).encode(), b"\n{not json\n", b"\xff\xfe\x00bytes\n"]))
    report = data_report.DataReport()
    assert [r["id"] for r in sources.read_rows(str(path), report=report)] == ["a"]
    assert report.row_errors == ["line 2: not a JSON object", "line 3: not a JSON object"]
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)  # four newlines: five lines of bytes that are not UTF-8
    code, err = train(model_dir, str(binary), tmp_path / "run", capsys)
    assert code == 2 and "Traceback" not in err and f"{binary}: none of its 5 rows is usable" in err


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def test_fields_of_a_type_no_grader_reads_make_a_counted_listed_row(tmp_path):
    # str(["3", "4"]) would be a gold no rollout matches: a cliff on every step at accuracy 0, nothing said.
    path = write_jsonl(tmp_path / "rows.jsonl", [
        ROW,
        {**ROW, "id": "list", "answer": ["3", "4"]},
        {**ROW, "id": "dict", "problem": {"text": "1+1="}},
        {**ROW, "id": "float", "answer": 70.0},  # AIME answers read from parquet: 70.0 is the gold 70
        {**ROW, "id": "bool", "answer": True},
        {**ROW, "id": "int", "answer": 7, "solution": ["1+1=2"]},  # a solution that is no text: kept without one
        {**ROW, "id": "half", "answer": 2.5},
    ])  # fmt: skip
    report = data_report.DataReport()
    rows = sources.read_rows(path, report=report)
    assert [(r["id"], r["answer"], r["solution"]) for r in rows] == [
        ("a", "2", "1+1=2"), ("float", "70", "1+1=2"), ("int", "7", None), ("half", "2.5", "1+1=2")]  # fmt: skip
    assert report.rows_invalid == 3
    assert report.row_errors == [
        "line 2 (id list): answer is a list, not a string or number",
        "line 3 (id dict): problem is a dict, not a string",
        "line 5 (id bool): answer is a bool, not a string or number",
        "line 6 (id int): solution is a list, not a string: kept without a solution",
    ]


def test_deepmath_fields_of_the_wrong_type_and_a_float_answer_from_parquet(tmp_path):
    deepmath = {"question": "1+1=", "final_answer": "2", "difficulty": 1.0, "topic": "arithmetic",
                "r1_solution_1": "2</think> 2"}  # fmt: skip
    path = write_jsonl(tmp_path / "deepmath.jsonl", [
        deepmath, {**deepmath, "final_answer": ["2"]}, {**deepmath, "question": 5}])  # fmt: skip
    report = data_report.DataReport()
    assert [(r["id"], r["answer"]) for r in sources.read_rows(path, report=report)] == [("0", "2")]
    assert report.row_errors == [
        "line 2 (id 1): final_answer is a list, not a string or number",
        "line 3 (id 2): question is an int, not a string",
    ]
    aime = tmp_path / "aime.parquet"  # a float column, as MathArena's answers may be read
    pq.write_table(pa.Table.from_pylist([{"problem": "p", "answer": 70.0}, {"problem": "q", "answer": 204.0}]), aime)
    assert [r["answer"] for r in sources.read_rows(str(aime))] == ["70", "204"]
