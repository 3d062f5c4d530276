"""The reward server's wire rules, as pure functions (every rule is tested without a server): request
bodies -> ``Samples`` (``POST /score``, rallyrl's protocol; ``POST /get_reward``, OpenRLHF's), the body
size limit, the bearer token. A request that breaks a rule raises ``BadRequest`` naming the field; the
app (``server.py``) answers it with that status (4xx), never a 500.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Sequence
from typing import Any

from .samples import Samples

TOKEN_ENV = "RALLYRL_REWARD_TOKEN"


class BadRequest(ValueError):
    """A request that does not follow the protocol; ``field`` names what is wrong."""

    def __init__(self, field: str, message: str, status: int = 422) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.status = field, status


def _str_list(body: dict[str, Any], key: str, n: int | None) -> list[str]:
    v = body.get(key)
    if not isinstance(v, list):
        raise BadRequest(key, f"expected a list of strings, got {type(v).__name__}")
    for i, x in enumerate(v):
        if not isinstance(x, str):
            raise BadRequest(f"{key}[{i}]", f"expected a string, got {type(x).__name__}")
    if n is not None and len(v) != n:
        raise BadRequest(key, f"has {len(v)} items but samples has {n}")
    return v


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest("body", f"not valid JSON: {e}", 400) from None
    except RecursionError:
        raise BadRequest("body", "JSON nested too deeply", 400) from None
    if not isinstance(body, dict):
        raise BadRequest("body", f"expected a JSON object, got {type(body).__name__}")
    return body


def _known_keys(body: dict[str, Any], allowed: Sequence[str]) -> None:
    extra = sorted(set(body) - set(allowed))
    if extra:
        raise BadRequest(extra[0], f"unknown field (allowed: {', '.join(allowed)})")


def parse_score_request(raw: bytes) -> Samples:
    """A ``POST /score`` body -> ``Samples`` (``samples[i]`` must equal ``prompts[i] + outputs[i]``)."""
    body = _json_object(raw)
    _known_keys(body, ("samples", "prompts", "outputs", "metadata", "output_token_ids"))
    if "samples" not in body:
        raise BadRequest("samples", "required")
    samples = _str_list(body, "samples", None)
    n = len(samples)
    prompts = _str_list(body, "prompts", n)
    outputs = _str_list(body, "outputs", n)
    for i, (s, p, o) in enumerate(zip(samples, prompts, outputs)):
        if s != p + o:
            raise BadRequest(f"samples[{i}]", "must equal prompts[i] + outputs[i]")
    meta = body.get("metadata", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise BadRequest("metadata", f"expected an object of per-sample lists, got {type(meta).__name__}")
    for col, vals in meta.items():
        if col in ("output_token_ids", "tokenizer"):
            raise BadRequest(f"metadata.{col}", "is a reserved keyword argument name")
        if not isinstance(vals, list):
            raise BadRequest(f"metadata.{col}", f"expected a list with one value per sample, got {type(vals).__name__}")
        if len(vals) != n:
            raise BadRequest(f"metadata.{col}", f"has {len(vals)} values but samples has {n}")
    ids = body.get("output_token_ids")
    if ids is None:
        token_ids: list[list[int]] | None = None
    else:
        if not isinstance(ids, list) or len(ids) != n:
            got = f"{len(ids)} items" if isinstance(ids, list) else type(ids).__name__
            raise BadRequest("output_token_ids", f"expected one list of ints per sample ({n}), got {got}")
        for i, row in enumerate(ids):
            if not isinstance(row, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in row):
                raise BadRequest(f"output_token_ids[{i}]", "expected a list of integers")
        token_ids = ids
    metadata = [{c: meta[c][i] for c in meta} for i in range(n)]
    return _samples(prompts, outputs, token_ids, metadata)


def parse_openrlhf_request(raw: bytes) -> Samples:
    """A ``POST /get_reward`` body (OpenRLHF: ``query`` = prompt + response, optional ``prompts`` and
    ``labels``) -> ``Samples``; ``labels`` reaches the reward function as the ``labels`` keyword."""
    body = _json_object(raw)
    _known_keys(body, ("query", "prompts", "labels"))
    if "query" not in body:
        raise BadRequest("query", "required")
    query = _str_list(body, "query", None)
    n = len(query)
    if body.get("prompts") is None:
        prompts = [""] * n
    else:
        prompts = _str_list(body, "prompts", n)
    for i, (q, p) in enumerate(zip(query, prompts)):
        if not q.startswith(p):
            raise BadRequest(f"query[{i}]", "must start with prompts[i]")
    metadata: list[dict[str, Any]] = [{} for _ in range(n)]
    labels = body.get("labels")
    if labels is not None:
        if not isinstance(labels, list) or len(labels) != n:
            got = f"{len(labels)} items" if isinstance(labels, list) else type(labels).__name__
            raise BadRequest("labels", f"expected one label per query ({n}), got {got}")
        for m, lab in zip(metadata, labels):
            m["labels"] = lab
    return _samples(prompts, [q[len(p):] for q, p in zip(query, prompts)], None, metadata)


def check_metadata_names(samples: Samples, reserved: Sequence[str]) -> None:
    """A metadata column named like an argument the served function already gets (``reserved``, by its
    signature: ``signature.passed_names``) would reach it twice: a 422 naming the column."""
    for m in samples.metadata[:1]:  # every request row has the same columns (parse_score_request)
        for col in m:
            if col in reserved:
                raise BadRequest(f"metadata.{col}", f"is the name of an argument the served reward function "
                                                    f"gets ({', '.join(reserved)}); rename the column")


def _samples(prompts, outputs, token_ids, metadata) -> Samples:
    # No token ids (OpenRLHF's protocol has none): the reward function gets None for each sample, and
    # `score_samples` then cannot check a dense reward's length; the client, which has the ids, does.
    return Samples(prompts, outputs, token_ids if token_ids is not None else [None] * len(prompts), metadata)


async def read_limited(request: Any, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes: from
    Content-Length before anything is read, else while streaming (chunked bodies)."""
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            declared = int(cl)
        except ValueError:
            raise BadRequest("Content-Length", f"not an integer: {cl!r}", 400) from None
        if declared > limit:
            raise BadRequest("body", f"{declared} bytes is over the limit of {limit} bytes (--max-body-mb)", 413)
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise BadRequest("body", f"over the limit of {limit} bytes (--max-body-mb)", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def check_token(header: str | None, token: str | None) -> None:
    """``Authorization: Bearer <token>`` when a token is configured (constant-time compare)."""
    if token is None:
        return
    scheme, _, given = (header or "").partition(" ")
    # compare_digest on bytes: its time does not depend on where the strings differ.
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise BadRequest("Authorization", f"missing or wrong bearer token (the server has {TOKEN_ENV} set)", 401)
