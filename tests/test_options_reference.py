"""``tools.options_reference``: docs/options.md holds every config key with the code's type, default and meaning
(the docstring under its field), ``--write`` makes it whole from the code and refuses a key with no meaning, and
``--check`` fails, in one line naming the key, once the page and the config part."""

from __future__ import annotations

import dataclasses

import pytest

from lspo_jax.config import LoraConfig
from lspo_jax.job.config import RunConfig
from lspo_jax.train_config import ModelSource
from tools import options_reference as ref


@dataclasses.dataclass(frozen=True)
class DocumentedLora(LoraConfig):
    dropout: float = 0.0
    """The share of the adapter's inputs zeroed while it trains."""


PAGE_TEXT = ref.PAGE.read_text(encoding="utf-8")


def check(page, capsys) -> tuple[int, str]:
    """``--check page``'s exit status and what it printed to stderr."""
    status = ref.main(["--check", str(page)])
    return status, capsys.readouterr().err


def page_with(tmp_path, old: str, new: str):
    """A copy of the shipped page with the one line holding ``old`` replaced by ``new`` (None: removed)."""
    lines = PAGE_TEXT.splitlines(keepends=True)
    (index,) = [i for i, line in enumerate(lines) if old in line]
    lines[index : index + 1] = [] if new is None else [lines[index].replace(old, new)]
    path = tmp_path / "options.md"
    path.write_text("".join(lines), encoding="utf-8")
    return path


def run_config(lora_field=None, lora=None, **top):
    """``RunConfig`` with a field added to ``model.lora`` (``lora_field``: name, type, default, no docstring; or
    ``lora``, a class of its own) and its own fields' defaults changed (``top``), as a new option or a changed
    default would change the code."""
    fields = [(name, type(value), value) for name, value in top.items()]
    if lora_field or lora:
        lora = lora or dataclasses.make_dataclass("Lora", [lora_field], bases=(LoraConfig,), frozen=True)
        model_fields = [("lora", lora, dataclasses.field(default_factory=lora))]
        model = dataclasses.make_dataclass("Model", model_fields, bases=(ModelSource,), frozen=True)
        fields.append(("model", model, dataclasses.field(default_factory=model)))
    return dataclasses.make_dataclass("Run", fields, bases=(RunConfig,), frozen=True)


def test_the_shipped_page_matches_the_code(capsys):
    assert ref.main(["--check", str(ref.PAGE)]) == 0
    assert capsys.readouterr().out == f"{ref.PAGE}: {len(list(ref.walk()))} keys, as in the code\n"


def test_the_walk_reads_nested_sections_with_their_types_and_defaults():
    options = {option.key: option for option in ref.walk()}
    rank = options["model.lora.rank"]
    assert (rank.key, rank.type, rank.default) == ("model.lora.rank", "int", "16")
    assert rank.meaning == "The rank of the low-rank adapter `W + (alpha / rank) * s * B A`."
    assert options["model.lora.targets"].type == "list of str"
    assert options["model.lora.targets"].default == "[q, k, v, o, gate, up, down]"
    assert (options["scaffold.sft.lr"].default, options["optim.lr"].default) == ("2.5e-05", "1.0e-06")
    assert (options["loss.clip_c"].type, options["loss.clip_c"].default) == ("float | null", "null")
    assert options["eval.protocol"].type == "one of deepscaler, deepmath, dapo, lspo, null"
    assert (options["first_mistake.sentence_breaks"].default, options["data.shuffle"].default) == ("''", "true")
    assert options["model.path"].default == "toy"  # TrainConfig's default_factory, ModelSource(path="toy")
    assert "model.lora" not in options and "steps" in options  # a section is walked into, not listed
    # Every key sits under its section's heading, with a meaning.
    assert all(row.section == options[row.key].section for row in ref.parse(PAGE_TEXT, "page"))
    assert options["steps"].meaning == "Training steps of the run."
    # A section class used at a second key reads there as its field's metadata says.
    assert options["model.policy_lora.rank"].meaning.startswith("The rank of LoRA RL's persistent policy adapter")
    assert options["scaffold.sft.b1"].meaning == "The adapter's AdamW first-moment decay."
    assert (options["optim.b1"].meaning, options["scaffold.sft.lr"].meaning) == (
        "AdamW's first-moment decay.", "The adapter's AdamW learning rate (2.5e-5).")  # fmt: skip


@pytest.mark.parametrize(
    "old, new, said",
    [
        ("| `model.lora.rank` |", None, "model.lora.rank: a config key with no row (--write adds it)"),
        ("| `model.lora.rank` | int | `16` |", "| `model.lora.rank` | int | `8` |",
         "model.lora.rank: default '8' on line"),
        ("| `seed` | int |", "| `seed` | float |", "seed: type 'float' on line"),
        ("Training steps of the run.", "Steps.", "steps: the meaning on line"),
        ("| `steps` |", "| `stepz` |", "stepz: line"),  # stale, named before steps, which now has no row
        ("| `steps` | int | `1500` |", "| `steps` | int | 1500 |", "differs from the page --write makes"),
    ],
)  # fmt: skip
def test_a_page_that_parted_from_the_code_fails_in_one_line_naming_the_key(tmp_path, capsys, old, new, said):
    status, err = check(page_with(tmp_path, old, new), capsys)
    assert status == 2 and err.count("\n") == 1 and said in err, err


def test_a_new_field_or_a_changed_default_in_the_code_fails_the_shipped_page(monkeypatch, capsys):
    monkeypatch.setattr(ref, "ROOT", run_config(lora=DocumentedLora))
    status, err = check(ref.PAGE, capsys)
    assert status == 2 and "model.lora.dropout: a config key with no row" in err
    monkeypatch.setattr(ref, "ROOT", run_config(steps=10))
    status, err = check(ref.PAGE, capsys)
    assert status == 2 and "steps: default '1500' on line" in err and "'10' in the code" in err


def test_write_makes_the_whole_page_from_the_code(tmp_path, monkeypatch, capsys):
    page = page_with(tmp_path, "| `model.lora.rank` |", None)
    page.write_text(page.read_text(encoding="utf-8").replace("Training steps of the run.", "Steps."))
    assert ref.main(["--write", str(page)]) == 0 and page.read_text(encoding="utf-8") == PAGE_TEXT
    monkeypatch.setattr(ref, "ROOT", run_config(lora=DocumentedLora))
    assert ref.main(["--write", str(page)]) == 0
    written = page.read_text(encoding="utf-8")
    row = "| `model.lora.dropout` | float | `0.0` | The share of the adapter's inputs zeroed while it trains. |"
    assert row in written and "| `model.lora.rank` | int | `16` |" in written
    assert ref.main(["--check", str(page)]) == 0


def test_a_field_without_a_docstring_is_refused(tmp_path, monkeypatch, capsys):
    """A key with no meaning is never written: ``--write`` leaves the page as it was, ``--check`` fails, and both
    name the field whose docstring is missing."""
    page = tmp_path / "options.md"
    page.write_text(PAGE_TEXT, encoding="utf-8")
    monkeypatch.setattr(ref, "ROOT", run_config(lora_field=("dropout", float, 0.0)))
    for mode in ("--write", "--check"):
        assert ref.main([mode, str(page)]) == 2
        err = capsys.readouterr().err
        assert (
            err.count("\n") == 1
            and "model.lora.dropout: no meaning; write it in a docstring under the field dropout of Lora" in err
        ), err
    assert page.read_text(encoding="utf-8") == PAGE_TEXT
