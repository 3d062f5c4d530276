"""``rallyrl serve-reward``: a reward function behind HTTP (FastAPI + uvicorn), with dynamic batching.

The reward host of a "7+1" layout, a separate reward box, or a reward service shared by several runs.
The served function is the same trlx-signature callable the trainer takes (``--fn IMPORT_PATH``, or
``--model HF_DIR [--label L]`` for the built-in ``hf_classifier``); every call runs inside
``isolated_rng()`` and its output goes through the same ``validate_rewards`` as an in-process reward
(``score_samples`` of ``reward/step.py`` does both).

Endpoints:

- ``GET /health`` -> ``{"status": "ok", ...}`` (no token needed: load balancers probe it);
- ``POST /score`` (rallyrl protocol): ``{"samples", "prompts", "outputs", "metadata": {col: [...]},
  "output_token_ids"?}`` -> ``{"rewards": [...]}`` (a float, or a per-token list, per sample);
- ``POST /get_reward`` (OpenRLHF's protocol): ``{"query", "prompts"?, "labels"?}`` ->
  ``{"rewards", "scores", "extra_logs"}``;
- ``GET /openapi.json``, ``GET /docs``.

Dynamic batching (``Batcher``): requests that arrive while the reward function is busy, or within
``--max-wait-ms`` of the first one, are merged into one call of up to ``--max-batch`` samples; each
request receives exactly its own slice of the results. One worker thread makes every call, so there is
one model copy and calls never run concurrently; the event loop stays free (``/health`` answers during
a long call).

Bad input never gets a 500: malformed JSON, wrong types and mismatched lengths get a 4xx naming the
field; a body over ``--max-body-mb`` gets 413 without being read whole; with ``RALLYRL_REWARD_TOKEN``
set, scoring needs ``Authorization: Bearer <token>`` (constant-time compare) or gets 401. A failing or
invalid reward function gets a 500 carrying its message, and the server keeps serving.
"""

# No `from __future__ import annotations`: FastAPI resolves the endpoint annotations (`Request`, imported
# inside create_app so that importing this module needs no fastapi) at definition time.

import argparse
import asyncio
import hmac
import json
import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .step import NamedRewardFn, Samples, score_samples

TOKEN_ENV = "RALLYRL_REWARD_TOKEN"


class BadRequest(ValueError):
    """A request that does not follow the protocol; ``field`` names what is wrong."""

    def __init__(self, field: str, message: str, status: int = 422) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.status = field, status


# ------------------------------------------------------------------------------------------------
# Request parsing (pure functions: every rule is tested without a server)


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


def _samples(prompts, outputs, token_ids, metadata) -> Samples:
    # No token ids (OpenRLHF's protocol has none): the reward function gets None for each sample, and
    # `score_samples` then cannot check a dense reward's length; the client, which has the ids, does.
    return Samples(prompts, outputs, token_ids if token_ids is not None else [None] * len(prompts), metadata)


# ------------------------------------------------------------------------------------------------
# Dynamic batching


@dataclass
class BatcherStats:
    requests: int = 0
    samples: int = 0
    calls: int = 0  # reward-function calls (a merged batch larger than max_batch makes several)
    batches: int = 0  # merged batches
    errors: int = 0  # batches whose reward call failed


