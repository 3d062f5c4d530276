"""``RemoteReward``: an HTTP client (httpx) that is itself a reward function (trlx signature).

    reward:
      url: http://rm-host:8000            # or a list of URLs
      timeout_s: 60
      retries: 3

or ``rallyrl.train(cfg, reward_fn=rallyrl.RemoteReward("http://rm-host:8000"))``. It talks to
``rallyrl serve-reward`` (``protocol="rallyrl"``, ``POST /score``) or to an OpenRLHF reward server
(``protocol="openrlhf"``, ``POST /get_reward``; the ``labels`` metadata column is sent as ``labels``).

Robustness, in the terms of the failures other clients have:

- every request has a timeout (``timeout_s``, per attempt); a connection error, a timeout, a 5xx, a
  408/429, a body that is not JSON or a wrong number of rewards is retried ``retries`` times with
  exponential backoff and full jitter (drawn from a private RNG: the training RNG streams are never
  touched); a 4xx that retrying cannot fix (401, 413, 422, ...) fails at once with the server's message
  (a 413 also names the two settings that decide it: ``reward.batch_size`` and the server's
  ``--max-body-mb``);
- after the last attempt the error names the URL, the number of attempts and the last failure; raised
  inside the reward step, it becomes the collective ``RewardError`` on every rank;
- with several URLs one batch is split over the live servers (contiguous parts, least-loaded server
  first); a server that fails is marked dead for a while and its part goes to another one; each part
  is written back at its own offsets, and the count of every answer is checked, so a reward can never
  land on another sample;
- what comes back is checked with the same ``validate_rewards`` as in-process rewards.

The token (``RALLYRL_REWARD_TOKEN``, or ``token=``) is sent as ``Authorization: Bearer``.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .validate import RewardValidationError, validate_rewards

TOKEN_ENV = "RALLYRL_REWARD_TOKEN"
PROTOCOLS = {"rallyrl": "/score", "openrlhf": "/get_reward"}
_RETRY_STATUS = {408, 425, 429}


class RemoteRewardError(RuntimeError):
    """The reward server(s) could not score a batch (after the retries, or a failure retrying cannot fix)."""


class _Retryable(Exception):
    pass


@dataclass
class _Server:
    url: str  # the full endpoint URL
    in_flight: int = 0
    dead_until: float = 0.0  # monotonic time before which it is skipped (after a failure)
    failures: int = 0  # consecutive


class RemoteReward:
    """A reward function that scores samples on one or more reward servers.

    ``url``: a base URL (``http://host:8000``; the protocol's path is appended) or a full endpoint URL,
    or a list of them. ``timeout_s``: per HTTP attempt. ``retries``: extra attempts per part of a batch.
    ``backoff_s``: the first backoff (doubled per attempt, capped at ``max_backoff_s``, full jitter).
    ``dead_s``: how long a server that failed is skipped before it is tried again.
    """

    def __init__(self, url: str | Sequence[str], timeout_s: float = 60.0, retries: int = 3,
                 protocol: str = "rallyrl", token: str | None = None, backoff_s: float = 0.5,
                 max_backoff_s: float = 10.0, dead_s: float = 5.0) -> None:
        urls = [url] if isinstance(url, str) else list(url)
        if not urls:
            raise ValueError("RemoteReward needs at least one URL")
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {list(PROTOCOLS)}, got {protocol!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an integer >= 0, got {retries!r}")
        self.servers = [_Server(self._endpoint(u, protocol)) for u in urls]
        self.timeout_s, self.retries, self.protocol = float(timeout_s), retries, protocol
        self.token = token if token is not None else (os.environ.get(TOKEN_ENV) or None)
        self.backoff_s, self.max_backoff_s, self.dead_s = backoff_s, max_backoff_s, dead_s
        self._rng = random.Random()  # jitter only; never the global RNG streams
        self._lock = threading.Lock()
        self._client: Any = None
        self._http()  # now, on the constructing thread: see _http
        self.failed_attempts: deque[str] = deque(maxlen=100)  # "URL: cause" of recent failed attempts
        self.__name__ = "remote"

    @staticmethod
    def _endpoint(url: str, protocol: str) -> str:
        if not isinstance(url, str):
            raise ValueError(f"reward server URL must be a string, got {type(url).__name__} {url!r}")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"reward server URL {url!r} must look like http://host:port")
        if parts.path in ("", "/"):
            return url.rstrip("/") + PROTOCOLS[protocol]
        return url

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def __repr__(self) -> str:
        return f"RemoteReward({self.urls}, protocol={self.protocol!r}, timeout_s={self.timeout_s}, retries={self.retries})"

    def __getstate__(self) -> dict[str, Any]:  # picklable (the httpx client and lock are rebuilt)
        d = dict(self.__dict__)
        d["_client"], d["_lock"] = None, None
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._lock = threading.Lock()

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _http(self) -> Any:
        with self._lock:
            if self._client is None:
                # Importing httpx draws from the global `random` (its `rich` dependency does, at import
                # time), and the first use may import more: done inside isolated_rng, and at construction,
                # so a call on RewardStep.submit's background thread never imports anything.
                from ..seeding import isolated_rng

                with isolated_rng():
                    import httpx

                    self._client = self._make_client(httpx)
            return self._client

    def _make_client(self, httpx: Any) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        limits = httpx.Limits(max_connections=4 * len(self.servers) + 4)
        return httpx.Client(timeout=httpx.Timeout(self.timeout_s), headers=headers, limits=limits)

    # --- the reward function ------------------------------------------------------------------
    def __call__(self, samples: Sequence[str], prompts: Sequence[str], outputs: Sequence[str],
                 **kwargs: Any) -> list[float | list[float]]:
        n = len(samples)
        if n == 0:
            return []
        kwargs.pop("tokenizer", None)  # a local object: the server has its own
        ids = kwargs.pop("output_token_ids", None)
        meta = {k: list(v) for k, v in kwargs.items()}
        for k, v in meta.items():
            if len(v) != n:
                raise ValueError(f"RemoteReward: keyword {k!r} has {len(v)} values for {n} samples")
        bodies = _Bodies(self.protocol, list(samples), list(prompts), list(outputs), meta,
                         [list(map(int, t)) for t in ids] if ids is not None else None)
        k = min(n, max(1, sum(1 for s in self.servers if s.dead_until <= time.monotonic())))
        bounds = [(n * i // k, n * (i + 1) // k) for i in range(k)]
        result: list[Any] = [None] * n
        if k == 1:
            result[:] = self._score_part(bodies, 0, n)
        else:
            with ThreadPoolExecutor(k, thread_name_prefix="rallyrl-remote") as pool:
                futs = [(a, b, pool.submit(self._score_part, bodies, a, b)) for a, b in bounds]
                for a, b, f in futs:
                    result[a:b] = f.result()
        lengths = [len(t) for t in ids] if ids is not None else [2**62] * n
        try:
            return validate_rewards(result, lengths, fn_name=f"reward server {self._names()}")
        except RewardValidationError as e:
            raise RemoteRewardError(str(e)) from None

    def _names(self) -> str:
        return self.servers[0].url if len(self.servers) == 1 else "[" + ", ".join(self.urls) + "]"

    def _pick(self, avoid: _Server | None) -> _Server:
        """The least-loaded live server (not ``avoid``, if another exists); if all are dead, the one that
        comes back first."""
        with self._lock:
            now = time.monotonic()
            live = [s for s in self.servers if s.dead_until <= now]
            pool = [s for s in live if s is not avoid] or live or sorted(self.servers, key=lambda s: s.dead_until)[:1]
            s = min(pool, key=lambda s: (s.in_flight, s.failures))
            s.in_flight += 1
            return s

    def _score_part(self, bodies: "_Bodies", a: int, b: int) -> list[Any]:
        body = bodies.part(a, b)
        last: tuple[str, str] | None = None
        server: _Server | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                cap = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
                time.sleep(self._rng.uniform(0, cap) if cap > 0 else 0)  # full jitter
            server = self._pick(avoid=server)
            try:
                out = self._post(server, body, b - a)
            except _Retryable as e:
                with self._lock:
                    server.in_flight -= 1
                    server.failures += 1
                    server.dead_until = time.monotonic() + self.dead_s
                last = (server.url, str(e))
                self.failed_attempts.append(f"{server.url}: {e}")
                continue
            except BaseException:
                with self._lock:
                    server.in_flight -= 1
                raise
            with self._lock:
                server.in_flight -= 1
                server.failures, server.dead_until = 0, 0.0
            return out
        assert last is not None
        raise RemoteRewardError(f"reward server {last[0]}: gave up after {self.retries + 1} attempt(s); "
                                f"last failure: {last[1]}")

    def _post(self, server: _Server, body: bytes, n: int) -> list[Any]:
        import httpx

        try:
            r = self._http().post(server.url, content=body, headers={"Content-Type": "application/json"})
        except httpx.TimeoutException as e:
            raise _Retryable(f"no answer within timeout_s={self.timeout_s:g} ({type(e).__name__})") from None
        except httpx.TransportError as e:
            raise _Retryable(f"{type(e).__name__}: {e}") from None
        detail = _error_text(r)
        if r.status_code == 413:  # retrying the same body cannot help: say which two settings decide it
            raise RemoteRewardError(
                f"reward server {server.url}: HTTP 413: {detail}: a request of {n} sample(s) "
                f"({len(body) / 2**20:.2f} MiB) is over the server's body limit; lower reward.batch_size (the "
                f"samples per reward call, hence per request) or start the server with a larger --max-body-mb")
        if r.status_code >= 500 or r.status_code in _RETRY_STATUS:
            raise _Retryable(f"HTTP {r.status_code}: {detail}")
        if r.status_code != 200:
            raise RemoteRewardError(f"reward server {server.url}: HTTP {r.status_code}: {detail} "
                                    f"(not retried: the request itself was refused)")
        try:
            data = json.loads(r.content)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _Retryable(f"the answer is not valid JSON ({e}): {r.text[:200]!r}") from None
        rewards = data.get("rewards") if isinstance(data, dict) else None
        if not isinstance(rewards, list):
            raise _Retryable(f"the answer has no 'rewards' list: {r.text[:200]!r}")
        if len(rewards) != n:
            raise _Retryable(f"sent {n} samples, got {len(rewards)} rewards back")
        return rewards


def _error_text(r: Any) -> str:
    try:
        data = r.json()
        if isinstance(data, dict) and "error" in data:
            return str(data["error"])
    except Exception:
        pass
    return r.text[:300]


class _Bodies:
    """Builds the JSON body of any [a, b) part of a batch (metadata checked to be JSON once)."""

    def __init__(self, protocol: str, samples: list[str], prompts: list[str], outputs: list[str],
                 meta: dict[str, list[Any]], ids: list[list[int]] | None) -> None:
        self.protocol, self.samples, self.prompts, self.outputs, self.meta, self.ids = (
            protocol, samples, prompts, outputs, meta, ids)
        try:
            json.dumps(meta, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"RemoteReward: metadata must be JSON-serializable to reach the server: {e}") from None

    def part(self, a: int, b: int) -> bytes:
        if self.protocol == "openrlhf":
            body: dict[str, Any] = {"query": self.samples[a:b], "prompts": self.prompts[a:b]}
            labels = self.meta.get("labels", self.meta.get("label"))
            if labels is not None:
                body["labels"] = labels[a:b]
        else:
            body = {"samples": self.samples[a:b], "prompts": self.prompts[a:b], "outputs": self.outputs[a:b],
                    "metadata": {k: v[a:b] for k, v in self.meta.items()}}
            if self.ids is not None:
                body["output_token_ids"] = self.ids[a:b]
        return json.dumps(body).encode()


def remote_reward(url: str | Sequence[str], **options: Any) -> RemoteReward:
    """``RemoteReward(url, **options)`` as a factory (usable as ``reward.fn`` with ``reward.kwargs``)."""
    return RemoteReward(url, **options)


__all__ = ["RemoteReward", "RemoteRewardError", "remote_reward"]
