"""A JSON Schema (draft 2020-12) of the whole config, generated from the dataclasses in ``rallyrl.config``.

``rallyrl schema`` prints it. Types come from the type hints, descriptions from each field's ``doc``,
defaults from the dataclasses, and ranges from each field's metadata (``fields._f(..., gt=0)``), the same
declaration ``validate`` reads, so the two cannot disagree about a bound. Checks across fields
(``reward.url`` with ``reward.fn``, ``model.sharding: fsdp`` with ``model.reference``, the batch plan) are
left to ``rallyrl check``. The loader stays the authority: the schema is for editors (completion, hover
docs, inline errors) and for tools that validate a YAML file before it reaches rallyrl.

Point an editor at it with a first line ``# yaml-language-server: $schema=<path or URL>`` (docs/config.md).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from typing import Any, Literal, Union

from .fields import BOUNDS
from .root import Config

DRAFT = "https://json-schema.org/draft/2020-12/schema"

# Strings and lists the validator bounds, and keys it requires.
CONSTRAINTS: dict[str, dict[str, Any]] = {
    "generation.stop_sequences": {"items": {"minLength": 1}},
    "reward.fns[].fn": {"minLength": 1},
    "reward.url": {"minItems": 1},  # (minItems only binds the list arm of `str | list[str]`)
    "model.lora.target_modules": {"minItems": 1},
}
REQUIRED = {"reward.fns[]": ["fn"], "reward.overlong_buffer": ["length"]}


def _type(tp: Any, key: str) -> dict[str, Any]:
    """The schema of one annotation (``key``: the dotted key, for ``CONSTRAINTS`` and nested sections)."""
    if tp is Any:
        return {}
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        arms = [_type(a, key) for a in typing.get_args(tp)]
        if all(set(a) == {"type"} for a in arms):  # plain types: one "type" list (int | null)
            return {"type": [t for a in arms for t in (a["type"] if isinstance(a["type"], list) else [a["type"]])]}
        return {"anyOf": arms}
    if origin is Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        items = _type(arg, key + "[]")
        return {"type": "array", "items": items} if items else {"type": "array"}
    if origin is dict or tp is dict:
        return {"type": "object"}
    if dataclasses.is_dataclass(tp):
        return _object(tp, key)
    if tp is type(None):
        return {"type": "null"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    raise TypeError(f"no schema for the config annotation {tp!r} at {key}")  # a bug in this module


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    value = f.default_factory()  # type: ignore[misc]
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def _bounded(schema: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` merged into ``schema`` (into the array's items for ``items``; into every arm of a union,
    where keywords for another type are ignored anyway)."""
    if "anyOf" in schema:
        return {"anyOf": [_bounded(a, extra) if a.get("type") != "null" else a for a in schema["anyOf"]]}
    out = dict(schema)
    for k, v in extra.items():
        out[k] = {**out.get(k, {}), **v} if k == "items" else v
    return out


def _object(cls: type, prefix: str) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    props = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        s = _type(hints[f.name], key)
        rng = {BOUNDS[k]: f.metadata[k] for k in BOUNDS if k in f.metadata}  # the field's range (fields._f)
        s = _bounded(s, {**rng, **CONSTRAINTS.get(key, {})})
        if "enum" in s and f.metadata.get("unsupported"):  # choices the validator always refuses (fp16)
            s["enum"] = [c for c in s["enum"] if c not in f.metadata["unsupported"]]
        if f.metadata.get("doc"):
            s["description"] = f.metadata["doc"]
        if prefix and f.name not in REQUIRED.get(prefix, ()):  # (a section's default: its fields' defaults)
            s["default"] = _default(f)
        props[f.name] = s
    out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if prefix in REQUIRED:
        out["required"] = REQUIRED[prefix]
    return out


def config_schema() -> dict[str, Any]:
    """The JSON Schema of a rallyrl YAML config (every section, key, type, default, range and doc)."""
    from ..version import __version__

    root = _object(Config, "")
    for name, s in root["properties"].items():
        s["description"] = f"`{name}` settings (docs/config.md)."
    return {"$schema": DRAFT, "title": f"rallyrl {__version__} config",
            "description": "A rallyrl training config (rallyrl train CONFIG). Generated by `rallyrl schema` from "
                           "rallyrl/config/.", **root}


def main(args: Any = None) -> int:
    json.dump(config_schema(), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


def add_parser(subparsers: Any) -> Any:
    return subparsers.add_parser(
        "schema", help="print the JSON Schema of the config (for editors: completion and inline errors)",
        description="Print the JSON Schema (draft 2020-12) of a rallyrl YAML config: every key with its type, "
                    "choices, default, range and documentation. Save it and add '# yaml-language-server: "
                    "$schema=rallyrl-config.schema.json' as a config's first line (docs/config.md).")
