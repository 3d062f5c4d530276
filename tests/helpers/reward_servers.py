"""Real reward servers on random loopback ports, for the client and overlap tests.

- ``ScriptedServer``: a small FastAPI app under uvicorn in a thread, scoring with
  ``deterministic_score`` (so a misplaced reward is visible) and misbehaving on request: each POST
  takes the next mode of ``script`` (``ok``, ``500``, ``badjson``, ``wrongcount``, ``stall``, ``gate``)
  and falls back to ``default`` when the script is empty. It records every request it answered.
- ``serve_reward_process``: the real ``rallyrl serve-reward`` as a subprocess (``--port 0``; the port
  is read from its first line), for kill-and-restart tests and training runs.
"""


import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections import deque

from tests.helpers.rewards import deterministic_score
from tests.helpers.runs import ROOT, env


def free_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # see rallyrl.reward.server.main
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


class ScriptedServer:
    def __init__(self, script=(), default: str = "ok", stall_s: float = 3.0) -> None:
        import uvicorn
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, Response

        self.script, self.default, self.stall_s = deque(script), default, stall_s
        self.requests: list[dict] = []  # {"mode", "n", "prompts"}
        self.gate = threading.Event()
        app = FastAPI()

        async def handle(request: Request, openrlhf: bool):
            body = json.loads(await request.body())
            mode = self.script.popleft() if self.script else self.default
            if openrlhf:
                prompts = body.get("prompts") or [""] * len(body["query"])
                outputs = [q[len(p):] for q, p in zip(body["query"], prompts)]
            else:
                prompts, outputs = body["prompts"], body["outputs"]
            self.requests.append({"mode": mode, "n": len(prompts), "prompts": prompts,
                                  "auth": request.headers.get("authorization"), "body": body})
            rewards = [deterministic_score(p, o) for p, o in zip(prompts, outputs)]
            if mode == "500":
                return JSONResponse({"error": "scripted failure"}, status_code=500)
            if mode == "badjson":
                return Response(b'{"rewards": [0.1, ', media_type="application/json")
            if mode == "wrongcount":
                return {"rewards": rewards[:-1]}
            if mode == "nan":
                return Response(json.dumps({"rewards": [float("nan")] * len(rewards)}), media_type="application/json")
            if mode == "stall":
                await asyncio.sleep(self.stall_s)
            if mode == "gate":
                while not self.gate.is_set():
                    await asyncio.sleep(0.01)
            return {"rewards": rewards, "scores": rewards, "extra_logs": {}} if openrlhf else {"rewards": rewards}

        @app.post("/score")
        async def score(request: Request):
            return await handle(request, False)

        @app.post("/get_reward")
        async def get_reward(request: Request):
            return await handle(request, True)

        self._sock = free_socket()
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="error", timeout_graceful_shutdown=1))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self):
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            assert time.monotonic() < deadline, "scripted server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.gate.set()
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


def serve_reward_process(*args: str, port: int = 0, timeout: float = 60, **env_extra: str):
    """Start `rallyrl serve-reward ARGS --port PORT`; returns (process, url) once it listens."""
    cmd = [sys.executable, "-m", "rallyrl.cli", "serve-reward", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(**env_extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline()  # "rallyrl serve-reward: NAME on http://127.0.0.1:PORT (...)"
    if " on http://" not in line:
        proc.kill()
        raise AssertionError(f"serve-reward did not start: {line!r} {proc.stderr.read()[-3000:]}")
    url = line.split(" on ", 1)[1].split(" ", 1)[0]
    import httpx

    deadline = time.monotonic() + timeout
    while True:  # the socket is bound before uvicorn serves: wait for /health
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, "serve-reward did not become healthy"
        time.sleep(0.05)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
