"""What every config field is made of: a default, a one-line doc and, for a bounded number, its range.

The range lives in the field's metadata (``_f(4, "doc", gt=0)``) and nowhere else: ``validate`` reads it
to refuse a value (``ppo.epochs must be > 0, got 0``) and the JSON schema reads it to write
``exclusiveMinimum``, so the two cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import field
from typing import Any, Literal, Union


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or inconsistent."""


# The dtypes a model can be loaded in: the one list (`model.dtype` and reward models read it). Names are
# torch attribute names, so `getattr(torch, name)` gives the dtype without this module importing torch.
DTYPES = ("float32", "bfloat16", "float16")
REFERENCES = ("copy", "shared", "lora")
# `train.report_to`: the experiment trackers rallyrl can log to (rallyrl/trackers.py), besides metrics.jsonl.
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")

# Range keywords a field may carry, with their JSON Schema names. `why` (a reason appended to the error)
# is allowed beside them.
BOUNDS = {"gt": "exclusiveMinimum", "ge": "minimum", "lt": "exclusiveMaximum", "le": "maximum"}


def _f(default: Any, doc: str, **kw: Any) -> Any:
    """A dataclass field with documentation (and optionally a range: ``gt``/``ge``/``lt``/``le``, ``why``;
    ``unsupported``: choices of its type that are always refused, with the reason) attached; mutable
    defaults are copied per instance."""
    unknown = set(kw) - set(BOUNDS) - {"why", "allow_inf", "unsupported"}
    if unknown:  # a typo here would silently drop a range
        raise TypeError(f"unknown field metadata {sorted(unknown)}")
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"doc": doc, **kw})
    return field(default=default, metadata={"doc": doc, **kw})


def bounds(f: dataclasses.Field) -> dict[str, Any]:
    """The range a field declares, e.g. ``{"gt": 0}`` (empty when it has none)."""
    return {k: f.metadata[k] for k in BOUNDS if k in f.metadata}


def range_text(b: dict[str, Any]) -> str:
    """A range as the error message says it: ``> 0``, ``>= 0``, ``in (0, 1]``, or ``0`` for one value."""
    lo = ("(", b["gt"]) if "gt" in b else ("[", b["ge"]) if "ge" in b else None
    hi = (")", b["lt"]) if "lt" in b else ("]", b["le"]) if "le" in b else None
    if lo and hi:
        if lo[1] == hi[1]:
            return f"{lo[1]}"
        return f"in {lo[0]}{lo[1]}, {hi[1]}{hi[0]}"
    if lo:
        return f"{'>' if lo[0] == '(' else '>='} {lo[1]}"
    return f"{'<' if hi[0] == ')' else '<='} {hi[1]}"  # type: ignore[index]


def in_range(v: float, b: dict[str, Any]) -> bool:
    return (("gt" not in b or v > b["gt"]) and ("ge" not in b or v >= b["ge"])
            and ("lt" not in b or v < b["lt"]) and ("le" not in b or v <= b["le"]))


def type_name(tp: Any) -> str:
    """An annotation as the error messages and docs/config.md say it (``int | null``, ``'a' | 'b'``)."""
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return f"list[{type_name(arg)}]"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))
