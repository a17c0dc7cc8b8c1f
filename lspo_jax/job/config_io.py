"""A run's config read from YAML with dotted overrides: strict, each error naming the dotted key.

A YAML file only serialises a config (``train_config.TrainConfig``, the run's ``job.config.RunConfig``). Reading is
strict: an unknown key, a key given twice, a value of the wrong type or a float that is not finite is an error that
names the dotted key (``rollout.group_size: expected int, got 'sixteen'``). ``to_dict`` writes a config back to the
nested dict that ``from_dict`` reads to an equal one.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from lspo_jax import options
from lspo_jax.options import ConfigError, FieldError, require
from lspo_jax.train_config import EvalConfig, TrainConfig


def _renamed(cls: type, data: dict[str, Any], where: str) -> dict[str, Any]:
    """``data`` with the keys of an earlier version that section ``cls`` names in its ``RENAMED`` (old -> new; a
    run's own config.yaml, resumed, may hold them) under their new names; the old and the new one together is an
    error."""
    for old, new in getattr(cls, "RENAMED", {}).items():
        if old in data:
            require(new not in data, f"{where}{old}", f"renamed {where}{new}, which is also given; keep one")
            data = {(new if key == old else key): value for key, value in data.items()}
    return data


def from_dict(cls: type, data: Any, where: str = "") -> Any:
    """Build dataclass ``cls`` from a nested dict, checking every key and type; errors name the key."""
    require(isinstance(data, dict), where.rstrip(".") or "config", f"expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    data = _renamed(cls, data, where)
    unknown = sorted(set(data) - set(fields))
    noun = getattr(cls, "KEY_NAME", "key")
    require(not unknown, f"{where}{unknown[0]}" if unknown else where, f"unknown {noun}; known: {sorted(fields)}")
    values = {name: _coerce(hints[name], value, f"{where}{name}") for name, value in data.items()}
    try:
        return cls(**values)
    except ConfigError:
        raise
    except FieldError as err:  # said at the dotted key the user typed
        raise ConfigError(err.at(f"{where}{err.name}")) from err
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{where.rstrip('.') or cls.__name__}: {err}") from err


def _coerce(hint: Any, value: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``hint`` (YAML's int is accepted for float)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: expected {hint}, got {value!r}")
    if origin is typing.Literal:
        return value  # an option: checked once, by its section's ``options.check``, which names the key
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, f"{key}.")
    if origin is tuple:
        require(isinstance(value, list | tuple), key, f"expected a list, got {value!r}")
        return tuple(_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if hint is float:
        return _finite_float(value, key)
    ok = isinstance(value, hint) and not (hint is int and isinstance(value, bool))
    require(ok, key, f"expected {hint.__name__}, got {value!r}")
    return value


def _finite_float(value: Any, key: str) -> float:
    """``value`` as a float (YAML's int, and a string Python reads as a number: YAML 1.1 reads 1e-3, no dot, as a
    string), refused unless finite. Every float field of every section is read here, so this one check covers them:
    an inf passes each "must be positive", and a nan where no check reads the field (``reward.overlong_factor``)
    makes every update non-finite and skipped, in a run that still exits 0."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    elif isinstance(value, int) and not isinstance(value, bool):
        number = float(value)
    require(isinstance(number, float), key, f"expected float, got {value!r}")
    require(math.isfinite(number), key, "must be finite", number)
    return number


def to_dict(config: Any) -> dict[str, Any]:
    """The nested dict that ``from_dict`` reads back to an equal config (tuples become lists)."""

    def plain(x: Any) -> Any:
        if isinstance(x, tuple | list):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    return plain(dataclasses.asdict(config))


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``dotted.key=value`` strings (value parsed as YAML) to a nested dict, returning a new dict."""
    data = to_plain_copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        require(bool(sep) and bool(key), item, "an override is written dotted.key=value")
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
            require(isinstance(node, dict), key, f"{part!r} is not a section")
        node[leaf] = yaml.safe_load(raw)
    return data


def to_plain_copy(data: dict[str, Any]) -> dict[str, Any]:
    return {k: to_plain_copy(v) if isinstance(v, dict) else v for k, v in data.items()}


def load_config(path: str | Path | None, overrides: list[str] = (), cls: type = TrainConfig) -> Any:
    """Read a YAML file (or the defaults when ``path`` is None), apply overrides, check everything, into ``cls``:
    the core sections here; a run's whole config, the methods' sections included, is ``job.config.load_config``'s.

    A file may start from another: ``base_config: other.yaml`` (relative to the file) reads that one first and
    lays this file's keys over it, section by section (a recipe for another chip names only what differs)."""
    data = {} if path is None else _read_yaml(Path(path), ())
    merged = apply_overrides(data, list(overrides))
    return from_dict(cls, _with_eval_protocol(merged, apply_overrides({}, list(overrides))))


def _with_eval_protocol(data: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``data`` with ``eval.protocol``'s settings (``options.EvalProtocol.KEYS``) in each of its ``eval`` keys not
    named, and with ``eval.ks`` the ``default_ks`` of the resulting n unless named. A protocol sits just below
    the layer that names it: named by an override (``top``: the overrides alone), it fills every key the
    overrides do not name, the file's included (a resumed run's config.yaml names them all); named in the file,
    only the keys the file and the overrides leave out. Either way the result names every key the protocol sets, so
    a config.yaml written from it reads back to the same config."""
    section, top_section = data.get("eval"), top.get("eval")
    if not isinstance(section, dict) or section.get("protocol") is None:
        return data
    protocol = options.eval_protocol(section["protocol"])
    named = top_section if isinstance(top_section, dict) and "protocol" in top_section else section
    filled = {**section, **{key: value for key, value in protocol.settings().items() if key not in named}}
    if "ks" not in named and isinstance(filled.get("n"), int):  # a bad n is said by from_dict, at its key
        filled["ks"] = EvalConfig.default_ks(filled["n"])
    return {**data, "eval": filled}


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping, naming its dotted path and both lines.

    PyYAML keeps the last of two, silently: a second ``rollout:`` block would replace the first whole. The
    constructor builds a nested mapping after its parent (or inside it, deep), so each mapping's dotted path is
    noted on its child nodes before they are built."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._paths: dict[yaml.Node, str] = {}

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        where, lines = self._paths.get(node, ""), {}
        for key_node, value_node in node.value:
            # ``<<: *anchor`` lays keys in, not a key given twice; a list or mapping as a key SafeLoader refuses itself.
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key, line = self.construct_object(key_node), key_node.start_mark.line + 1
            if key in lines:
                raise ConfigError(f"{where}{key} appears twice (lines {lines[key]} and {line})")
            lines[key] = line
            self._name(value_node, f"{where}{key}")
        return super().construct_mapping(node, deep=deep)

    def _name(self, node: yaml.Node, dotted: str) -> None:
        """Note ``dotted`` as the path of ``node``, or of each mapping in the list ``node`` (``key[i]``)."""
        if isinstance(node, yaml.MappingNode):
            self._paths.setdefault(node, f"{dotted}.")
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._name(item, f"{dotted}[{i}]")


def _load_yaml(text: str) -> Any:
    loader = _UniqueKeyLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _read_yaml(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    try:
        data = _load_yaml(path.read_text(encoding="utf-8"))
    except ConfigError as err:  # a key given twice: said at the file
        raise ConfigError(f"{path}: {err}") from None
    except FileNotFoundError as err:
        raise ConfigError(f"config file not found: {path}") from err
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); a config is a YAML file") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if data is None or data == {}:  # the defaults alone are the paper's shape: an empty file is a mistake
        raise ConfigError(f"{path}: holds no settings (the defaults alone are the paper's 1.5B shape); name at "
                          "least model.path, or start from configs/demo.yaml")  # fmt: skip
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must map section names to settings, got a {type(data).__name__}")
    base = data.pop("base_config", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base_config: must be a file name, got {base!r}")
    base_path = path.parent / base
    if base_path.resolve() in seen:
        raise ConfigError(f"{path}: base_config: {base} is already being read (a cycle)")
    return _laid_over(_read_yaml(base_path, (*seen, path.resolve())), data)


def _laid_over(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``top``'s keys laid over it, mappings merged key by key."""
    merged = dict(base)
    for key, value in top.items():
        below = merged.get(key)
        merged[key] = _laid_over(below, value) if isinstance(below, dict) and isinstance(value, dict) else value
    return merged
