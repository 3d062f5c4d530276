"""Training against a real `rallyrl serve-reward` process (2 ranks, gloo): the final weights are the
same bytes as the in-process `main` placement run with the same config, with `main` and `local`
placement pointed at the server (`local`: both ranks' requests reach the one server)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from tests.helpers.reward_servers import serve_reward_process, stop  # noqa: E402
from tests.helpers.runs import base_config, rallyrl_train, write_config  # noqa: E402

pytestmark = pytest.mark.dist


def _train(tmp, name, model, reward):
    cfg = base_config(model, tmp / name)
    cfg["reward"] = reward
    cfg["dist"] = {"timeout_s": 120}
    proc = rallyrl_train(write_config(tmp / f"{name}.yaml", cfg), 2)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return (tmp / name / "final" / "model.safetensors").read_bytes()


def test_two_process_training_against_the_server_equals_in_process_main(tiny_model, tmp_path):
    proc, url = serve_reward_process("--fn", "tests.helpers.rewards:hashed", "--max-wait-ms", "20")
    try:
        remote_main = _train(tmp_path, "remote-main", tiny_model, {"url": url, "placement": "main"})
        remote_local = _train(tmp_path, "remote-local", tiny_model, {"url": [url], "placement": "local",
                                                                     "retries": 1})
        import httpx

        health = httpx.get(url + "/health").json()
    finally:
        stop(proc)
    in_process = _train(tmp_path, "in-process", tiny_model, {"fn": "tests.helpers.rewards:hashed",
                                                             "placement": "main"})
    assert remote_main == in_process
    assert remote_local == in_process
    # the server scored every sample of both remote runs exactly once: 2 runs x 2 iterations x 7 rollouts
    assert health["samples"] == 2 * 2 * 7 and health["errors"] == 0