class Batcher:
    """Merges concurrent requests into reward calls of up to ``max_batch`` samples.

    ``submit(samples) -> Future`` (thread-safe) resolves to that request's rewards (a float, or a
    per-token list, per sample) or to the exception of the call its batch was in. A worker thread takes
    the oldest request, waits at most ``max_wait_ms`` for more (stopping early when ``max_batch`` is
    reached; a request that does not fit opens the next batch), scores the merged batch with
    ``score_samples`` (RNG isolation + validation, in calls of at most ``max_batch``) and hands each
    request its own slice, in order. ``batching=False``: one request per call (the baseline).
    """

    def __init__(self, fn: NamedRewardFn, max_batch: int = 256, max_wait_ms: float = 5.0,
                 batching: bool = True, tokenizer: Any = None) -> None:
        if max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
        if max_wait_ms < 0:
            raise ValueError(f"--max-wait-ms must be >= 0, got {max_wait_ms}")
        self.fn, self.max_batch, self.max_wait_s, self.batching = fn, max_batch, max_wait_ms / 1000, batching
        self.tokenizer = tokenizer
        self.stats = BatcherStats()
        self._q: queue.Queue[tuple[Samples, Future] | None] = queue.Queue()
        self._next: tuple[Samples, Future] | None = None  # taken from the queue, did not fit its batch
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rallyrl-reward-batcher", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        with self._lock:
            t, self._thread = self._thread, None
        if t is not None:
            self._q.put(None)
            t.join(timeout=30)

    def submit(self, samples: Samples) -> Future:
        fut: Future = Future()
        if len(samples) == 0:
            fut.set_result([])
            return fut
        self.start()
        self._q.put((samples, fut))
        return fut

    def _take(self) -> list[tuple[Samples, Future]] | None:
        first, self._next = (self._next, None) if self._next is not None else (self._q.get(), None)
        if first is None:
            return None
        batch, n = [first], len(first[0])
        if not self.batching:
            return batch
        deadline = time.monotonic() + self.max_wait_s
        while n < self.max_batch:
            left = deadline - time.monotonic()
            try:
                item = self._q.get(timeout=left) if left > 0 else self._q.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._q.put(None)  # stop once this batch is scored
                break
            if n + len(item[0]) > self.max_batch:
                self._next = item
                break
            batch.append(item)
            n += len(item[0])
        return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            self._score(batch)

    def _score(self, batch: list[tuple[Samples, Future]]) -> None:
        merged = Samples.concat([r for r, _ in batch])
        try:
            rewards, st = score_samples([self.fn], merged, self.tokenizer, self.max_batch)
            # One function with weight 1: exactly its validated output (0.0 + 1.0 * x == x).
            out = [rw.dense if rw.dense is not None else rw.score for rw in rewards]
        except Exception as e:  # every request of the batch gets the error; the worker goes on
            self.stats.errors += 1
            for _, fut in batch:
                fut.set_exception(e)
            return
        self.stats.batches += 1
        self.stats.calls += st.calls
        self.stats.requests += len(batch)
        self.stats.samples += len(merged)
        a = 0
        for r, fut in batch:
            fut.set_result(out[a : a + len(r)])
            a += len(r)


# ------------------------------------------------------------------------------------------------
# The ASGI app


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


