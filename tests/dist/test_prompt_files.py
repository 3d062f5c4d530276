"""Prompts from Arrow files in real 2-process runs: metadata reaches the reward function aligned (the
reward fn asserts `expected_prompt` == the prompt in every call), the eval split of a DatasetDict
folder is used, and a prompt too long for the model raises when an iteration draws it, on every rank,
naming its row."""

from __future__ import annotations

from pathlib import Path

import pytest

from rallyrl.data import PromptSampler
from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import base_config, rallyrl_train, write_config

pytestmark = pytest.mark.dist

PROMPTS = ["the cat", "a dog", "good morning", "what a", "i like", "the sun", "we walk", "birds sing"]


def _cfg(tmp: Path, model: Path, name: str, data: dict) -> Path:
    cfg = base_config(model, tmp / name, data=data, rollout={"num_rollouts": 4, "chunk_size": 2},
                      dist={"timeout_s": 120})
    return write_config(tmp / f"{name}.yaml", cfg)


def test_parquet_prompts_and_a_dataset_dict_eval_split(tiny_model, tmp_path):
    import datasets

    rows = [{"prompt": p, "expected_prompt": p, "id": i} for i, p in enumerate(PROMPTS)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "p.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:1]),
                          "test": datasets.Dataset.from_list(rows[2:5])}).save_to_disk(str(tmp_path / "dd"))
    log = tmp_path / "calls.jsonl"
    proc = rallyrl_train(_cfg(tmp_path, tiny_model, "run", {"prompts": str(tmp_path / "p.parquet"),
                                                            "eval_prompts": str(tmp_path / "dd")}),
                         2, RALLYRL_TEST_CALL_LOG=str(log), HF_DATASETS_CACHE=str(tmp_path / "hf_cache"))
    assert proc.returncode == 0, proc.stderr[-5000:]
    run = tmp_path / "run"
    assert {r["prompt"] for r in read_jsonl(run / "rollouts.jsonl")} <= set(PROMPTS)
    assert {r["prompt"] for r in read_jsonl(run / "eval" / "step_0.jsonl")} == set(PROMPTS[2:5])  # split test
    ids = [i for c in read_jsonl(log) for i in c.get("ids", [])]
    assert set(ids) >= {2, 3, 4}  # the eval split's rows were scored with their metadata


def test_a_too_long_prompt_raises_when_drawn_on_every_rank(tiny_model, tmp_path):
    import datasets

    sampler = PromptSampler(len(PROMPTS), seed=3)  # base_config's seed: what the run draws
    first, second = sampler.next(4), sampler.next(4)
    bad = second[0]  # drawn by iteration 2, not 1
    rows = [{"prompt": ("the cat sat on the mat " * 40) if i == bad else p} for i, p in enumerate(PROMPTS)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "p.parquet"))
    proc = rallyrl_train(_cfg(tmp_path, tiny_model, "run", {"prompts": str(tmp_path / "p.parquet")}), 2,
                         timeout=180, HF_DATASETS_CACHE=str(tmp_path / "hf_cache"))
    assert proc.returncode != 0
    assert f"data.prompts: prompt {bad} has" in proc.stderr and "generation.max_new_tokens" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1]  # iteration 1 ran
