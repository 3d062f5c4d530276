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
