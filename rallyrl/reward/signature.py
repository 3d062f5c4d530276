"""How a reward function is called: trlx's signature or TRL's, read from its parameters at start.

- ``trlx`` (rallyrl's own, and trlx's): ``fn(samples, prompts, outputs, **kwargs)``, the three lists passed
  positionally; the keywords are ``output_token_ids``, ``tokenizer`` and every data column.
- ``trl`` (TRL's ``GRPOTrainer``): everything by keyword, ``fn(prompts=, completions=, completion_ids=,
  **columns)``. For a conversational prompt, ``prompts[i]`` is its list of messages and ``completions[i]``
  is ``[{"role": "assistant", "content": output}]``; for a plain prompt both are strings (TRL decides this
  for the whole batch from its first prompt; rallyrl sample by sample, which is the same for a set that
  holds one kind). TRL's ``trainer_state``, ``log_extra``, ``log_metric`` and ``environments`` are not
  passed: a parameter that needs one without a default is refused at start.

``auto`` (``reward.signature``, the default) reads each function's parameter names: ``completions`` or
``completion_ids`` mean TRL; ``samples`` or ``outputs`` mean trlx; both is ambiguous, and so is a first
parameter ``prompts`` with neither (trlx would put the samples there). A function of ``**kwargs`` only can
only be called by keyword (TRL); anything else is trlx, as before. The same function is checked against
the data's columns (``check_columns``): a column named like an argument rallyrl passes would be a second
value for it (``TypeError: got multiple values``) or be replaced (``tokenizer``), so it is refused with
the column's name and the fix, before any model loads.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any

from ..config import ConfigError

# The keyword that carries a conversational prompt's messages (rallyrl.data.MESSAGES_KEY; not imported
# from there: this module stays free of numpy for `rallyrl serve-reward`).
MESSAGES_KEY = "prompt_messages"
SIGNATURES = ("auto", "trlx", "trl")
# What rallyrl passes itself, per signature: a data column of one of these names would collide.
PASSED = {"trlx": ("samples", "prompts", "outputs", "output_token_ids", "tokenizer"),
          "trl": ("prompts", "completions", "completion_ids")}
_TRL_ONLY, _TRLX_ONLY = ("completions", "completion_ids"), ("samples", "outputs")
# Arguments TRL's trainer passes that rallyrl has no counterpart for.
_TRL_EXTRAS = {"trainer_state": "TRL's trainer state", "log_extra": "TRL's completions-table logger",
               "log_metric": "TRL's metric logger", "environments": "TRL's environment instances"}
_FIX = "set reward.signature: trl or trlx (or rename the parameter)"


class RewardSignatureError(ConfigError):
    """A reward function cannot be called with the chosen (or detected) signature, or a data column
    collides with an argument rallyrl passes it: a config error, found before any model loads."""


def _parameters(fn: Any) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or an extension callable: nothing to read
        return None


def _positional(params: Sequence[inspect.Parameter]) -> list[inspect.Parameter]:
    return [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _has(params: Sequence[inspect.Parameter], kind: Any) -> bool:
    return any(p.kind is kind for p in params)


def _keyword_names(params: Sequence[inspect.Parameter]) -> set[str]:
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def detect_signature(fn: Any, name: str, requested: str = "auto") -> str:
    """``"trlx"`` or ``"trl"`` for reward function ``name``: ``requested`` when it is not ``auto`` (checked
    to be callable that way), else read from its parameters. Raises ``RewardSignatureError`` naming the
    function, the parameter and the fix."""
    if requested not in SIGNATURES:
        raise RewardSignatureError(f"reward.signature must be one of {', '.join(SIGNATURES)}, got {requested!r}")
    params = _parameters(fn)
    if params is None:
        return "trlx" if requested == "auto" else requested
    style = requested if requested != "auto" else _detect(params, name)
    _check_callable(params, name, style)
    return style


def _detect(params: list[inspect.Parameter], name: str) -> str:
    names = _keyword_names(params)
    trl, trlx = [n for n in _TRL_ONLY if n in names], [n for n in _TRLX_ONLY if n in names]
    if trl and trlx:
        raise RewardSignatureError(
            f"reward function {name!r} has parameters of both signatures: {', '.join(trlx)} (trlx: fn(samples, "
            f"prompts, outputs, **kwargs)) and {', '.join(trl)} (TRL: fn(prompts=, completions=, completion_ids=, "
            f"**kwargs)); {_FIX}")
    if trl:
        return "trl"
    if trlx:
        return "trlx"
    positional = _positional(params)
    if positional and positional[0].name == "prompts":
        raise RewardSignatureError(
            f"reward function {name!r}: its first parameter is 'prompts', which TRL fills with the prompts "
            f"but trlx, called positionally, with the samples (prompt + output); {_FIX}")
    if not positional and not _has(params, inspect.Parameter.VAR_POSITIONAL) and _has(
            params, inspect.Parameter.VAR_KEYWORD):
        return "trl"  # keywords only: it cannot take trlx's three positional lists
    return "trlx"


def _check_callable(params: list[inspect.Parameter], name: str, style: str) -> None:
    positional = _positional(params)
    if style == "trlx":
        if len(positional) < 3 and not _has(params, inspect.Parameter.VAR_POSITIONAL):
            got = ", ".join(p.name for p in positional) or "none"
            raise RewardSignatureError(
                f"reward function {name!r} is called with the trlx signature, fn(samples, prompts, outputs, "
                f"**kwargs), but takes {len(positional)} positional parameter(s) ({got}); add the missing ones "
                f"(or *args), or, if it is written for TRL, set reward.signature: trl")
        extra = [p.name for p in positional[3:] if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    else:
        extra = [p.name for p in positional if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if extra:
        raise RewardSignatureError(
            f"reward function {name!r}: parameter {extra[0]!r} is positional-only and has no default, and the "
            f"{style} signature has no value for it; give it a default or make it a keyword parameter")


def passed_names(style: str) -> tuple[str, ...]:
    """The arguments rallyrl passes a function of this signature (a data column may not be named so)."""
    return PASSED[style]


def check_columns(fn: Any, name: str, style: str, columns: Iterable[str], where: str,
                  chat: bool = True, what: str = "reward function") -> None:
    """Refuse, before any model loads, what would fail (or silently go wrong) at the first reward call:
    a data column named like an argument rallyrl passes (``where`` names the data: ``data.prompts``), a
    trlx function's positional parameter that is also a column, and a required parameter that neither
    the signature nor a column fills. ``chat``: whether the set holds conversations (a plain set's own
    ``prompt_messages`` column would be read as a conversation by the TRL signature)."""
    columns = list(dict.fromkeys(columns))
    reserved = passed_names(style) + (() if chat or style == "trlx" else (MESSAGES_KEY,))
    for col in columns:
        if col in reserved:
            raise RewardSignatureError(
                f"{where}: data column {col!r} has the name of an argument rallyrl passes to {what} "
                f"{name!r} ({style} signature: {', '.join(passed_names(style))}), so the function would get it "
                f"twice or not at all; rename the column (if it holds the prompts, set data.prompt_column: {col})")
    params = _parameters(fn)
    if params is None:
        return
    filled = set(columns) | set(passed_names(style))
    if style == "trlx":
        positional = [p.name for p in _positional(params)[:3]]
        for col in columns:
            if col in positional:
                raise RewardSignatureError(
                    f"{where}: data column {col!r} is also {what} {name!r}'s positional parameter "
                    f"{col!r}, which the trlx signature fills with "
                    f"{('samples', 'prompts', 'outputs')[positional.index(col)]}; if the function is written for "
                    f"TRL (keywords: prompts, completions, completion_ids, columns), set reward.signature: trl, "
                    f"else rename the column or the parameter")
        filled |= set(positional)
    _check_required(params, f"{what} {name!r}", style, filled, columns, where)


def _check_required(params: list[inspect.Parameter], who: str, style: str, filled: set[str],
                    columns: list[str], where: str) -> None:
    for p in params:
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or p.default is not p.empty or p.name in filled:
            continue
        if p.name in _TRL_EXTRAS:
            raise RewardSignatureError(
                f"{who} requires {p.name!r} ({_TRL_EXTRAS[p.name]}), which rallyrl does not "
                f"pass; give the parameter a default (None)")
        have = ", ".join(columns) or "none"
        raise RewardSignatureError(
            f"{where}: {who} ({style} signature) requires the argument {p.name!r}, which is neither an "
            f"argument rallyrl passes ({', '.join(passed_names(style))}) nor a data column (its columns: "
            f"{have}); name the column so, or give the parameter a default")


def call_arguments(fn: Any, style: str, samples: Any, tokenizer: Any) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` of one call of ``fn`` on ``samples`` (a ``Samples``) with the given signature.
    A function without ``**kwargs`` gets only the keywords it names (a data column it does not take
    would otherwise be a TypeError)."""
    if style == "trl":
        args: tuple = ()
        kwargs = trl_kwargs(samples)
    else:
        args = ([p + o for p, o in zip(samples.prompts, samples.outputs)], samples.prompts, samples.outputs)
        kwargs = trlx_kwargs(samples, tokenizer)
    params = _parameters(fn)
    if params is not None and not _has(params, inspect.Parameter.VAR_KEYWORD):
        names = _keyword_names(params)
        if style == "trlx":
            names -= {p.name for p in _positional(params)[:3]}
        kwargs = {k: v for k, v in kwargs.items() if k in names}
    return args, kwargs


