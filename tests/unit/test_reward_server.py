"""The reward server's ASGI app in-process (FastAPI's TestClient: real routing, real request parsing, no
socket): protocols, batching, security, bad input (with a property-based fuzz: never a 500)."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from rallyrl.reward.server import BadRequest, Batcher, create_app, parse_openrlhf_request, parse_score_request  # noqa: E402
from rallyrl.reward.step import NamedRewardFn, Samples  # noqa: E402
from tests.helpers.rewards import deterministic_score  # noqa: E402


class Recorder:
    """A reward function recording each call's batch size (and optionally slow, failing or dense)."""

    def __init__(self, sleep: float = 0.0) -> None:
        self.calls: list[int] = []
        self.sleep = sleep
        self.fail_on: str | None = None
        self.kwargs: list[dict] = []

    def __call__(self, samples, prompts, outputs, **kwargs):
        self.calls.append(len(samples))
        self.kwargs.append({k: v for k, v in kwargs.items() if k != "tokenizer"})
        if self.sleep:
            time.sleep(self.sleep)
        if self.fail_on is not None and any(self.fail_on in s for s in samples):
            raise ValueError(f"reward model exploded on {self.fail_on!r}")
        if any(s.startswith("dense:") for s in samples):
            return [[0.5] * len(o) for o in outputs]  # one per character: may exceed the token count
        if any(s.startswith("nan:") for s in samples):
            return [float("nan")] * len(samples)
        return [deterministic_score(p, o) for p, o in zip(prompts, outputs)]


def body(prompts, outputs, ids=True, **meta):
    b = {"samples": [p + o for p, o in zip(prompts, outputs)], "prompts": prompts, "outputs": outputs,
         "metadata": meta}
    if ids:
        b["output_token_ids"] = [[1] * max(1, len(o)) for o in outputs]
    return b


@pytest.fixture
def served():
    fn = Recorder()
    batcher = Batcher(NamedRewardFn("rec", fn), max_batch=8, max_wait_ms=50)
    with TestClient(create_app(batcher, token=None, max_body_bytes=4096)) as c:
        yield c, fn, batcher


def test_score_returns_each_samples_reward_and_passes_metadata(served):
    c, fn, _ = served
    r = c.post("/score", json=body(["a", "b"], ["x", "yy"], id=[7, 8]))
    assert r.status_code == 200
    assert r.json() == {"rewards": [deterministic_score("a", "x"), deterministic_score("b", "yy")]}
    assert fn.kwargs[-1] == {"id": [7, 8], "output_token_ids": [[1], [1, 1]]}
    r = c.post("/score", json=body(["dense:p"], ["abc"]))
    assert r.json() == {"rewards": [[0.5, 0.5, 0.5]]}


def test_openrlhf_protocol(served):
    c, fn, _ = served
    r = c.post("/get_reward", json={"query": ["hi there", "yo"], "prompts": ["hi ", "yo"], "labels": ["A", "B"]})
    assert r.status_code == 200
    want = [deterministic_score("hi ", "there"), deterministic_score("yo", "")]
    assert r.json() == {"rewards": want, "scores": want, "extra_logs": {}}
    assert fn.kwargs[-1] == {"labels": ["A", "B"], "output_token_ids": [None, None]}
    r = c.post("/get_reward", json={"query": ["abc"]})  # no prompts: the query is the output
    assert r.json()["rewards"] == [deterministic_score("", "abc")]


