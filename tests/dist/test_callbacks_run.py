"""Callbacks on 2 processes (issue 20 item 4): they run on rank 0 only; its "stop" ends the run on both
ranks after the same iteration (exit 0, final/ written); a callback that raises ends both ranks with the
same CallbackError naming it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import ROOT, base_config, env, write_config

pytestmark = pytest.mark.dist


def _torchrun(tmp, cfg, factory):
    out = tmp / "ranks"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "helpers" / "train_worker.py"), str(write_config(tmp / "c.yaml", cfg)), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env=env(RALLYRL_TEST_CALLBACKS=f"tests.helpers.callbacks:{factory}",
                                  RALLYRL_TEST_CALLBACK_LOG=str(tmp / "calls.jsonl")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_rank_0_decides_and_both_ranks_stop_after_the_same_iteration(tiny_model, tmp_path):
    cfg = base_config(tiny_model, tmp_path / "run", train={"iterations": 4})
    ranks = _torchrun(tmp_path, cfg, "stop_at_2")
    assert [r["ok"] for r in ranks] == [True, True], ranks
    calls = read_jsonl(tmp_path / "calls.jsonl")
    assert [(c["rank"], c["step"]) for c in calls] == [(0, 1), (0, 2)]  # rank 0 only
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    assert {r["step"] for r in read_jsonl(tmp_path / "run" / "rollouts.jsonl")} == {1, 2}  # rank 1 stopped too
    assert "2 of 4 (stopped early by the callback StopAt2.on_iteration)" in \
        (tmp_path / "run" / "final" / "README.md").read_text()


def test_a_raising_callback_stops_every_rank_with_its_name(tiny_model, tmp_path):
    cfg = base_config(tiny_model, tmp_path / "run", train={"iterations": 4})
    ranks = _torchrun(tmp_path, cfg, "explodes")
    assert [(r["ok"], r["type"]) for r in ranks] == [(False, "CallbackError")] * 2, ranks
    assert ranks[0]["message"] == ranks[1]["message"] == \
        "callback Explodes.on_iteration raised at iteration 1: RuntimeError: no luck at 1"
