"""Tools: JSON schemas from Python signatures, tool-call parsers, and ``ToolEnv``.

A tool is a plain Python function, sync or ``async``. Its name, signature and docstring give the JSON
schema the chat template renders (``apply_chat_template(messages, tools=[schema, ...])``, the
transformers convention): the first paragraph of the docstring is the description, a Google-style
``Args:`` section describes the parameters, the annotations give their types and a parameter without a
default is required. Unlike ``transformers.utils.get_json_schema`` a missing description is allowed
(the schema then has none) rather than an error.

A parser turns an assistant message into the tool calls it makes (``parse(text) -> [ToolCall]``, empty
when the message calls no tool): ``hermes`` (Hermes / Qwen: ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``, any number per message) and ``llama3_json`` (the whole message is one JSON object
``{"name": ..., "parameters" | "arguments": {...}}``, or a list of them), or any callable of that shape.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

from .protocol import Step, ToolCallRecord
from .runner import call_tool

# ------------------------------------------------------------------------------------------------
# Schemas

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array",
               tuple: "array", type(None): "null"}


def _type_schema(tp: Any, where: str) -> dict[str, Any]:
    """The JSON schema of one annotation (``{}`` for ``Any`` / no annotation: any value)."""
    if tp is Any or tp is inspect.Parameter.empty:
        return {}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        kinds = sorted({_JSON_TYPES[type(a)] for a in args})
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
    if origin in (Union, types.UnionType):
        parts = [_type_schema(a, where) for a in args]
        if all(set(p) == {"type"} and isinstance(p["type"], str) for p in parts):
            return {"type": [p["type"] for p in parts]}  # `int | None` -> ["integer", "null"], as transformers
        return {"anyOf": parts}
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        out: dict[str, Any] = {"type": "array"}
        if args and args[0] is not Ellipsis:
            out["items"] = _type_schema(args[0], where)
        return out
    if origin is dict or tp is dict:
        return {"type": "object"}
    if tp in _JSON_TYPES:
        return {"type": _JSON_TYPES[tp]}
    raise TypeError(f"{where}: cannot express the annotation {tp!r} as a JSON schema type (use str, int, float, "
                    f"bool, list[...], dict, Literal[...] or an optional of one)")


def _docstring(fn: Callable) -> tuple[str, dict[str, str]]:
    """The description (first paragraph) and the ``Args:`` entries of a Google-style docstring."""
    doc = inspect.getdoc(fn) or ""
    paragraphs = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)
    description = " ".join(paragraphs[0].split()) if doc.strip() else ""
    if re.match(r"(Args|Arguments|Parameters|Returns?):", description):
        description = ""
    args: dict[str, str] = {}
    m = re.search(r"^(?:Args|Arguments|Parameters):\s*\n(.*?)(?=^\S|\Z)", doc, re.S | re.M)
    if m:
        current = None
        for line in m.group(1).splitlines():
            entry = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?\s*:\s*(.*)", line)
            if entry and (current is None or len(line) - len(line.lstrip()) <= indent):
                current, indent = entry.group(1), len(line) - len(line.lstrip())
                args[current] = entry.group(2).strip()
            elif current is not None and line.strip():
                args[current] = f"{args[current]} {line.strip()}".strip()
    return description, args


def tool_name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def tool_schema(fn: Callable) -> dict[str, Any]:
    """``{"type": "function", "function": {"name", "description", "parameters"}}`` of a Python function."""
    name = tool_name(fn)
    where = f"tool {name!r}"
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable forward references: use the raw annotations
        hints = {}
    description, arg_docs = _docstring(fn)
    props: dict[str, Any] = {}
    required = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"{where}: *args / **kwargs cannot be described in a JSON schema; name every parameter")
        schema = _type_schema(hints.get(p.name, p.annotation), f"{where}, parameter {p.name!r}")
        if p.name in arg_docs and arg_docs[p.name]:
            schema["description"] = arg_docs[p.name]
        props[p.name] = schema
        if p.default is p.empty:
            required.append(p.name)
    params: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        params["required"] = required
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = params
    return {"type": "function", "function": function}


# ------------------------------------------------------------------------------------------------
# Parsers


@dataclass
class ToolCall:
    """A tool call found in an assistant message; ``error`` when it could not be read (the model is told)."""

    name: str
    arguments: Any
    error: str | None = None


def _call_of(obj: Any, raw: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", raw, 'a tool call must be a JSON object with a string "name" and an "arguments" object')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return ToolCall(obj["name"], args, f'the "arguments" of a call to {obj["name"]!r} must be a JSON object')
    return ToolCall(obj["name"], args)


_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.S)


def parse_hermes(text: str) -> list[ToolCall]:
    """Hermes / Qwen tool calls: ``<tool_call>{json}</tool_call>``, any number in one message. A call
    left open (the turn ran out of tokens) or whose JSON does not parse is returned with an error."""
    calls = []
    for m in _HERMES.finditer(text):
        body = m.group(1).strip()
        if not m.group(2):
            calls.append(ToolCall("", body, "the <tool_call> is not closed with </tool_call>"))
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", body, f"the tool call is not valid JSON ({e.msg} at character {e.pos})"))
            continue
        calls.append(_call_of(obj, body))
    return calls


def parse_llama3_json(text: str) -> list[ToolCall]:
    """Llama-3-style JSON tool calls: the whole message is ``{"name": ..., "parameters": {...}}`` (or a list
    of such objects). A message that is not such JSON is an answer, not a tool call."""
    body = text.strip()
    if not body.startswith(("{", "[")):
        return []
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return []
    objs = obj if isinstance(obj, list) else [obj]
    if not all(isinstance(o, dict) and "name" in o for o in objs):
        return []
    return [_call_of(o, json.dumps(o)) for o in objs]


PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


# ------------------------------------------------------------------------------------------------
# ToolEnv


def _result_text(out: Any) -> str:
    if isinstance(out, str):
        return out
    try:
        return json.dumps(out)
    except TypeError:
        return str(out)


class ToolEnv:
    """An environment that runs the tool calls of each assistant turn and answers with their results.

    Each turn: the parser reads the assistant message; no tool call -> the episode is done (the model
    answered); otherwise every call runs (concurrently, each within ``env.tool_timeout_s``, at most
    ``env.max_concurrent_tools`` at once per process) and each result becomes a ``tool`` message
    ``{"role": "tool", "name": ..., "content": result}``. A call to an unknown tool, with arguments that do
    not fit the function's signature, or that does not parse is the MODEL's mistake: the model is told
    (``Error: ...``) and the episode goes on. A tool that raises or times out is the TOOL's failure:
    an error message to the model too (``env.on_tool_error: message``), or the run stops on every rank
    (``fail``). Subclass it to add a reward (override ``step`` and call ``super().step``) or observations
    (``reset``).

    ``tools``: functions or import paths (``module:attr`` / ``file.py:attr``) of functions. ``parser``:
    ``hermes``, ``llama3_json`` or a callable ``text -> [ToolCall]``.
    """

    def __init__(self, tools: Sequence[Callable | str], parser: str | Callable[[str], list[ToolCall]] = "hermes"):
        from ...reward.loading import load_callable

        self.tools = [load_callable(t, "env.kwargs.tools") if isinstance(t, str) else t for t in tools]
        self._by_name = {tool_name(f): f for f in self.tools}
        if len(self._by_name) != len(self.tools):
            raise ValueError(f"ToolEnv: two tools share a name: {[tool_name(f) for f in self.tools]}")
        if isinstance(parser, str):
            if parser not in PARSERS:
                raise ValueError(f"ToolEnv: unknown parser {parser!r}; one of {sorted(PARSERS)} or a callable")
            parser = PARSERS[parser]
        self.parser = parser

    def reset(self, record: dict[str, Any]) -> list[dict[str, Any]] | None:
        return None

    async def step(self, message: dict[str, Any]) -> Step:
        calls = self.parser(message["content"])
        if not calls:
            return Step([], True)
        records = await asyncio.gather(*(self._run(c) for c in calls))
        return Step([{"role": "tool", "name": r.name, "content": r.result} for r in records], False, None,
                    list(records))

    async def _run(self, call: ToolCall) -> ToolCallRecord:
        def mistake(why: str) -> ToolCallRecord:
            return ToolCallRecord(call.name, call.arguments, f"Error: {why}", why)

        if call.error:
            return mistake(call.error)
        fn = self._by_name.get(call.name)
        if fn is None:
            return mistake(f"there is no tool {call.name!r}; the tools are {', '.join(sorted(self._by_name))}")
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            return mistake(f"bad arguments for {call.name!r}: {e}")
        out, error = await call_tool(call.name, fn, call.arguments)
        if error is not None:
            return ToolCallRecord(call.name, call.arguments, f"Error: {error}", error)
        return ToolCallRecord(call.name, call.arguments, _result_text(out))
