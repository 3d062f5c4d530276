"""reward.url & co. in the config, resolve_reward_fns building a RemoteReward, `import rallyrl` staying
light, and the serve-reward command line's own errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rallyrl.config import ConfigError, load_config
from rallyrl.reward.loading import resolve_reward_fns
from tests.helpers.runs import ROOT, env


def test_reward_url_builds_a_remote_reward():
    cfg = load_config({"reward": {"url": ["http://127.0.0.1:1", "http://127.0.0.1:2/"], "timeout_s": 5,
                                  "retries": 0, "protocol": "openrlhf", "overlap": True}})
    (nf,) = resolve_reward_fns(cfg.reward)
    from rallyrl import RemoteReward

    assert nf.name == "remote" and isinstance(nf.fn, RemoteReward)
    assert nf.fn.urls == ["http://127.0.0.1:1/get_reward", "http://127.0.0.1:2/get_reward"]
    assert (nf.fn.timeout_s, nf.fn.retries, nf.fn.protocol) == (5.0, 0, "openrlhf")


@pytest.mark.parametrize("reward, message", [
    ({"url": "http://h:1", "fn": "a:b"}, "set either reward.url or reward.fn, not both"),
    ({"url": "http://h:1", "fns": [{"fn": "a:b"}]}, "set either reward.url or reward.fns, not both"),
    ({"url": "http://h:1", "kwargs": {"a": 1}}, "reward.kwargs is for reward.fn"),
    ({"url": "h:1"}, r"reward.url: 'h:1' must look like http://host:port"),
    ({"url": ["http://h:1", "tcp://x"]}, r"reward.url\[1\]: 'tcp://x'"),
    ({"url": []}, "the list of URLs is empty"),
    ({"url": 5}, r"reward.url: expected str \| list\[str\] \| null"),
    ({"url": "http://h:1", "placement": "collective"}, "main or local, not collective"),
    ({"url": "http://h:1", "timeout_s": 0}, "reward.timeout_s must be > 0"),
    ({"url": "http://h:1", "retries": -1}, "reward.retries must be >= 0"),
    ({"url": "http://h:1", "protocol": "grpc"}, r"reward.protocol: expected one of \['rallyrl', 'openrlhf'\]"),
    ({"fn": "a:b", "overlap": True}, r"reward.overlap needs reward.url \(or reward.server: local\) and "
                                     r"reward.placement main"),
    ({"url": "http://h:1", "placement": "local", "overlap": True}, "reward.overlap needs"),
    ({"fn": "a:b", "server": "remote"}, r"reward.server: expected one of \['none', 'local'\]"),
    ({"fn": "a:b", "server_args": ["--max-batch", "8"]}, "reward.server_args is for reward.server: local"),
    ({"url": "http://h:1", "server": "local"}, "reward.server: local starts the server and picks its URL"),
    ({"fns": [{"fn": "a:b"}], "server": "local"}, "reward.server: local serves one function: set reward.fn"),
    ({"server": "local"}, "reward.server: local needs reward.fn"),
    ({"fn": "a:b", "server": "local", "placement": "local"}, "reward.server: local needs reward.placement main, "
                                                             "not 'local'"),
    ({"fn": "a:b", "server": "local", "server_args": ["--port", "80"]}, "reward.server_args: --port is set by rallyrl"),
    ({"fn": "a:b", "server": "local", "server_args": ["--fn=x:y"]}, "reward.server_args: --fn is set by rallyrl"),
    ({"fn": "a:b", "server": "local", "server_args": ["--workers", "2"]}, "reward.server_args: unknown option "
                                                                          "'--workers'"),
    ({"fn": "a:b", "server": "local", "server_args": ["--max-wait-ms"]}, "--max-wait-ms needs a value"),
])
def test_bad_remote_reward_config_names_the_key(reward, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"reward": reward})


def test_reward_server_local_config():
    cfg = load_config({"reward": {"fn": "tests.helpers.rewards:hashed", "server": "local", "overlap": True,
                                  "server_args": ["--max-wait-ms", "20", "--no-batching", "--max-batch=8"]}})
    (nf,) = resolve_reward_fns(cfg.reward)  # the function is imported (checked) here; the server serves it
    assert nf.name == "hashed"
    with pytest.raises(ConfigError, match="a reward_fn passed to train\\(\\) cannot be sent there"):
        resolve_reward_fns(cfg.reward, lambda s, p, o, **kw: [0.0] * len(s))


def test_overlap_refuses_an_in_process_reward_fn_from_the_python_api(tiny_model):
    from rallyrl.inputs import prepare_inputs

    cfg = load_config({"model": {"path": str(tiny_model)}, "data": {"prompts": ["a", "b"]},
                       "rollout": {"num_rollouts": 2, "chunk_size": 2},
                       "reward": {"url": "http://127.0.0.1:9", "overlap": True}})
    with pytest.raises(ConfigError, match=r"reward.overlap needs remote reward functions .*\['<lambda>'\]"):
        prepare_inputs(cfg, 1, reward_fn=lambda s, p, o, **kw: [0.0] * len(s))


def test_import_rallyrl_stays_free_of_torch_and_httpx():
    code = ("import sys, rallyrl, rallyrl.reward.server, rallyrl.reward.client; "
            "bad = [m for m in ('torch', 'httpx', 'fastapi', 'uvicorn') if m in sys.modules]; "
            "assert not bad, bad; print(rallyrl.RemoteReward.__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "RemoteReward", out.stderr


@pytest.mark.parametrize("args, message", [
    (["--fn", "nope"], "--fn: 'nope' must look like"),
    (["--fn", "tests.helpers.rewards:hashed", "--device", "cuda:0"], "--label and --device are options of --model"),
    (["--fn", "tests.helpers.rewards:hashed", "--kwargs", "[1]"], "--kwargs must be a JSON object"),
    (["--fn", "tests.helpers.rewards:make_failing", "--kwargs", "{bad"], "--kwargs is not valid JSON"),
    (["--fn", "tests.helpers.rewards:hashed", "--max-batch", "0"], "--max-batch must be >= 1"),
    (["--fn", "tests.helpers.rewards:hashed", "--port", "70000"], r"--port must be in \[0, 65535\]"),
    (["--model", "/nonexistent/rm"], "hf_classifier: cannot read the model config at /nonexistent/rm"),
])
def test_serve_reward_command_line_errors(args, message, capsys):
    from rallyrl.cli import main

    assert main(["serve-reward", *args]) == 2
    err = capsys.readouterr().err
    assert "rallyrl serve-reward: error:" in err
    import re

    assert re.search(message, err), err


def test_reward_timeout_bounds_an_in_process_call_and_keeps_the_rng():
    import time

    from rallyrl.reward import NamedRewardFn, RewardError, RewardStep, Samples
    from rallyrl.seeding import get_rng_state
    from tests.helpers.rewards import draw_from_global_rngs

    def slow(samples, prompts, outputs, **kw):
        time.sleep(3)
        return [0.0] * len(samples)

    def noisy(samples, prompts, outputs, **kw):
        draw_from_global_rngs()  # on the helper thread, inside isolated_rng
        return [float(len(o)) for o in outputs]

    s = Samples(["a", "b"], ["x", "yy"], [[1], [1, 2]], [{}, {}])
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"RewardTimeoutError: reward function 'slow' did not return within "
                                          r"reward.timeout_s=0.2 s"):
        RewardStep([NamedRewardFn("slow", slow)], "main", timeout_s=0.2)(s)
    assert time.perf_counter() - t0 < 2.5
    before = get_rng_state()
    rewards, _ = RewardStep([NamedRewardFn("noisy", noisy)], "local", timeout_s=10)(s)
    after = get_rng_state()
    assert [r.score for r in rewards] == [1.0, 2.0]
    assert before["python"] == after["python"] and (before["torch"] == after["torch"]).all()
    with pytest.raises(ValueError, match="reward.timeout_s must be > 0"):
        RewardStep([NamedRewardFn("noisy", noisy)], timeout_s=0)
