"""Strict loading: a YAML file (``yamlio``), dotted ``--set`` overrides, type coercion and the dataclass
tree, with every unknown key and wrong type a ``ConfigError`` naming the dotted key.

Strictness is the point (style rule 4): an unknown key, or a value of the wrong type, is a
``ConfigError`` naming the dotted key (with a "did you mean" suggestion) and it is raised before any
model is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal, Union

import yaml

from .fields import ConfigError, type_name
from .root import Config
from .suggest import did_you_mean
from .validate import validate
from .yamlio import load_yaml, number_only_in_yaml12, yaml_error_line

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
        if dataclasses.is_dataclass(arg) and isinstance(value, dict):  # an optional section: its own key's error
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
    # 2.0 is 2: JSON (so the JSON schema and editors) cannot tell them apart, and YAML writes 1e3 as a float
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}{_as_text(value)}")
    return value


def _float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}{_as_text(value)}")
    return float(value)


def _as_text(value: Any) -> str:
    """Why a number arrived as text: YAML 1.1 (PyYAML's ``yaml.safe_load``) reads ``3e-5`` as a string."""
    if isinstance(value, str) and number_only_in_yaml12(value):
        return (f" (a string: YAML 1.1, e.g. PyYAML's yaml.safe_load, reads {value} as text; rallyrl reads YAML "
                f"1.2, where it is a number: pass the file's path, or load it with rallyrl.config.load_yaml)")
    return ""


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
            raise ConfigError(f"--set {k}: value {v!r} is not valid YAML: {yaml_error_line(e)}") from None
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
        raise ConfigError(f"config file {path} is not valid YAML: {yaml_error_line(e)}") from None
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
