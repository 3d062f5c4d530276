"""Strict loading: YAML (duplicate keys refused), dotted ``--set`` overrides, type coercion and the
dataclass tree, with every unknown key and wrong type a ``ConfigError`` naming the dotted key.

Strictness is the point (style rule 4): an unknown key, or a value of the wrong type, is a
``ConfigError`` naming the dotted key (with a "did you mean" suggestion) and it is raised before any
model is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal, Union

import yaml

from .fields import ConfigError, type_name
from .root import Config
from .suggest import did_you_mean
from .validate import validate

_FLOAT_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)$")


def _expected(tp: Any, key: str, value: Any) -> ConfigError:
    return ConfigError(f"{key}: expected {type_name(tp)}, got {type(value).__name__} {value!r}")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints are accepted for floats)."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return _coerce_union(value, tp, key)
    if origin is Literal:
        return _coerce_choice(value, tp, key)
    if origin is list:
        if not isinstance(value, list):
            raise _expected(tp, key, value)
        (arg,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, arg, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        return _build(tp, value, key)
    if tp not in _SCALARS:
        raise TypeError(f"unsupported config annotation {tp!r} at {key}")  # a bug in this package
    return _SCALARS[tp](value, key)


def _coerce_union(value: Any, tp: Any, key: str) -> Any:
    errors = []
    for arg in typing.get_args(tp):
        try:
            return _coerce(value, arg, key)
        except ConfigError as e:
            errors.append((arg, e))
    for arg, e in errors:  # a choice (or a list of choices) says which one was misspelled
        arm = typing.get_args(arg)[0] if typing.get_origin(arg) is list and isinstance(value, list) else arg
        if typing.get_origin(arm) is Literal and (arm is not arg or isinstance(value, str)):
            raise e from None
    raise _expected(tp, key, value)


def _coerce_choice(value: Any, tp: Any, key: str) -> Any:
    allowed = typing.get_args(tp)
    if value not in allowed:
        hint = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(f"{key}: expected one of {list(allowed)}, got {value!r}{extra}")
    return value


def _null(value: Any, key: str) -> None:
    if value is not None:
        raise ConfigError(f"{key}: expected null, got {value!r}")
    return None


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true/false, got {type(value).__name__} {value!r}")
    return value


def _int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
    return value


def _float(value: Any, key: str) -> float:
    if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
        # YAML 1.1 (PyYAML) reads "3e-4" as a string; every user means the number.
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
    return float(value)


def _str(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
    return value


_SCALARS: dict[Any, Callable[[Any, str], Any]] = {
    type(None): _null, bool: _bool, int: _int, float: _float, str: _str,
}


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in fields:
            raise ConfigError(f"unknown config key {key!r}{did_you_mean(str(k), cls, prefix, Config)}")
        kwargs[k] = _coerce(v, hints[k], key)
        _check_finite(kwargs[k], key, allow_inf=fields[k].metadata.get("allow_inf", False))
    return cls(**kwargs)


def _check_finite(value: Any, key: str, allow_inf: bool) -> None:
    """NaN passes every `> 0` check and inf every `>= 0` one: refuse both where a number is read, unless
    the field documents infinity (metadata ``allow_inf``). Free-form mappings (``kwargs``) are the
    user's own and not checked."""
    if isinstance(value, float):
        if math.isnan(value) or (math.isinf(value) and not allow_inf):
            raise ConfigError(f"{key}: must be a finite number, got {value}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_finite(v, f"{key}[{i}]", allow_inf)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {dotted}: {p!r} is not a section")
        node = nxt
    node[parts[-1]] = value


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader (plain data only: no tag ever constructs an object), plus: a key given twice in
    one mapping is an error. PyYAML keeps the last value silently, so a config with `iterations: 1` and,
    further down, `iterations: 3` would train 3 iterations without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` merges are allowed to override
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKey(key, seen[key], line)
                seen[key] = line
            except TypeError:  # an unhashable key (a list): the base class reports it
                continue
        return super().construct_mapping(node, deep=deep)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, first: int, second: int) -> None:
        super().__init__(f"key {key!r} is given twice (lines {first} and {second}); keep one")
        self.key, self.first, self.second = key, first, second


def _yaml_error_line(e: yaml.YAMLError) -> str:
    """A YAML error as one line: a duplicate key names both lines; a tag names the tag (safe loading never
    constructs objects from tags such as `!!python/object`); a syntax error keeps its line and column."""
    if isinstance(e, _DuplicateKey):
        return str(e)
    if isinstance(e, yaml.constructor.ConstructorError) and e.problem and "constructor for the tag" in e.problem:
        tag = e.problem.split("tag", 1)[1].strip(" '")
        where = f"line {e.problem_mark.line + 1}: " if e.problem_mark else ""
        return (f"{where}the YAML tag {tag.replace('tag:yaml.org,2002:', '!!')!r} is not allowed (configs are "
                f"plain data: mappings, lists, strings, numbers, booleans, null)")
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        what = "; ".join(x for x in (e.context, e.problem) if x)
        return f"line {mark.line + 1}, column {mark.column + 1}: {what}" if mark else what
    return " ".join(str(e).split())


def load_yaml(text: str) -> Any:
    """Strict YAML (see ``_StrictLoader``); raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """``["ppo.lr=3e-4", "data.prompts=[a, b]"]`` -> dotted keys with YAML-parsed values."""
    out = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        try:
            parsed = load_yaml(v) if v != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {k}: value {v!r} is not valid YAML: {_yaml_error_line(e)}") from None
        out.append((k.strip(), parsed))
    return out


def load_config(source: Config | dict | str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build a validated ``Config`` from a Config, a dict, or a YAML path, plus ``key=value`` overrides."""
    if isinstance(source, Config):
        data = source.to_dict()
    elif isinstance(source, dict):
        data = dict(source)
    elif source is None:
        data = {}
    else:
        data = _read_config_file(Path(source))
    data = _to_plain(data)
    for k, v in parse_overrides(overrides or []):
        _set_dotted(data, k, v)
    cfg = _build(Config, data, "")
    validate(cfg)
    return cfg


def _read_config_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = load_yaml(read_text(path, "config file"))
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_error_line(e)}") from None
    data = {} if data is None else data  # an empty file: every default
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections (model:, train:, ...) at the "
                          f"top level, not a {type(data).__name__}")
    return data


def read_text(path: str | Path, what: str, error: type[Exception] = ConfigError) -> str:
    """A user's text file, read as UTF-8 (a byte-order mark is accepted and dropped). Bad bytes are an
    ``error`` (default ``ConfigError``) naming the file, the byte offset and the fix."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise error(
            f"{what} {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
            f"save it as UTF-8"
        ) from None


def _to_plain(data: Any) -> Any:
    """Deep-copy nested dicts/lists (so overrides never mutate the caller's dict)."""
    if isinstance(data, dict):
        return {k: _to_plain(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_to_plain(v) for v in data]
    return data