def _columns(metadata: Sequence[dict[str, Any]]) -> dict[str, None]:
    cols: dict[str, None] = {}
    for m in metadata:
        cols.update(dict.fromkeys(m))
    return cols


def _refuse_collisions(cols: Iterable[str], style: str) -> None:
    """The start-time column check, again per call: for callers that had no data to check at start
    (a reward server, ``RewardStep`` used directly)."""
    hit = [c for c in cols if c in PASSED[style]]
    if hit:
        raise RewardSignatureError(
            f"metadata column {hit[0]!r} has the name of an argument rallyrl passes to a {style}-signature reward "
            f"function ({', '.join(PASSED[style])}); rename the column")


def trlx_kwargs(samples: Any, tokenizer: Any) -> dict[str, Any]:
    """trlx's keyword arguments: every metadata column as a per-sample list (None where a sample lacks
    it), plus ``output_token_ids`` and ``tokenizer``."""
    cols = _columns(samples.metadata)
    _refuse_collisions(cols, "trlx")
    kwargs: dict[str, Any] = {c: [m.get(c) for m in samples.metadata] for c in cols}
    kwargs["output_token_ids"] = samples.output_token_ids
    kwargs["tokenizer"] = tokenizer
    return kwargs


def trl_kwargs(samples: Any) -> dict[str, Any]:
    """TRL's keyword arguments: ``prompts`` (a conversation's messages, else the text), ``completions``
    (``[{"role": "assistant", "content": output}]`` after a conversation, else the text),
    ``completion_ids`` and every data column (rallyrl's ``prompt_messages`` is in ``prompts``)."""
    msgs = [m.get(MESSAGES_KEY) for m in samples.metadata]
    cols = [c for c in _columns(samples.metadata) if c != MESSAGES_KEY]
    _refuse_collisions(cols, "trl")
    kwargs: dict[str, Any] = {c: [m.get(c) for m in samples.metadata] for c in cols}
    kwargs["prompts"] = [mm if isinstance(mm, list) else p for mm, p in zip(msgs, samples.prompts)]
    kwargs["completions"] = [[{"role": "assistant", "content": o}] if isinstance(mm, list) else o
                             for mm, o in zip(msgs, samples.outputs)]
    kwargs["completion_ids"] = samples.output_token_ids
    return kwargs


def check_run(fns: Sequence[Any], sets: Sequence[tuple[str, list[str], bool]], metric_fn: Any = None,
              metric_set: tuple[str, list[str], bool] | None = None) -> None:
    """``check_columns`` for every reward function (``NamedRewardFn`` with its signature) against every
    prompt set it scores (``(where, columns, chat)``: training and eval prompts), and for the metric
    function (trlx signature) against the one set it sees (``metric_set``: the eval prompts)."""
    for where, columns, chat in sets:
        for nf in fns:
            check_columns(nf.fn, nf.name, nf.signature or detect_signature(nf.fn, nf.name), columns, where, chat)
    if metric_fn is not None and metric_set is not None:
        where, columns, chat = metric_set
        check_columns(metric_fn, "eval.metric_fn", "trlx", columns, where, chat, what="the metric function")
