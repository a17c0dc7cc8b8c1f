"""Data as the user has it: columns named in ``data.fields``, the row's other columns carried on each example, a
system prompt, the three prompt templates as docs/getting-started.md shows them, and the one-line messages on
prompts that are too long and on a source without worked solutions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from run_fixtures import K, one_line, rule_of, run_steps, train_records, write_jsonl

from lspo_jax import options
from lspo_jax.job import cli
from lspo_jax.job.config_io import from_dict, load_config, to_dict
from lspo_jax.tasks import data, data_report, example_store, toy
from lspo_jax.tasks.templates import TEMPLATES, prompt_text, render_prompt, render_prompts, render_texts
from lspo_jax.train_config import ConfigError, DataConfig, DataFields, TrainConfig
from tools import qwen_vocab

DOC = Path(__file__).resolve().parents[1] / "docs" / "getting-started.md"
# Qwen2-7B-Instruct's published chat template (its tokenizer_config.json), which renders a system turn.
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def documented() -> tuple[dict, dict, dict[str, str]]:
    """The 'Your own data' section of the docs: its example row, its ``data`` config and, per template, the
    rendered prompt it shows (a block's text up to its last line break)."""
    section = DOC.read_text(encoding="utf-8").split("\n## Your own data\n", 1)[1].split("\n## ", 1)[0]
    row = json.loads(re.search(r"```json\n(.*?)\n```", section, re.S).group(1))
    config = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))["data"]
    blocks = re.findall(r"`template: (\w+)`.*?\n```text\n(.*?)```", section, re.S)
    return row, config, {name: block[:-1] for name, block in blocks}


@pytest.fixture(scope="module")
def qwen():
    """The real Qwen2 vocabulary with R1-Distill's tokens (BOS <｜begin▁of▁sentence｜>) and Qwen2-Instruct's ChatML
    tokens and chat template."""
    tokenizer = qwen_vocab.r1_tokenizer()
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tokenizer.chat_template = QWEN2_CHAT_TEMPLATE
    return tokenizer


def user_file(tmp_path, row: dict) -> str:
    """The documented row, one more with a list column, and one without its gold answer."""
    rows = [row, {"uid": "p-8", "question": "What is 4+4?", "gold": 8, "worked": "\\boxed{8}", "test_cases": [1, 2]},
            {"uid": "p-9", "question": "What is 1+1?", "worked": "\\boxed{2}"}]  # fmt: skip
    return write_jsonl(tmp_path / "mine.jsonl", rows)


def test_a_file_in_its_own_columns_loads_through_data_fields_with_its_other_columns(tmp_path, qwen):
    row, section, _ = documented()
    path = user_file(tmp_path, row)
    config = from_dict(DataConfig, {**section, "train": path, "template": "tokenizer",
                                    "cache_dir": str(tmp_path / "cache")}, "data.")  # fmt: skip
    eager, report = data.load_examples(path, qwen, config)
    stored, _ = example_store.load_examples(path, qwen, config, quiet=True)
    for examples in (eager, stored):
        got = [(ex.id, ex.answer, ex.problem, ex.solution, ex.fields) for ex in examples]
        assert got == [("p-7", "5", "What is 2+3?", row["worked"], {"difficulty": 1}),
                       ("p-8", "8", "What is 4+4?", "\\boxed{8}", {"test_cases": [1, 2]})]  # fmt: skip
    assert report.row_errors == ["line 3 (id p-9): missing gold"] and report.rows_invalid == 1
    # The prompt is what transformers renders for a system turn and a user turn, encoded.
    messages = [{"role": "system", "content": section["system_prompt"]},
                {"role": "user", "content": prompt_text("What is 2+3?", config)}]  # fmt: skip
    rendered = qwen.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert eager[0].prompt_ids == stored[0].prompt_ids == tuple(qwen.encode(rendered, add_special_tokens=False))
    # The settings are the store's key: another system prompt is another store, never the stale one.
    other = from_dict(DataConfig, {**to_dict(config), "system_prompt": "Be brief."}, "data.")
    assert example_store.store_key(path, qwen, other, None) != example_store.store_key(path, qwen, config, None)


