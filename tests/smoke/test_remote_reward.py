"""RemoteReward against REAL servers on random loopback ports (uvicorn; only 127.0.0.1 traffic): every
failure a network gives is either recovered by the retries or ends with an error naming the URL and the
last failure; several servers share one batch without a reward ever landing on another sample."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("fastapi")

from rallyrl.reward import RemoteReward, RemoteRewardError  # noqa: E402
from tests.helpers.reward_servers import ScriptedServer, free_socket, serve_reward_process, stop  # noqa: E402
from tests.helpers.rewards import deterministic_score  # noqa: E402

pytestmark = pytest.mark.smoke

PROMPTS = [f"p{i} " for i in range(10)]
OUTPUTS = [f"out {i}" * (i % 3 + 1) for i in range(10)]
IDS = [[1] * (i + 1) for i in range(10)]
WANT = [deterministic_score(p, o) for p, o in zip(PROMPTS, OUTPUTS)]


def call(fn, n=10, **meta):
    return fn([p + o for p, o in zip(PROMPTS[:n], OUTPUTS[:n])], PROMPTS[:n], OUTPUTS[:n],
              output_token_ids=IDS[:n], tokenizer=object(), **meta)


def fast(url, **kw) -> RemoteReward:
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("dead_s", 0.05)
    return RemoteReward(url, **kw)


def test_connection_refused_ends_with_the_url_and_the_cause():
    sock = free_socket()  # bound, never listening: connections are refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        with pytest.raises(RemoteRewardError) as e:
            call(fast(url, retries=2))
    finally:
        sock.close()
    msg = str(e.value)
    assert f"{url}/score" in msg and "3 attempt(s)" in msg and "ConnectError" in msg


@pytest.mark.parametrize("mode, cause", [("500", "HTTP 500: scripted failure"),
                                         ("badjson", "not valid JSON"),
                                         ("wrongcount", "sent 10 samples, got 9 rewards back")])
def test_bad_answers_are_retried_then_reported(mode, cause):
    with ScriptedServer([mode, mode]) as srv:  # two bad answers, then good ones
        assert call(fast(srv.url, retries=2)) == WANT
        assert [r["mode"] for r in srv.requests] == [mode, mode, "ok"]
    with ScriptedServer(default=mode) as srv:  # never good
        with pytest.raises(RemoteRewardError) as e:
            call(fast(srv.url, retries=1))
        assert f"{srv.url}/score" in str(e.value) and cause in str(e.value) and "2 attempt(s)" in str(e.value)
        assert len(srv.requests) == 2


def test_a_stall_past_the_timeout_is_retried():
    with ScriptedServer(["stall"], stall_s=5) as srv:
        t0 = time.monotonic()
        assert call(fast(srv.url, timeout_s=0.5, retries=1)) == WANT
        assert time.monotonic() - t0 < 4  # did not wait for the stalled answer
    with ScriptedServer(default="stall", stall_s=5) as srv:
        with pytest.raises(RemoteRewardError, match=r"no answer within timeout_s=0.5"):
            call(fast(srv.url, timeout_s=0.5, retries=1))


def test_non_finite_rewards_are_rejected_by_the_same_validation():
    with ScriptedServer(default="nan") as srv:
        with pytest.raises(RemoteRewardError, match=r"sample 0: reward is nan \(rewards must be finite\)"):
            call(fast(srv.url))


def test_what_is_sent_rallyrl_and_openrlhf_protocols_and_token(monkeypatch):
    monkeypatch.setenv("RALLYRL_REWARD_TOKEN", "tok")
    with ScriptedServer() as srv:
        assert call(fast(srv.url), n=3, id=[1, 2, 3]) == WANT[:3]
        (req,) = srv.requests
        assert req["auth"] == "Bearer tok"
        assert req["body"] == {"samples": [p + o for p, o in zip(PROMPTS[:3], OUTPUTS[:3])], "prompts": PROMPTS[:3],
                               "outputs": OUTPUTS[:3], "metadata": {"id": [1, 2, 3]}, "output_token_ids": IDS[:3]}
        assert call(fast(srv.url + "/get_reward", protocol="openrlhf"), n=2, labels=["x", "y"]) == WANT[:2]
        assert srv.requests[-1]["body"] == {"query": [p + o for p, o in zip(PROMPTS[:2], OUTPUTS[:2])],
                                            "prompts": PROMPTS[:2], "labels": ["x", "y"]}


def test_a_refused_request_is_not_retried(tmp_path):
    proc, url = serve_reward_process("--fn", "tests.helpers.rewards:hashed", RALLYRL_REWARD_TOKEN="right")
    try:
        with pytest.raises(RemoteRewardError, match=r"HTTP 401: .*bearer token.*not retried"):
            call(fast(url, token="wrong", retries=3))
        assert call(fast(url, token="right")) == WANT
    finally:
        stop(proc)


def test_several_servers_share_a_batch_skip_a_dead_one_and_reassemble_in_order():
    dead = free_socket()
    dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"
    try:
        with ScriptedServer() as a, ScriptedServer(["500", "500", "500"]) as b:
            # one part (1 sample): the first least-loaded server is the dead one; it fails, is marked
            # dead, and the part goes to `a`
            fn = fast([dead_url, a.url], retries=2, dead_s=60)
            assert call(fn, n=1) == WANT[:1]
            assert len(fn.failed_attempts) == 1 and fn.failed_attempts[0].startswith(dead_url)
            assert [r["n"] for r in a.requests] == [1]
            # now it is skipped (dead for 60 s): the whole batch goes to the live server at once
            assert call(fn) == WANT
            assert [r["n"] for r in a.requests] == [1, 10] and len(fn.failed_attempts) == 1
            # a batch split over two servers, one of which fails three times: reassembled in order, and
            # every sample was scored exactly once by an answer that was used
            a.requests.clear()
            fn = fast([a.url, b.url], retries=4)
            assert call(fn) == WANT
            scored = [p for s in (a, b) for r in s.requests if r["mode"] == "ok" for p in r["prompts"]]
            assert sorted(scored) == sorted(PROMPTS)
    finally:
        dead.close()


def test_least_loaded_first_splits_evenly_over_live_servers():
    with ScriptedServer() as a, ScriptedServer() as b:
        fn = fast([a.url, b.url])
        assert call(fn) == WANT
        assert sorted(r["n"] for r in a.requests + b.requests) == [5, 5]
        assert [p for r in a.requests + b.requests for p in r["prompts"]] in (PROMPTS, PROMPTS[5:] + PROMPTS[:5])


def test_server_killed_mid_call_and_restarted_is_recovered_by_the_retries():
    args = ("--fn", "tests.helpers.rewards:hashed_slow")
    proc, url = serve_reward_process(*args, RALLYRL_TEST_REWARD_SLEEP="1.0")
    port = int(url.rsplit(":", 1)[1])
    result: dict = {}
    fn = RemoteReward(url, timeout_s=20, retries=8, backoff_s=0.3, dead_s=0.1)

    def run() -> None:
        try:
            result["rewards"] = call(fn)
        except Exception as e:  # reported by the assertion below
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.4)  # the request is inside the 1 s reward call
    proc.kill()
    proc.wait()
    time.sleep(0.5)
    proc2, _ = serve_reward_process(*args, port=port, RALLYRL_TEST_REWARD_SLEEP="0.1")
    try:
        t.join(timeout=60)
        assert not t.is_alive()
        assert result.get("rewards") == WANT, result
        assert fn.failed_attempts and all(f.startswith(url) for f in fn.failed_attempts)  # it did fail first
    finally:
        stop(proc2)


def test_serve_reward_model_matches_the_in_process_classifier(tiny_model, tmp_path):
    """`serve-reward --model DIR --label POS` is the built-in hf_classifier: same scores as in-process."""
    from rallyrl.reward import hf_classifier
    from tests.helpers.rewards import build_tiny_classifier

    rm = build_tiny_classifier(tmp_path / "rm", tiny_model)
    proc, url = serve_reward_process("--model", str(rm), "--label", "POS", "--device", "cpu")
    try:
        got = call(fast(url), n=6)
    finally:
        stop(proc)
    want = hf_classifier(str(rm), label="POS")([p + o for p, o in zip(PROMPTS[:6], OUTPUTS[:6])], PROMPTS[:6],
                                               OUTPUTS[:6])
    assert got == want