def create_app(batcher: Batcher, token: str | None = None, max_body_bytes: int = 32 * 2**20) -> Any:
    """The FastAPI app serving ``batcher``'s reward function (see the module docstring)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, Field

    class ScoreRequest(BaseModel):
        samples: list[str] = Field(description="prompt + output, per sample")
        prompts: list[str]
        outputs: list[str] = Field(description="what was trained on (after stop-sequence truncation)")
        metadata: dict[str, list[Any]] = Field(default_factory=dict,
                                               description="per-sample columns, passed as keyword arguments")
        output_token_ids: list[list[int]] | None = Field(
            None, description="the outputs' token ids (the reward function's `output_token_ids`; they bound "
                              "dense rewards)")

    class ScoreResponse(BaseModel):
        rewards: list[float | list[float]] = Field(description="a float, or a per-token list, per sample")

    class OpenRLHFRequest(BaseModel):
        query: list[str] = Field(description="prompt + response, per sample")
        prompts: list[str] | None = None
        labels: list[Any] | None = None

    class OpenRLHFResponse(BaseModel):
        rewards: list[float | list[float]]
        scores: list[float | list[float]]
        extra_logs: dict[str, Any]

    class ErrorResponse(BaseModel):
        error: str
        field: str | None = None

    def body_schema(model: type[BaseModel]) -> dict[str, Any]:
        return {"requestBody": {"required": True, "content": {"application/json": {
            "schema": model.model_json_schema(ref_template="#/components/schemas/{model}")}}}}

    errors = {c: {"model": ErrorResponse} for c in (400, 401, 413, 422, 500)}

    async def lifespan(app: Any):
        batcher.start()
        yield
        batcher.stop()

    app = FastAPI(title="rallyrl reward server", version="1", lifespan=lifespan,
                  description="A rallyrl reward function behind HTTP, with dynamic batching.")

    def error(status: int, message: str, field: str | None = None) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return JSONResponse({"error": message, "field": field}, status_code=status, headers=headers)

    async def score(request: Request, parse: Any) -> tuple[list[Any] | None, JSONResponse | None]:
        try:
            check_token(request.headers.get("authorization"), token)
            samples = parse(await read_limited(request, max_body_bytes))
        except BadRequest as e:
            return None, error(e.status, str(e), e.field)
        try:
            return await asyncio.wrap_future(batcher.submit(samples)), None
        except Exception as e:  # the reward function failed or returned invalid output
            return None, error(500, f"{type(e).__name__}: {e}")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        st = batcher.stats
        return {"status": "ok", "reward_fn": batcher.fn.name, "max_batch": batcher.max_batch,
                "max_wait_ms": batcher.max_wait_s * 1000, "batching": batcher.batching,
                "requests": st.requests, "samples": st.samples, "calls": st.calls, "errors": st.errors}

    @app.post("/score", responses={200: {"model": ScoreResponse}, **errors}, openapi_extra=body_schema(ScoreRequest))
    async def score_rallyrl(request: Request) -> Any:
        rewards, err = await score(request, parse_score_request)
        return err or {"rewards": rewards}

    @app.post("/get_reward", responses={200: {"model": OpenRLHFResponse}, **errors},
              openapi_extra=body_schema(OpenRLHFRequest))
    async def score_openrlhf(request: Request) -> Any:
        rewards, err = await score(request, parse_openrlhf_request)
        return err or {"rewards": rewards, "scores": rewards, "extra_logs": {}}

    return app


# ------------------------------------------------------------------------------------------------
# `rallyrl serve-reward`


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve-reward", help="serve a reward function over HTTP (dynamic batching)",
                              description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--fn", metavar="IMPORT_PATH", help="reward function, 'pkg.mod:attr' or 'file.py:attr'")
    src.add_argument("--model", metavar="HF_DIR", help="a sequence classifier folder (built-in hf_classifier)")
    p.add_argument("--kwargs", metavar="JSON", default=None,
                   help="--fn is a factory called with these keyword arguments (a JSON object)")
    p.add_argument("--label", default=None, help="--model: the label whose score is the reward (name or index)")
    p.add_argument("--device", default=None, help="--model: device of the classifier, e.g. cuda:7")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = a free one, printed)")
    p.add_argument("--max-batch", type=int, default=256, help="most samples in one reward call (default 256)")
    p.add_argument("--max-wait-ms", type=float, default=5.0,
                   help="how long the first request of a batch waits for others (default 5)")
    p.add_argument("--no-batching", action="store_true", help="one request per reward call (baseline)")
    p.add_argument("--max-body-mb", type=float, default=32.0, help="larger request bodies get 413 (default 32)")
    p.set_defaults(func=main)
    return p


def build_reward_fn(args: argparse.Namespace) -> NamedRewardFn:
    """The served function from ``--fn``/``--kwargs`` or ``--model``/``--label``/``--device``."""
    from .loading import ImportPathError, load_callable

    if args.fn:
        if args.label is not None or args.device is not None:
            raise ImportPathError("--label and --device are options of --model; a --fn function takes its "
                                  "options through --kwargs")
        kwargs = None
        if args.kwargs is not None:
            try:
                kwargs = json.loads(args.kwargs)
            except json.JSONDecodeError as e:
                raise ImportPathError(f"--kwargs is not valid JSON: {e}") from None
            if not isinstance(kwargs, dict):
                raise ImportPathError(f"--kwargs must be a JSON object, got {type(kwargs).__name__}")
        return NamedRewardFn(args.fn.rsplit(":", 1)[-1], load_callable(args.fn, "--fn", kwargs))
    from .hf import hf_classifier

    if args.kwargs is not None:
        raise ImportPathError("--kwargs is for --fn; --model takes --label and --device")
    label: str | int | None = args.label
    if isinstance(label, str) and label.isdigit():
        label = int(label)
    options = {"device": args.device} if args.device else {}
    return NamedRewardFn("hf_classifier", hf_classifier(args.model, label=label, **options))


def main(args: argparse.Namespace) -> int:
    import socket
    import sys

    def fail(msg: str) -> int:
        print(f"rallyrl serve-reward: error: {msg}", file=sys.stderr)
        return 2

    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        return fail(f"{e.name} is not installed; install the server extra: pip install 'rallyrl[server]'")
    from .hf import HFClassifierError
    from .loading import ImportPathError

    if args.max_batch < 1:
        return fail(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_wait_ms < 0:
        return fail(f"--max-wait-ms must be >= 0, got {args.max_wait_ms}")
    if args.max_body_mb <= 0:
        return fail(f"--max-body-mb must be > 0, got {args.max_body_mb}")
    if not 0 <= args.port < 65536:
        return fail(f"--port must be in [0, 65535], got {args.port}")
    try:
        fn = build_reward_fn(args)
    except (ImportPathError, HFClassifierError) as e:
        return fail(str(e))
    token = os.environ.get(TOKEN_ENV) or None
    loopback = args.host in ("127.0.0.1", "localhost", "::1")
    if not loopback and token is None:
        print(f"rallyrl serve-reward: warning: binding {args.host} without {TOKEN_ENV}: anyone who reaches this "
              f"port can call the reward function", file=sys.stderr)
    batcher = Batcher(fn, args.max_batch, args.max_wait_ms, batching=not args.no_batching)
    app = create_app(batcher, token, int(args.max_body_mb * 2**20))
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted connections only when the listening
    # socket says so; without it Nagle + delayed ACKs add ~40 ms to every request (measured: 45 -> 5 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        return fail(f"cannot bind {args.host}:{args.port}: {e}")
    port = sock.getsockname()[1]
    shown = f"[{args.host}]" if family == socket.AF_INET6 else args.host
    print(f"rallyrl serve-reward: {fn.name} on http://{shown}:{port} (max batch {args.max_batch}, "
          f"max wait {args.max_wait_ms:g} ms{', batching off' if args.no_batching else ''}"
          f"{', token required' if token else ''})", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0
