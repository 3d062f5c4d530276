"""``rallyrl serve-reward``: a reward function behind HTTP (FastAPI + uvicorn), with dynamic batching.

The reward host of a "7+1" layout, a separate reward box, or a reward service shared by several runs.
The served function is the same trlx-signature callable the trainer takes (``--fn IMPORT_PATH``, or
``--model HF_DIR [--label L]`` for the built-in ``hf_classifier``); every call runs inside
``isolated_rng()`` and its output goes through the same ``validate_rewards`` as an in-process reward
(``score_samples`` of ``reward/scoring.py`` does both).

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
import json
import os
from types import SimpleNamespace
from typing import Any

from .batcher import Batcher, BatcherStats
from .protocol import (TOKEN_ENV, BadRequest, check_metadata_names, check_token, parse_openrlhf_request,
                       parse_score_request, read_limited)
from .samples import NamedRewardFn
from .signature import SIGNATURES, detect_signature, passed_names

# The request rules live in protocol.py and the batcher in batcher.py; their names stay importable from
# here (the tests, the docs and users' scripts import them from `rallyrl.reward.server`).
__all__ = ["TOKEN_ENV", "BadRequest", "Batcher", "BatcherStats", "add_parser", "build_reward_fn", "check_token",
           "create_app", "main", "parse_openrlhf_request", "parse_score_request", "read_limited"]


# ------------------------------------------------------------------------------------------------
# The ASGI app


def create_app(batcher: Batcher, token: str | None = None, max_body_bytes: int = 32 * 2**20) -> Any:
    """The FastAPI app serving ``batcher``'s reward function (see the module docstring)."""
    from fastapi import FastAPI

    async def lifespan(app: Any):
        batcher.start()
        yield
        batcher.stop()

    app = FastAPI(title="rallyrl reward server", version="1", lifespan=lifespan,
                  description="A rallyrl reward function behind HTTP, with dynamic batching.")
    _add_routes(app, batcher, _scorer(batcher, token, max_body_bytes), _schemas())
    return app


def _schemas() -> SimpleNamespace:
    """The OpenAPI models of the endpoints (pydantic, imported here: importing this module needs none).
    The endpoints read their bodies themselves (``protocol.py``: every rule with a 4xx naming the
    field), so these models document the protocol in ``/openapi.json`` and ``/docs``; they parse nothing."""
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
        rewards: list[float | list[float] | None] = Field(
            description="a float, or a per-token list, per sample; null: the function returned None for it "
                        "(unscorable)")

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

    return SimpleNamespace(score=body_schema(ScoreRequest), score_response=ScoreResponse,
                           openrlhf=body_schema(OpenRLHFRequest), openrlhf_response=OpenRLHFResponse,
                           errors={c: {"model": ErrorResponse} for c in (400, 401, 413, 422, 500)})


def _scorer(batcher: Batcher, token: str | None, max_body_bytes: int) -> Any:
    """``score(request, parse) -> (rewards, None) | (None, error response)``: the token, the body (limited,
    parsed by ``parse``), then the batcher; a broken rule gets its 4xx, a failing reward function a 500."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    def error(status: int, message: str, field: str | None = None) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return JSONResponse({"error": message, "field": field}, status_code=status, headers=headers)

    reserved = passed_names(batcher.fn.signature or detect_signature(batcher.fn.fn, batcher.fn.name))

    async def score(request: Request, parse: Any) -> tuple[list[Any] | None, JSONResponse | None]:
        try:
            check_token(request.headers.get("authorization"), token)
            samples = parse(await read_limited(request, max_body_bytes))
            check_metadata_names(samples, reserved)
        except BadRequest as e:
            return None, error(e.status, str(e), e.field)
        try:
            return await asyncio.wrap_future(batcher.submit(samples)), None
        except Exception as e:  # the reward function failed or returned invalid output
            return None, error(500, f"{type(e).__name__}: {e}")

    return score


def _no_null(rewards: list[Any]) -> Any:
    """OpenRLHF's protocol has no "unscorable": its trainer makes a tensor of the rewards, which a null
    would break. A sample the function returned None for is answered with a 422 naming it (not retried:
    the same samples give the same answer), and the rallyrl protocol named as the way to send None."""
    from fastapi.responses import JSONResponse

    i = rewards.index(None)
    return JSONResponse({"error": f"the reward function returned None (unscorable) for sample {i}; OpenRLHF's "
                                  f"protocol (POST /get_reward) cannot carry None: use POST /score (reward.protocol: "
                                  f"rallyrl), or return a number", "field": f"rewards[{i}]"}, status_code=422)


def _add_routes(app: Any, batcher: Batcher, score: Any, schemas: SimpleNamespace) -> None:
    """``GET /health``, ``POST /score`` (rallyrl's protocol), ``POST /get_reward`` (OpenRLHF's)."""
    from fastapi import Request

    @app.get("/health")
    async def health() -> dict[str, Any]:
        st = batcher.stats
        return {"status": "ok", "reward_fn": batcher.fn.name, "signature": batcher.fn.signature,
                "max_batch": batcher.max_batch,
                "max_wait_ms": batcher.max_wait_s * 1000, "batching": batcher.batching,
                "requests": st.requests, "samples": st.samples, "calls": st.calls, "errors": st.errors}

    @app.post("/score", responses={200: {"model": schemas.score_response}, **schemas.errors},
              openapi_extra=schemas.score)
    async def score_rallyrl(request: Request) -> Any:
        rewards, err = await score(request, parse_score_request)
        return err or {"rewards": rewards}

    @app.post("/get_reward", responses={200: {"model": schemas.openrlhf_response}, **schemas.errors},
              openapi_extra=schemas.openrlhf)
    async def score_openrlhf(request: Request) -> Any:
        rewards, err = await score(request, parse_openrlhf_request)
        if err is None and None in rewards:
            return _no_null(rewards)
        return err or {"rewards": rewards, "scores": rewards, "extra_logs": {}}


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
    p.add_argument("--signature", choices=SIGNATURES, default="auto",
                   help="--fn: how it is called, trlx's fn(samples, prompts, outputs, **kwargs) or TRL's keywords "
                        "(default auto: read from its parameters; docs/reward.md)")
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
        name = args.fn.rsplit(":", 1)[-1]
        fn = load_callable(args.fn, "--fn", kwargs)
        return NamedRewardFn(name, fn, signature=detect_signature(fn, name, getattr(args, "signature", "auto")))
    from .hf import hf_classifier

    if args.kwargs is not None:
        raise ImportPathError("--kwargs is for --fn; --model takes --label and --device")
    if getattr(args, "signature", "auto") != "auto":
        raise ImportPathError("--signature is for --fn; the --model classifier is called the trlx way")
    label: str | int | None = args.label
    if isinstance(label, str) and label.isdigit():
        label = int(label)
    options = {"device": args.device} if args.device else {}
    return NamedRewardFn("hf_classifier", hf_classifier(args.model, label=label, **options), signature="trlx")


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
    from ..config import ConfigError

    try:
        fn = build_reward_fn(args)
    except (ImportPathError, HFClassifierError, ConfigError) as e:  # ConfigError: RewardSignatureError
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
    print(f"rallyrl serve-reward: {fn.name} on http://{shown}:{port} ({fn.signature} signature, "
          f"max batch {args.max_batch}, "
          f"max wait {args.max_wait_ms:g} ms{', batching off' if args.no_batching else ''}"
          f"{', token required' if token else ''})", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0
