"""generation.prefill_once in whole runs on 2 processes under fsdp (the prefill runs on the gathered
weights like the rest of generation): 12 rollouts of 3 prompts x G = 4, chunk_size 4, so some chunks
hold a whole group, some part of one. Greedy decoding: the same samples and the same training, within
float tolerance, as with prefill_once off."""

from __future__ import annotations

import pytest

from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import base_config, rallyrl_train, write_config

pytestmark = pytest.mark.dist

COMPARED = ("policy/loss", "value/loss", "policy/grad_norm", "policy/kl", "reward/mean", "value/mean")


def test_prefill_once_runs_as_without_it_under_fsdp(tiny_model, tmp_path):
    runs = {}
    for on in (True, False):
        cfg = base_config(tiny_model, tmp_path / str(on), train={"iterations": 2},
                          rollout={"num_rollouts": 12, "chunk_size": 4, "samples_per_prompt": 4},
                          generation={"do_sample": False, "prefill_once": on},
                          reward={"fn": "tests.helpers.rewards:hashed"})
        cfg["model"]["sharding"] = "fsdp"
        proc = rallyrl_train(write_config(tmp_path / f"{on}.yaml", cfg), 2)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[on] = tmp_path / str(on)
    ra, rb = (read_jsonl(runs[on] / "rollouts.jsonl") for on in (True, False))
    key = lambda rows: [(r["step"], r["index"], r["group"], r["output"]) for r in rows]  # noqa: E731
    assert key(ra) == key(rb) and len(ra) == 24
    ma, mb = (read_jsonl(runs[on] / "metrics.jsonl") for on in (True, False))
    assert [m["step"] for m in ma] == [m["step"] for m in mb] == [1, 2]
    for a, b in zip(ma, mb):
        for k in COMPARED:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (a["step"], k, a[k], b[k])
