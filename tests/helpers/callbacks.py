"""Callbacks for the multi-process callback tests (tests/helpers/train_worker.py, RALLYRL_TEST_CALLBACKS).
Each call is recorded in ``$RALLYRL_TEST_CALLBACK_LOG`` with the rank it ran on."""

from __future__ import annotations

import json
import os


def _record(**row) -> None:
    with open(os.environ["RALLYRL_TEST_CALLBACK_LOG"], "a") as f:
        f.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), **row}) + "\n")


class StopAt2:
    def on_iteration(self, step, metrics):
        _record(hook="on_iteration", step=step)
        return "stop" if step == 2 else None


class Explodes:
    def on_iteration(self, step, metrics):
        raise RuntimeError(f"no luck at {step}")


def stop_at_2() -> list:
    return [StopAt2()]


def explodes() -> list:
    return [Explodes()]
