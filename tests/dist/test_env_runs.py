"""Multi-turn episodes on 2 processes (gloo): ranks run different numbers of turns (1 to 3 by prompt) and
every collective stays in lock-step; 1 and 2 processes train the same on the same (greedy) episodes; an
environment failure on one rank stops both with the same EpisodeError; SIGKILL mid-run + resume is
bit-identical."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import base_config, kill_when_paused, rallyrl_train, resume_latest, write_config

pytestmark = pytest.mark.dist


def _cfg(model, run_dir, env=None, **sections):
    kw = {"rollout": {"num_rollouts": 6, "chunk_size": 2}, "generation": {"max_new_tokens": 4},
          "ppo": {"epochs": 1, "num_minibatches": 2, "lr": 1e-3, "init_kl_coef": 0.05},
          "env": {"factory": "tests.helpers.envs:Echo", "kwargs": {"turns": 3, "vary": True, **(env or {})}},
          "reward": {"fn": "tests.helpers.rewards:hashed_with_crashes"}}
    for k, v in sections.items():
        kw[k] = {**kw.get(k, {}), **v}
    return base_config(model, run_dir, **kw)


def test_one_and_two_processes_train_the_same_on_the_same_episodes(tiny_chat, tmp_path):
    """One iteration, one minibatch: the same greedy episodes (from the same initial weights) and the same
    update (the loss is normalised over the global minibatch). With more minibatches each rank splits its
    own rows, so 1 and 2 processes would group different episodes per optimizer step; and a second
    iteration is left out: the two sum gradients in a different order, and the tiny random model's
    near-tied logits turn that float rounding into a different greedy token."""
    runs = {}
    for n in (1, 2):
        cfg = _cfg(tiny_chat, tmp_path / f"n{n}", generation={"do_sample": False, "max_new_tokens": 4},
                   env={"turns": 3}, train={"iterations": 1}, ppo={"num_minibatches": 1})
        proc = rallyrl_train(write_config(tmp_path / f"n{n}.yaml", cfg), n)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[n] = tmp_path / f"n{n}"
    rows = {n: sorted(read_jsonl(runs[n] / "rollouts.jsonl"), key=lambda r: (r["step"], r["index"])) for n in runs}
    assert len(rows[1]) == len(rows[2]) == 6
    assert [(r["output"], len(r["episode"]["turns"])) for r in rows[1]] == \
        [(r["output"], len(r["episode"]["turns"])) for r in rows[2]]
    per_rank = {}
    for r in rows[2]:
        per_rank.setdefault(r["rank"], []).append(len(r["episode"]["turns"]))
    assert sum(per_rank[0]) != sum(per_rank[1])  # unequal turns across ranks: the collectives still line up
    assert [r["reward"] for r in rows[2]] == pytest.approx([r["reward"] for r in rows[1]], rel=1e-6)
    a, b = (load_file(runs[n] / "final" / "model.safetensors") for n in (1, 2))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)
    for x, y in zip(*(read_jsonl(runs[n] / "metrics.jsonl") for n in (1, 2))):
        for k in ("episode/turns", "episode/env_token_fraction", "reward/mean", "policy/kl", "value/mean"):
            assert y[k] == pytest.approx(x[k], rel=1e-4, abs=1e-6), k


def test_an_environment_failure_on_one_rank_stops_every_rank(tiny_chat, tmp_path):
    cfg = _cfg(tiny_chat, tmp_path / "run", env={"fail_on_prompt": "t"})
    proc = rallyrl_train(write_config(tmp_path / "f.yaml", cfg), 2, timeout=180)
    assert proc.returncode != 0
    assert "EpisodeError" in proc.stderr and "RuntimeError: the board is broken" in proc.stderr, proc.stderr[-3000:]
    assert "reset()" in proc.stderr and "prompt " in proc.stderr


def test_resume_after_sigkill_is_bit_identical(tiny_chat, tmp_path):
    cfg = lambda run: _cfg(tiny_chat, run, rollout={"num_rollouts": 8, "chunk_size": 2, "samples_per_prompt": 2},  # noqa: E731
                           ppo={"estimator": "grpo", "init_kl_coef": 0.0, "epochs": 1, "num_minibatches": 2},
                           env={"turns": 3}, train={"iterations": 3}, checkpoint={"interval": 1, "keep_last": 2})
    ref = rallyrl_train(write_config(tmp_path / "a.yaml", cfg(tmp_path / "A")), 2)
    assert ref.returncode == 0, ref.stderr[-3000:]
    # 8 samples over 2 ranks, chunk 2: 2 reward calls per iteration, so call 5 is iteration 3's first
    command, e = kill_when_paused(write_config(tmp_path / "b.yaml", cfg(tmp_path / "B")), 2, tmp_path / "calls",
                                  pause_at=5)
    resume_latest(command, e)
    a, b = (load_file(tmp_path / x / "final" / "model.safetensors") for x in ("A", "B"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert read_jsonl(tmp_path / "A" / "rollouts.jsonl") == read_jsonl(tmp_path / "B" / "rollouts.jsonl")
