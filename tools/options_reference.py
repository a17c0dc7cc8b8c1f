"""Every config key of a training run in one reference, docs/options.md, written whole from the code.

.venv/bin/python -m tools.options_reference --check docs/options.md   # exit 2, one line, when the page has drifted
.venv/bin/python -m tools.options_reference --write docs/options.md   # rewrite it from the code

The keys, types and defaults come from walking ``job.config.RunConfig`` (its sections, and theirs: ``model.lora``,
``scaffold.sft``); each key's meaning is the docstring right under its field in the section's class body (read with
``ast``; a subclass's own docstring wins). A section class used at a second key (``LoraConfig`` as
``model.policy_lora``) reads there as the ``meanings`` in that field's metadata say. A key with no meaning is an
error, at ``--write`` and ``--check`` alike. With neither option the page is printed.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from lspo_jax.job.config import RunConfig
from lspo_jax.train_config import ConfigError

if not __package__:  # run by its path: the repository root, where the package ``tools`` is, is not on sys.path
    sys.exit("tools/options_reference.py: run it from the repository root as python -m tools.options_reference ...")
from tools import run_main  # noqa: E402

ROOT = RunConfig  # the config walked; the tests put a class with one more field here
PAGE = Path(__file__).resolve().parents[1] / "docs" / "options.md"
TOP = "top level"  # the heading of the config's own keys (``steps``, ``seed``), which have no section
HEADER = ("key", "type", "default", "meaning")
INTRO = """\
# Options