def test_the_documented_renderings_are_what_each_template_renders(qwen):
    row, section, shown = documented()
    assert set(shown) == set(options.choices(options.PromptTemplate)) == set(TEMPLATES)
    for template, text in shown.items():
        config = from_dict(DataConfig, {**section, "template": template}, "data.")
        assert render_texts(qwen, [prompt_text(row["question"], config)], config) == [text], template
    # The same two by hand; R1's marks and BOS are one token each, and the prompt ends by opening the thought.
    ask = "What is 2+3?\nPlease reason step by step, and put your final answer within \\boxed{}."
    r1 = f"<｜begin▁of▁sentence｜>You are a careful mathematician.<｜User｜>{ask}<｜Assistant｜><think>\n"
    assert shown["r1"] == r1 and shown["plain"] == f"<｜begin▁of▁sentence｜>You are a careful mathematician.\n{ask}"
    ids = render_prompt(qwen, ask, DataConfig(system_prompt="You are a careful mathematician.", template="r1"))
    assert ids[0] == 151646 and ids.count(151644) == 1 and ids[-3:] == [151645, 151648, 198]
    plain = render_prompt(qwen, ask, DataConfig(template="plain"))  # no system prompt: BOS and the text
    assert plain == [151646, *qwen.encode(ask, add_special_tokens=False)]


def test_a_template_that_cannot_render_the_prompt_is_one_line(qwen, monkeypatch):
    with pytest.raises(data_report.DataError, match=r"^data\.template: r1 needs the tokens <｜begin▁of▁sentence｜>, "):
        render_prompts(toy.char_tokenizer(), ["1+1="], DataConfig(template="r1"))
    r1 = qwen  # with R1-Distill's template, cut to one user turn: it drops a system turn
    monkeypatch.setattr(r1, "chat_template", qwen_vocab.R1_CHAT_TEMPLATE)
    with pytest.raises(
        data_report.DataError, match=r"^data\.system_prompt: the tokenizer's chat template leaves the sys"
    ):
        render_prompts(r1, ["1+1="], DataConfig(system_prompt="Be brief."))
    # ``r1`` renders as R1's own template, and puts a system prompt right after BOS.
    assert render_texts(r1, ["x"], DataConfig(template="r1")) == render_texts(r1, ["x"], DataConfig())
    assert render_texts(r1, ["x"], DataConfig(system_prompt="Be brief.", template="r1")) == [
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>x<｜Assistant｜><think>\n"]  # fmt: skip
    # The generated tasks keep their own format whatever is set.
    tokenizer, config = toy.char_tokenizer(), DataConfig(system_prompt="Be brief.", template="plain")
    examples, _ = data.load_examples("toy:heldout", tokenizer, config)
    assert examples[0].prompt_ids == data.load_examples("toy:heldout", tokenizer, DataConfig())[0][0].prompt_ids


@pytest.mark.parametrize(
    "override, said",
    [
        ("data.fields.probem=q", "data.fields.probem: unknown role; known: ['answer', 'id', 'problem', 'solution']"),
        ("data.fields={problem: q, answer: q}", "data.fields.answer: is also data.fields.problem's column"),
        ("data.fields.id=' '", "data.fields.id: must name a column or be null, got ' '"),
        ("data.fields.problem=[a]", "data.fields.problem: expected str, got ['a']"),
        ("data.template=chatml", "data.template: must be one of ('tokenizer', 'r1', 'plain'), got 'chatml'"),
        ("data.system_prompt=''", "data.system_prompt: must be text or null, got ''"),
    ],
)  # fmt: skip
def test_bad_data_keys_are_one_line_naming_the_key(override, said):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).startswith(said) and "\n" not in str(err.value), err.value


def test_data_fields_reads_as_a_mapping_and_writes_one_back():
    run = load_config(None, ["data.fields={answer: gold, problem: question}", "data.system_prompt=Be brief."])
    assert (run.data.fields.problem, run.data.fields.answer, run.data.fields.solution) == ("question", "gold", None)
    written = to_dict(run)["data"]
    assert written["fields"] == {"problem": "question", "answer": "gold", "solution": None, "id": None}
    assert from_dict(TrainConfig, yaml.safe_load(yaml.safe_dump(to_dict(run)))) == run and hash(run.data)


