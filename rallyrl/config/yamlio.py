"""Reading and writing config YAML: YAML 1.2's core schema, duplicate keys refused, no object tags.

Why 1.2: editors (the YAML language server that applies ``rallyrl schema``), JSON and every YAML library
but PyYAML read YAML 1.2, and the schema and the loader must judge the same values. PyYAML reads YAML 1.1,
where ``3e-5`` is a string, ``yes`` / ``no`` / ``on`` / ``off`` are booleans (so ``mixed_precision: no``
was ``False``), ``010`` is 8 and ``1_000`` is 1000. Here ``3e-5`` is a number (what everyone means), and a
plain scalar that YAML 1.1 reads as a boolean or a number while 1.2 reads something else (``yes``,
``1_000``, ``010``, ``1:30``) is an error naming the line and both readings: quietly picking one would
change a reward function's ``kwargs`` or a boolean's meaning without a word.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

_TAG = "tag:yaml.org,2002:"
# The YAML 1.2 core schema's implicit types (https://yaml.org/spec/1.2.2/#1032-tag-resolution).
_CORE = (
    ("bool", "tTfF", r"^(?:true|True|TRUE|false|False|FALSE)$"),
    ("int", "-+0123456789", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
    ("float", "-+.0123456789",
     r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
)
_REPLACED = {_TAG + t for t in ("bool", "int", "float", "timestamp", "value")}


def _core_resolvers() -> dict[Any, list[tuple[str, re.Pattern[str]]]]:
    """PyYAML's resolvers with its YAML 1.1 bool/int/float/timestamp/value ones swapped for 1.2's."""
    out = {k: [(tag, rx) for tag, rx in v if tag not in _REPLACED]
           for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    for name, first, rx in _CORE:
        for ch in first:
            out.setdefault(ch, []).append((_TAG + name, re.compile(rx)))
    return out


def _int12(v: str) -> int:
    """A YAML 1.2 core int: 0o17 is octal, 0x1F hex, 017 decimal (1.1 read it as octal)."""
    return int(v[2:], 8) if v.startswith("0o") else int(v[2:], 16) if v.startswith("0x") else int(v, 10)


def _implicit_tag(resolvers: dict[Any, list[tuple[str, re.Pattern[str]]]], value: str) -> str:
    for tag, rx in resolvers.get(value[:1], []):
        if rx.match(value):
            return tag
    return _TAG + "str"


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, first: int, second: int) -> None:
        super().__init__(f"key {key!r} is given twice (lines {first} and {second}); keep one")
        self.key, self.first, self.second = key, first, second


class _Ambiguous(yaml.YAMLError):
    """A plain scalar that YAML 1.1 and YAML 1.2 read differently (``yes``, ``1_000``, ``010``)."""


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader (plain data only: no tag ever constructs an object) reading YAML 1.2's core
    schema (module doc), plus: a key given twice in one mapping is an error. PyYAML keeps the last value
    silently, so a config with `iterations: 1` and, further down, `iterations: 3` would train 3
    iterations without a word."""

    yaml_implicit_resolvers = _core_resolvers()

    def compose_scalar_node(self, anchor: Any) -> yaml.ScalarNode:
        event = self.peek_event()
        if event.style is None and event.implicit[0]:  # a plain (unquoted) scalar
            _check_unambiguous(event.value, event.start_mark.line + 1)
        return super().compose_scalar_node(anchor)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        return _int12(str(self.construct_scalar(node)))

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


_StrictLoader.add_constructor(_TAG + "int", _StrictLoader.construct_yaml_int)


def _check_unambiguous(value: str, line: int) -> None:
    old = _implicit_tag(yaml.SafeLoader.yaml_implicit_resolvers, value)
    new = _implicit_tag(_StrictLoader.yaml_implicit_resolvers, value)
    if old not in (_TAG + "bool", _TAG + "int", _TAG + "float") or (old == new and old != _TAG + "int"):
        return  # the same reading; or 1.1's text, date or `=`, that 1.2 reads as text or a number everyone means
    was = yaml.safe_load(value)
    if old == new:
        now = _int12(value)  # 010 is 8 in 1.1, 10 in 1.2
        if now == was:
            return
        fix = now  # nobody means octal in a config
    else:
        now, fix = value, str(was).lower() if isinstance(was, bool) else was  # 1.1's boolean or number is 1.2's text
    raise _Ambiguous(f"line {line}: {value} is {was!r} in YAML 1.1 but {now!r} in YAML 1.2 (rallyrl and editors "
                     f"read YAML 1.2): write {fix}, or '{value}' in quotes for the text")


def number_only_in_yaml12(value: str) -> bool:
    """``3e-5``, ``1E6``, ``1.0e5``: text to YAML 1.1, a number to YAML 1.2."""
    return (_implicit_tag(yaml.SafeLoader.yaml_implicit_resolvers, value) == _TAG + "str"
            and _implicit_tag(_StrictLoader.yaml_implicit_resolvers, value) in (_TAG + "int", _TAG + "float"))


def yaml_error_line(e: yaml.YAMLError) -> str:
    """A YAML error as one line: a duplicate key names both lines; a tag names the tag (safe loading never
    constructs objects from tags such as `!!python/object`); a syntax error keeps its line and column."""
    if isinstance(e, (_DuplicateKey, _Ambiguous)):
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
    """Strict YAML 1.2 (see ``_StrictLoader``); raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


class _Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper, which quotes a string that YAML 1.1 would read as something else (``'no'``),
    taught to quote one that YAML 1.2 would (``'1e3'``) too: a written config.yaml reads back the same
    with either."""


for _name, _first, _rx in _CORE:
    for _ch in _first:
        _Dumper.add_implicit_resolver(_TAG + _name, re.compile(_rx), [_ch])


def dump_yaml(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)