Every key of a training run's config, by its dotted name: what a YAML file (`lspo-train --config FILE`) or an
override (`lspo-train ... rollout.group_size=8`) sets. A file names only what differs from these defaults; `null` is
YAML's None. A file may start from another: `base_config: other.yaml` (relative to the file) reads that one first
and lays this file's keys over it, section by section. Each section is a frozen dataclass, named under its heading,
whose docstring says more. The whole page is written from the code, each meaning from the docstring under its
key's field (`python -m tools.options_reference --write docs/options.md`); `--check` fails when the page and the
code differ."""


@dataclasses.dataclass(frozen=True)
class Option:
    """One leaf of the config: its dotted key, its type and its default as a YAML file writes them, its meaning (None:
    its field has no docstring) and where that is written (``where``: the field and its class)."""

    key: str
    type: str
    default: str
    meaning: str | None = None
    where: str = ""

    @property
    def section(self) -> str:
        return self.key.split(".")[0] if "." in self.key else TOP


def walk(cls: type | None = None, value: Any = None, prefix: str = "", meanings: Any = None) -> Iterator[Option]:
    """The leaves of the dataclass ``cls`` (``ROOT``), in declaration order, a section's keys within it. A section
    is walked by its annotation, as the YAML reader reads it; the defaults are those of ``cls()``, so a section's
    ``default_factory`` (``TrainConfig.model``'s ``ModelSource(path="toy")``) gives its keys' values. ``meanings``
    (the section field's metadata) say what the keys mean here, before the docstrings under the fields."""
    cls = ROOT if cls is None else cls
    value = cls() if value is None else value
    hints, meanings = typing.get_type_hints(cls), meanings or {}
    for field in dataclasses.fields(cls):
        hint, current = hints[field.name], getattr(value, field.name)
        if dataclasses.is_dataclass(hint):
            yield from walk(hint, current, f"{prefix}{field.name}.", field.metadata.get("meanings"))
            continue
        meaning = meanings.get(field.name) or next(filter(None, (docs(c).get(field.name) for c in cls.__mro__)), None)
        where = f"the field {field.name} of {cls.__name__} ({cls.__module__})"
        yield Option(f"{prefix}{field.name}", type_name(hint), yaml_value(current), meaning, where)


@functools.cache
def docs(cls: type) -> dict[str, str]:
    """The docstring right under each field of the class body of ``cls``, on one line (a class with no source, made
    at run time, has none)."""
    try:
        (body,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    except (OSError, TypeError):
        return {}
    found = {}
    for field, doc in zip(body.body, body.body[1:], strict=False):
        if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and _is_text(doc):
            found[field.target.id] = " ".join(doc.value.value.split())
    return found


def _is_text(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def type_name(hint: Any) -> str:
    """``hint`` as a user reads it: ``int``, ``float | null``, ``one of a, b, c`` (a ``Literal``; ``null`` among
    its values when it may be null), ``list of str`` (a tuple)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        present = [arg for arg in args if arg is not type(None)]
        nullable = len(present) < len(args)
        if nullable and len(present) == 1 and typing.get_origin(present[0]) is typing.Literal:
            return f"{type_name(present[0])}, null"
        return " | ".join([type_name(arg) for arg in present] + (["null"] if nullable else []))
    if origin is typing.Literal:
        return "one of " + ", ".join(str(arg) for arg in args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"list of {type_name(args[0])}"
    if hint in (int, float, str, bool):
        return hint.__name__
    if dataclasses.is_dataclass(hint):  # an entry of a list (``reward.functions``): its keys, its class says more
        return "{" + ", ".join(field.name for field in dataclasses.fields(hint)) + "}"
    # A new kind of annotation is the tool's to learn, not the page's to guess: a bug, with its traceback.
    raise TypeError(f"options_reference: no reading for the annotation {hint!r}")


def yaml_value(value: Any) -> str:
    """``value`` as YAML writes it on one line: ``null``, ``true``, ``1.0e-06``, ``toy``, ``[q, k, v]``, ``''``."""
    plain = list(value) if isinstance(value, tuple) else value
    text = yaml.safe_dump(plain, default_flow_style=True, width=1 << 20, allow_unicode=True).strip()
    return text.removesuffix("\n...").strip()


# ------------------------------------------------------------------------------------------ the page
def cell(text: str) -> str:
    return text.replace("|", "\\|")


def code(text: str) -> str:
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def row(option: Option) -> str:
    return f"| {code(option.key)} | {cell(option.type)} | {code(cell(option.default))} | {cell(option.meaning)} |"


def heading(section: str) -> list[str]:
    """A section's heading and the line naming its classes (the dataclasses whose docstrings say more)."""
    cls = ROOT if section == TOP else typing.get_type_hints(ROOT)[section]
    named = [f"`{cls.__name__}` (`{cls.__module__}`)"]
    if section != TOP:
        named += [
            f"`{key}`: `{inner.__name__}` (`{inner.__module__}`)" for key, inner in sections_in(cls, f"{section}.")
        ]
    return [f"## {section}", "", "; ".join(named) + "."]


def sections_in(cls: type, prefix: str) -> Iterator[tuple[str, type]]:
    """The dataclass sections inside ``cls`` (``model.lora``), by dotted key, deepest last."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hint := hints[field.name]):
            yield f"{prefix}{field.name}", hint
            yield from sections_in(hint, f"{prefix}{field.name}.")


def undocumented(options: list[Option]) -> list[str]:
    """One line for each key whose field has no docstring, naming where to write it."""
    return [f"{o.key}: no meaning; write it in a docstring under {o.where}" for o in options if not o.meaning]


def render(options: list[Option]) -> str:
    """The page: ``INTRO``, then one table per section in the config's order, the config's own keys last; a key
    with no meaning is a ``ConfigError`` naming where to write it."""
    if missing := undocumented(options):
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(missing[0] + more)
    sections: dict[str, list[Option]] = {}
    for option in options:
        sections.setdefault(option.section, []).append(option)
    if TOP in sections:
        sections[TOP] = sections.pop(TOP)
    lines = [INTRO]
    for section, members in sections.items():
        lines += ["", *heading(section), "", "| " + " | ".join(HEADER) + " |", "|---|---|---|---|"]
        lines += [row(option) for option in members]
    return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class Row:
    """A table row of the page as written: its line, the section it sits under, and its four cells as written
    (pipes still escaped, the key without its backticks)."""

    line: int
    section: str
    key: str
    type: str
    default: str
    meaning: str


_UNESCAPED_PIPE = re.compile(r"(?<!\\)\|")
_RULE = re.compile(r":?-+:?")


def parse(text: str, where: str) -> list[Row]:
    """The rows of the page's tables, header and rule rows left out; a row without four cells is an error."""
    rows, section = [], ""
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("## "):
            section = stripped[3:].strip()
        if not stripped.startswith("|"):
            continue
        cells = [c.strip() for c in _UNESCAPED_PIPE.split(stripped.strip("|"))]
        if len(cells) != len(HEADER):
            raise ConfigError(f"{where}: line {number}: a row has {len(cells)} cells, not {len(HEADER)} ({line!r})")
        if tuple(c.lower() for c in cells) == HEADER or all(_RULE.fullmatch(c) for c in cells):
            continue
        key = cells[0].strip("`").strip()
        rows.append(Row(number, section, key, cells[1].replace("\\|", "|"), cells[2], cells[3]))
    return rows


def problems(text: str, where: str, options: list[Option]) -> list[str]:
    """What the page ``text`` says that the code does not, key by key (the code's keys without a meaning first),
    then any other difference from the page that ``--write`` makes of it (its layout, the order of the rows)."""
    rows, found = parse(text, where), undocumented(options)
    by_key: dict[str, Row] = {}
    for r in rows:
        if r.key in by_key:
            found.append(f"{r.key}: documented twice (lines {by_key[r.key].line} and {r.line}); keep one")
        by_key.setdefault(r.key, r)
    code_keys = {option.key for option in options}
    # A stale row first: beside a key with no row it is most often that key, renamed.
    found += [f"{r.key}: line {r.line} names no config key (stale: --write drops it)" for r in rows
              if r.key not in code_keys]  # fmt: skip
    for option in options:
        r = by_key.get(option.key)
        if r is None:
            found.append(f"{option.key}: a config key with no row (--write adds it)")
            continue
        if r.type != option.type:
            found.append(f"{option.key}: type '{r.type}' on line {r.line}, '{option.type}' in the code")
        default = r.default.strip("`").strip()  # the backticks are layout, which the last check below reads
        if default != cell(option.default):
            found.append(f"{option.key}: default '{default}' on line {r.line}, '{cell(option.default)}' in the code")
        if r.section != option.section:
            found.append(f"{option.key}: under '## {r.section}' on line {r.line}, belongs under '## {option.section}'")
        if option.meaning and r.meaning != cell(option.meaning):
            found.append(f"{option.key}: the meaning on line {r.line} is not the docstring under {option.where}")
    if found:
        return found
    made, have = render(options).splitlines(), text.splitlines()
    if made != have:
        first = next((i for i, (a, b) in enumerate(zip(made, have, strict=False)) if a != b), min(len(made), len(have)))
        found.append(f"line {first + 1} differs from the page --write makes")
    return found


def check(path: Path, options: list[Option] | None = None) -> None:
    """A ``ConfigError`` naming the first problem of the page at ``path`` (and how many more there are)."""
    options = list(walk()) if options is None else options
    found = problems(path.read_text(encoding="utf-8"), str(path), options)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ConfigError(f"{path}: {found[0]}{more}")


def write(path: Path, options: list[Option] | None = None) -> None:
    """Write the page at ``path`` from the code; a ``ConfigError`` (nothing written) while a key has no meaning."""
    text = render(list(walk()) if options is None else options)
    path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    return run_main("options_reference", _main, argv)


def _main(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", metavar="PAGE", type=Path, help="exit 2 naming the first key the page has wrong")
    mode.add_argument("--write", metavar="PAGE", type=Path, help="write the page from the code")
    args = p.parse_args(argv)
    if args.check:
        check(args.check)
        print(f"{args.check}: {len(list(walk()))} keys, as in the code")
    elif args.write:
        write(args.write)
        print(f"{args.write}: written, {len(list(walk()))} keys")
    else:
        print(render(list(walk())), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
