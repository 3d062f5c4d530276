"""Reward functions used by the tests (importable as `tests.helpers.rewards:NAME`)."""

import hashlib
import json
import os


def deterministic_score(prompt: str, output: str) -> float:
    """A score that depends on exactly this (prompt, output) pair, so a mixed-up scatter is visible."""
    h = hashlib.sha256(f"{prompt}\x00{output}".encode()).digest()
    return int.from_bytes(h[:4], "little") / 2**32


def hashed(samples, prompts, outputs, **kwargs):
    log = os.environ.get("RALLYRL_TEST_CALL_LOG")
    if log:  # record who called the reward function and with how many samples
        with open(log, "a") as f:
            f.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), "n": len(samples),
                                "pid": os.getpid()}) + "\n")
    assert all(s == p + o for s, p, o in zip(samples, prompts, outputs))
    return [deterministic_score(p, o) for p, o in zip(prompts, outputs)]


def count_e(samples, prompts, outputs, **kwargs):
    return [o.count("e") / (1.0 + len(o)) for o in outputs]


def hashed_with_crashes(samples, prompts, outputs, **kwargs):
    """`hashed`, plus crash injection for the resume tests (driven by environment variables):

    RALLYRL_TEST_PAUSE_AT=N   on the N-th call (counted in RALLYRL_TEST_COUNTER), create
                              RALLYRL_TEST_COUNTER + ".paused" and block, so the test can SIGKILL every
                              process in the middle of an iteration -- once (the marker stays).
    RALLYRL_TEST_KILL_RANK=R  rank R SIGKILLs itself on its first call.
    """
    import signal

    rank = int(os.environ.get("RANK", "0"))
    if os.environ.get("RALLYRL_TEST_KILL_RANK") == str(rank):
        os.kill(os.getpid(), signal.SIGKILL)
    at = os.environ.get("RALLYRL_TEST_PAUSE_AT")
    if at:
        counter = os.environ["RALLYRL_TEST_COUNTER"]
        n = (int(open(counter).read()) if os.path.exists(counter) else 0) + 1
        with open(counter, "w") as f:
            f.write(str(n))
        if n == int(at) and not os.path.exists(counter + ".paused"):
            open(counter + ".paused", "w").close()
            import time

            time.sleep(600)  # the test kills us here
    return hashed(samples, prompts, outputs, **kwargs)