def test_prompts_too_long_name_the_limit_the_longest_and_the_key(tmp_path):
    tokenizer = toy.char_tokenizer()
    rows = [{"id": str(i), "problem": "1" * (20 + i), "answer": "1"} for i in range(3)]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    config = DataConfig(instruction_position="none", max_prompt_tokens=16, cache_dir=None)
    examples, report = example_store.load_examples(path, tokenizer, config)
    # The longest: BOS and 22 digits. None kept: the run stops with this line alone.
    said = ("3 of 3 prompts are longer than data.max_prompt_tokens=16 (the longest 23 tokens, with the template and "
            "instruction); raise data.max_prompt_tokens or set data.prompt_policy: truncate")  # fmt: skip
    assert not examples and report.too_long() == said and said in report.losses()
    with pytest.raises(data_report.DataError, match=f"^data.train {re.escape(path)}: {re.escape(said)}$"):
        report.check_kept(f"data.train {path}")
    _, report = data.load_examples(path, tokenizer, DataConfig(instruction_position="none", max_prompt_tokens=22,
                                                               prompt_policy="truncate"))  # fmt: skip
    assert report.too_long() == ("1 of 3 prompts are longer than data.max_prompt_tokens=22 (the longest 23 tokens, "
                                 "with the template and instruction), cut to their last 22 tokens; raise "
                                 "data.max_prompt_tokens to keep them whole")  # fmt: skip


def test_a_source_without_worked_solutions_is_told_the_scaffold_cannot_rescue_it(tmp_path):
    tokenizer = toy.char_tokenizer()
    path = write_jsonl(tmp_path / "bare.jsonl", [{"uid": "a", "q": "1+1=", "gold": "2"}])
    fields = DataFields(problem="q", answer="gold", solution="worked", id="uid")
    config = DataConfig(instruction_position="none", fields=fields, cache_dir=None)
    examples, report = example_store.load_examples(path, tokenizer, config)
    assert [ex.id for ex in examples] == ["a"] and report.solution_missing == 1
    assert report.warnings() == [
        "no row has a worked solution (column 'worked'): cliffs cannot be rescued, as the LSPO scaffold learns from "
        "worked solutions, so the run behaves as DAPO on them; name the column in data.fields.solution"
    ]
    assert report.warnings(scaffold=False) == []  # DAPO needs none


def test_two_steps_on_a_file_in_its_own_columns_and_a_file_that_keeps_none(tmp_path, make_config, capsys):
    rows = toy.addition_rows(8, (2, 2), seed=0)
    mine = [{"uid": f"u{r['id']}", "q": r["problem"], "gold": r["answer"], "worked": r["solution"], "digits": 2}
            for r in rows]  # fmt: skip
    path = write_jsonl(tmp_path / "mine.jsonl", mine)
    fields = {"problem": "q", "answer": "gold", "solution": "worked", "id": "uid"}
    job = run_steps(make_config(data__train=path, data__fields=fields), str(tmp_path / "run"), rule_of(set()))
    assert [ex.id for ex in job.examples[:K]] == [m["uid"] for m in mine[:K]]
    assert job.examples[0].fields == {"digits": 2} and job.data_report.kept == 8 and job.state.step == 2
    # Every group fails: the scaffold fits each cliff's adapter on its worked solution, read from ``worked``.
    records = train_records(str(tmp_path / "run"))
    assert [(r["cliff_groups"], r["scaffold_attempted"], r["scaffold_no_solution"]) for r in records] == [(2, 2, 0)] * 2
    # A file none of whose prompts fits stops the command with the line that says why (exit 2).
    long = write_jsonl(tmp_path / "long.jsonl", [{**m, "q": "1+" * 20 + "1="} for m in mine])
    argv = ["--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "r2")]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(to_dict(make_config(data__train=long, data__fields=fields))))
    assert cli.train_main(argv) == 2
    assert f"lspo-train: data.train {long}: 8 of 8 prompts are longer than data.max_prompt_tokens=16" in one_line(
        capsys, "lspo-train"
    )
