"""The example store: the eager loader's examples in its order, read back without re-parsing, keyed by what they
depend on, rebuilt when damaged; solutions tokenised on first use, a failure counted and skipped."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lspo_jax.rl import prompts
from lspo_jax.tasks import data, example_store, rewards, templates, toy
from lspo_jax.train_config import DataConfig
from tools import qwen_vocab

TRACE = "Add them: 2+3=5.\n</think>\n\nThe sum is \\boxed{5}."


def record(i: int, **fields) -> dict:
    row = {"question": f"What is {i}+{i}? " + "Think. " * (i % 7), "final_answer": str(2 * i), "difficulty": 3.0,
           "topic": "Arithmetic", "r1_solution_1": f"{TRACE} " * (1 + i % 5)}  # fmt: skip
    return {**row, **fields}


def records(n: int) -> list[dict]:
    """``n`` DeepMath rows with every kind of trouble loading handles: a missing field, an unparseable gold, a
    prompt over the limit, no solution, solutions over the limit (truncated), and a repeated answer."""
    rows = [record(i) for i in range(n)]
    rows[3] = record(3, final_answer="\\frac{")  # gold does not parse: left out, listed
    rows[5] = record(5, question=None)  # missing field: counted, listed
    rows[7] = record(7, question="long " * 400)  # prompt over max_prompt_tokens: skipped
    rows[8] = record(8, r1_solution_1=None)  # no worked solution: a prompt, never a scaffold target
    rows[9] = record(9, final_answer="4")  # the same gold as row 2: parsed once
    return rows


def write(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=64)
    return str(path)


def fields(example: data.Example) -> tuple:
    ids = example.solution_ids
    return (
        example.id,
        example.answer,
        example.prompt_ids,
        example.problem,
        example.solution,
        ids if ids is None else tuple(ids),
    )


@pytest.fixture(scope="module")
def qwen_r1():
    return qwen_vocab.r1_tokenizer()


def test_the_store_holds_the_eager_examples_in_the_eager_order_and_reads_back_without_parsing(
    tmp_path, qwen_r1, monkeypatch
):
    # 1500 rows read in parquet batches of 1024 and encoded in chunks of 512: the chunk seams are crossed.
    path = write(tmp_path / "dm.parquet", records(1500))
    config = DataConfig(max_prompt_tokens=256, max_solution_tokens=40, cache_dir=str(tmp_path / "cache"))
    eager, eager_report = data.load_examples(path, qwen_r1, config)
    built, built_report = example_store.load_examples(path, qwen_r1, config, quiet=True)
    # A second run reads the store: no gold answer is parsed and no prompt tokenised again.
    monkeypatch.setattr(rewards, "parse_golds", lambda items: pytest.fail("a stored source was parsed again"))
    monkeypatch.setattr(data, "render_prompts", lambda *a: pytest.fail("a stored prompt was tokenised again"))
    stored, stored_report = example_store.load_examples(path, qwen_r1, config, quiet=True)
    assert (
        isinstance(stored, example_store.StoredExamples) and len(stored) == len(eager) == 1497
    )  # 1500 less a bad gold, a missing field, a long prompt
    assert (eager_report.gold_unparseable, eager_report.prompt_skipped, eager_report.rows_invalid) == (["3"], 1, 1)
    assert stored_report.solutions_encoded == 0  # nothing tokenised until a step asks for a solution
    # The same prompts in the same order per seed, over more than an epoch.
    order = [[ex.id for ex in prompts.ShuffledPrompts(examples, 32, seed=7).next_batch(None, None, None).examples]
             for examples in (eager, stored)]  # fmt: skip
    assert order[0] == order[1]
    for seed in (0, 1):
        take = [prompts.ShuffledPrompts(x, 1000, seed=seed) for x in (eager, built)]
        assert [ex.id for ex in take[0].next_batch(None, None, None).examples] == [
            ex.id for ex in take[1].next_batch(None, None, None).examples
        ]
    assert [fields(e) for e in eager] == [fields(e) for e in stored] == [fields(e) for e in built]
    # Once every solution is tokenised, the reports agree to the count.
    assert dataclasses.asdict(stored_report) == dataclasses.asdict(eager_report)
    assert eager_report.solution_truncated > 0 and eager_report.solution_missing == 1
    assert dataclasses.asdict(built_report) == dataclasses.asdict(eager_report)


def test_a_store_is_keyed_by_the_file_the_tokenizer_and_the_prompt_settings(tmp_path):
    tokenizer, cache = toy.char_tokenizer(), tmp_path / "cache"
    path = tmp_path / "dm.parquet"
    write(path, records(12))
    config = DataConfig(instruction_position="none", cache_dir=str(cache), max_prompt_tokens=64)
    first, _ = example_store.load_examples(str(path), tokenizer, config, quiet=True)
    write(path, records(13))  # the same file name, one row more: a new store, not the stale one
    grown, _ = example_store.load_examples(str(path), tokenizer, config, quiet=True)
    assert len(grown) == len(first) + 1
    longer = dataclasses.replace(config, max_prompt_tokens=4096)  # row 7's long prompt now fits
    assert len(example_store.load_examples(str(path), tokenizer, longer, quiet=True)[0]) == len(grown) + 1
    # The solution's policies apply when a solution is tokenised, so they share the store.
    example_store.load_examples(str(path), tokenizer, dataclasses.replace(longer, max_solution_tokens=9), quiet=True)
    assert len(list(cache.iterdir())) == 3
    assert not any(".partial" in p.name for p in cache.iterdir())  # no build left half written


def test_a_damaged_store_is_rebuilt_with_one_line_and_no_store_is_kept_when_told(tmp_path, capsys):
    tokenizer, cache = toy.char_tokenizer(), tmp_path / "cache"
    path = write(tmp_path / "dm.parquet", records(40))
    config = DataConfig(instruction_position="none", cache_dir=str(cache))
    first = [fields(e) for e in example_store.load_examples(path, tokenizer, config)[0]]
    assert "encoding the prompts" in capsys.readouterr().err
    (store,) = cache.iterdir()  # cut in place: a store still mapped by a run would be lost with the run (SIGBUS)
    with open(store / "examples.arrow", "r+b") as f:
        f.truncate(200)
    again, _ = example_store.load_examples(path, tokenizer, config)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"lspo_jax: the example store {store} is unreadable (") and err[0].endswith(
        "rebuilding it"
    )
    assert [fields(e) for e in again] == first
    memory, _ = example_store.load_examples(path, tokenizer, dataclasses.replace(config, cache_dir=None))
    assert [fields(e) for e in memory] == first
    assert capsys.readouterr().err == "" and len(list(cache.iterdir())) == 1


@pytest.mark.parametrize("name, old, new", [("examples.arrow", b"What is 17+17?", b"What is 97+17?"),
                                            ("report.json", b'"kept": 37', b'"kept": 38')])  # fmt: skip
def test_a_store_changed_in_place_is_found_by_its_digest_and_rebuilt(tmp_path, capsys, name, old, new):
    """The same size, a few bytes changed: before the digest, pyarrow read a changed problem (or gold answer) as
    if it were the data file's, and some changes aborted the process inside pyarrow (std::length_error)."""
    tokenizer, cache = toy.char_tokenizer(), tmp_path / "cache"
    path = write(tmp_path / "dm.parquet", records(40))
    config = DataConfig(instruction_position="none", cache_dir=str(cache))
    first = [fields(e) for e in example_store.load_examples(path, tokenizer, config)[0]]
    capsys.readouterr()
    (store,) = cache.iterdir()
    content = (store / name).read_bytes()
    assert content.count(old) == 1  # the edit below changes exactly one value
    (store / name).write_bytes(content.replace(old, new))
    again, report = example_store.load_examples(path, tokenizer, config)
    (line,) = capsys.readouterr().err.splitlines()[:1]
    assert line == f"lspo_jax: the example store {store} is unreadable (ValueError: its files changed after it was "\
                   "built (their digest differs)); rebuilding it"  # fmt: skip
    assert [fields(e) for e in again] == first and report.kept == 37
    assert (store / name).read_bytes() == content  # rebuilt as it was


def test_a_solution_that_fails_to_tokenise_mid_run_is_counted_and_skipped(tmp_path, monkeypatch):
    tokenizer = toy.char_tokenizer()
    path = write(tmp_path / "dm.parquet", records(20))
    config = DataConfig(instruction_position="none", cache_dir=str(tmp_path / "cache"))
    examples, report = example_store.load_examples(path, tokenizer, config, quiet=True)
    by_id = {ex.id: ex for ex in examples}
    encode = templates.encode_texts

    def fails_on_row_4(tok, texts):
        if texts == [by_id["4"].solution]:
            raise RuntimeError("the tokenizer gave up")
        return encode(tok, texts)

    monkeypatch.setattr(templates, "encode_texts", fails_on_row_4)
    assert by_id["4"].solution_ids is None and by_id["2"].solution_ids is not None
    assert (report.solution_errors, report.solutions_encoded) == (1, 1)
    assert report.row_errors[-1] == "id 4: solution not tokenised (RuntimeError: the tokenizer gave up)"
    assert by_id["4"].solution_ids is None and report.solution_errors == 1  # tried once, remembered
    assert examples[2:3][0] is examples[2] is by_id["2"]  # slices share the built examples