def test_health_and_openapi(served):
    c, _, _ = served
    h = c.get("/health").json()
    assert h["status"] == "ok" and h["reward_fn"] == "rec" and h["max_batch"] == 8
    schema = c.get("/openapi.json").json()
    assert {"/health", "/score", "/get_reward"} <= set(schema["paths"])
    req = schema["paths"]["/score"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(req["required"]) == {"samples", "prompts", "outputs"}


@pytest.mark.parametrize("raw, status, field", [
    (b"{not json", 400, "body"),
    (b"[1, 2]", 422, "body"),
    (json.dumps({"prompts": ["a"], "outputs": ["b"]}).encode(), 422, "samples"),
    (json.dumps({"samples": "ab", "prompts": ["a"], "outputs": ["b"]}).encode(), 422, "samples"),
    (json.dumps({"samples": ["ab", 3], "prompts": ["a", "b"], "outputs": ["b", ""]}).encode(), 422, "samples[1]"),
    (json.dumps({"samples": ["ab"], "prompts": ["a", "x"], "outputs": ["b"]}).encode(), 422, "prompts"),
    (json.dumps({"samples": ["ab"], "prompts": ["a"], "outputs": ["c"]}).encode(), 422, "samples[0]"),
    (json.dumps({**body(["a"], ["b"]), "metadata": {"id": [1, 2]}}).encode(), 422, "metadata.id"),
    (json.dumps({**body(["a"], ["b"]), "metadata": {"tokenizer": [1]}}).encode(), 422, "metadata.tokenizer"),
    (json.dumps({**body(["a"], ["b"]), "output_token_ids": [[1, True]]}).encode(), 422, "output_token_ids[0]"),
    (json.dumps({**body(["a"], ["b"]), "extra": 1}).encode(), 422, "extra"),
])
def test_bad_input_is_a_4xx_naming_the_field(served, raw, status, field):
    c, fn, _ = served
    r = c.post("/score", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert r.json()["field"] == field and field in r.json()["error"]
    assert fn.calls == []


def test_openrlhf_bad_input(served):
    c, _, _ = served
    r = c.post("/get_reward", json={"query": ["abc"], "prompts": ["x"]})
    assert r.status_code == 422 and r.json()["field"] == "query[0]"
    r = c.post("/get_reward", json={"query": ["abc"], "labels": [1, 2]})
    assert r.status_code == 422 and r.json()["field"] == "labels"


def test_reward_fn_error_is_a_500_with_its_message_and_the_server_keeps_serving(served):
    c, fn, batcher = served
    fn.fail_on = "BOOM"
    r = c.post("/score", json=body(["BOOM"], ["x"]))
    assert r.status_code == 500 and "reward model exploded on 'BOOM'" in r.json()["error"]
    r = c.post("/score", json=body(["nan:"], ["x"]))  # invalid output: the same validation as in-process
    assert r.status_code == 500 and "rewards must be finite" in r.json()["error"]
    r = c.post("/score", json=body(["dense:"], ["x"], ids=False))  # no ids: dense length not checkable here
    assert r.status_code == 200
    r = c.post("/score", json={**body(["dense:"], ["abc"]), "output_token_ids": [[1]]})
    assert r.status_code == 500 and "dense reward has 3 values but the output has only 1 tokens" in r.text
    r = c.post("/score", json=body(["a"], ["b"]))
    assert r.status_code == 200 and batcher.stats.errors == 3


def test_body_over_the_limit_gets_413_without_being_read(served):
    c, fn, _ = served
    big = json.dumps(body(["a" * 5000], ["b"])).encode()
    r = c.post("/score", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "4096" in r.json()["error"]

    reads = []

    def chunks():  # no Content-Length (chunked): refused while streaming, before the generator is drained
        for i in range(100):
            reads.append(i)
            yield b" " * 1024
    r = c.post("/score", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert fn.calls == []


def test_token_is_required_when_set():
    fn = Recorder()
    with TestClient(create_app(Batcher(NamedRewardFn("rec", fn)), token="s3cret")) as c:
        ok = body(["a"], ["b"])
        assert c.post("/score", json=ok).status_code == 401
        r = c.post("/score", json=ok, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert c.post("/get_reward", json={"query": ["a"]}, headers={"Authorization": "Basic s3cret"}).status_code == 401
        assert c.post("/score", json=ok, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/health").status_code == 200  # probes need no token
        assert fn.calls == [1]


def test_concurrent_requests_are_merged_and_each_gets_its_own():
    fn = Recorder(sleep=0.2)  # while the first call runs, the others queue and are merged
    batcher = Batcher(NamedRewardFn("rec", fn), max_batch=64, max_wait_ms=20)
    results: dict[int, list] = {}
    with TestClient(create_app(batcher)) as c:
        def client(k: int) -> None:
            prompts = [f"c{k}-{i}" for i in range(k + 1)]
            outputs = [f"o{i}" for i in range(k + 1)]
            results[k] = (c.post("/score", json=body(prompts, outputs)).json()["rewards"], prompts, outputs)
        threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for k, (got, prompts, outputs) in results.items():
        assert got == [deterministic_score(p, o) for p, o in zip(prompts, outputs)]
    assert sum(fn.calls) == sum(range(1, 7)) and len(fn.calls) < 6  # fewer calls than requests


def test_batcher_respects_max_batch_and_keeps_order():
    fn = Recorder(sleep=0.05)
    b = Batcher(NamedRewardFn("rec", fn), max_batch=5, max_wait_ms=100)
    futs = []
    for k in range(6):  # 6 requests of 2 samples: batches of at most 5 samples (2+2), never split
        futs.append((k, b.submit(Samples([f"p{k}a", f"p{k}b"], ["x", "y"], [[1], [1]], [{}, {}]))))
    try:
        for k, f in futs:
            assert f.result(timeout=30) == [deterministic_score(f"p{k}a", "x"), deterministic_score(f"p{k}b", "y")]
    finally:
        b.stop()
    assert all(n <= 5 and n % 2 == 0 for n in fn.calls) and sum(fn.calls) == 12
    big = Batcher(NamedRewardFn("rec", fn), max_batch=3, max_wait_ms=0)
    try:  # one request larger than max_batch: scored in calls of max_batch
        fn.calls.clear()
        f = big.submit(Samples([str(i) for i in range(7)], [""] * 7, [[1]] * 7, [{}] * 7))
        assert f.result(timeout=30) == [deterministic_score(str(i), "") for i in range(7)]
        assert fn.calls == [3, 3, 1]
    finally:
        big.stop()


def test_no_batching_scores_each_request_alone():
    fn = Recorder(sleep=0.05)
    b = Batcher(NamedRewardFn("rec", fn), max_batch=64, max_wait_ms=50, batching=False)
    futs = [b.submit(Samples([f"p{k}"], ["x"], [[1]], [{}])) for k in range(4)]
    try:
        for f in futs:
            f.result(timeout=30)
    finally:
        b.stop()
    assert fn.calls == [1, 1, 1, 1]


def test_parsers_directly():
    s = parse_score_request(json.dumps(body(["a"], ["b"], k=["v"])).encode())
    assert (s.prompts, s.outputs, s.metadata, s.output_token_ids) == (["a"], ["b"], [{"k": "v"}], [[1]])
    with pytest.raises(BadRequest, match="query"):
        parse_openrlhf_request(b'{"prompts": ["a"]}')


# ------------------------------------------------------------------------------------------------
# Fuzz: arbitrary JSON (and arbitrary bytes) never gets a 500

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=12,
)
keys = st.sampled_from(["samples", "prompts", "outputs", "metadata", "output_token_ids", "query", "labels", "x"])
near_valid = st.fixed_dictionaries({}, optional={
    "samples": st.lists(st.text(max_size=4), max_size=3) | json_values,
    "prompts": st.lists(st.text(max_size=2), max_size=3) | json_values,
    "outputs": st.lists(st.text(max_size=2), max_size=3) | json_values,
    "query": st.lists(st.text(max_size=4), max_size=3) | json_values,
    "metadata": st.dictionaries(st.text(max_size=3), st.lists(json_values, max_size=3), max_size=2) | json_values,
    "output_token_ids": st.lists(st.lists(st.integers(0, 9), max_size=3), max_size=3) | json_values,
    "labels": st.lists(json_values, max_size=3) | json_values,
})
payloads = (st.dictionaries(keys, json_values, max_size=5).map(lambda d: json.dumps(d).encode())
            | near_valid.map(lambda d: json.dumps(d).encode())
            | json_values.map(lambda v: json.dumps(v).encode())
            | st.binary(max_size=64))


@pytest.fixture(scope="module")
def fuzz_client():
    fn = Recorder()
    with TestClient(create_app(Batcher(NamedRewardFn("rec", fn), max_wait_ms=0), max_body_bytes=2048)) as c:
        yield c


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=payloads, path=st.sampled_from(["/score", "/get_reward"]))
def test_fuzz_no_500_on_bad_input(fuzz_client, raw, path):
    r = fuzz_client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code in (200, 400, 413, 422), (r.status_code, r.text, raw)
    if r.status_code != 200:
        assert r.json()["field"] is not None and r.json()["error"]


def test_the_clients_413_names_reward_batch_size_and_max_body_mb(served):
    """What the trainer reports when a batch is over the server's body limit: the two settings to change."""
    from rallyrl.reward.client import RemoteReward, RemoteRewardError

    c, fn, _ = served
    remote = RemoteReward("http://testserver", retries=2, backoff_s=0.0)
    remote._client = c  # FastAPI's TestClient is an httpx.Client: the real request path, no socket
    prompts, outputs = ["a" * 3000, "b" * 3000], ["x", "y"]
    with pytest.raises(RemoteRewardError) as e:
        remote([p + o for p, o in zip(prompts, outputs)], prompts, outputs, output_token_ids=[[1], [2]])
    msg = str(e.value)
    assert "HTTP 413" in msg and "4096 bytes" in msg and "2 sample(s)" in msg, msg
    assert "lower reward.batch_size" in msg and "--max-body-mb" in msg, msg
    assert len(remote.failed_attempts) == 0 and fn.calls == []  # not retried: the same body cannot fit
