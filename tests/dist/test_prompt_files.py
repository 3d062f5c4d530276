"""Prompts from Arrow files in real 2-process runs: metadata reaches the reward function aligned (the
reward fn asserts `expected_prompt` == the prompt in every call), the eval split of a DatasetDict
folder is used, and a prompt too long for the model is skipped by default (a resumed run skips it the
same) or, with data.long_prompts: error, refused at start naming its row."""

from __future__ import annotations

from pathlib import Path

import pytest

from rallyrl.data import PromptSampler
from rallyrl.tracking import read_jsonl
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


def _long_rows(tmp_path: Path, long: set[int]) -> str:
    import datasets

    rows = [{"prompt": ("the cat sat on the mat " * 40) + p if i in long else p} for i, p in enumerate(PROMPTS)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "p.parquet"))
    return str(tmp_path / "p.parquet")


def test_long_rows_are_skipped_by_default_and_a_resumed_run_skips_them_the_same(tiny_model, tmp_path):
    """Issue 28: a long row no longer stops a run mid-training. The default (data.long_prompts: skip)
    trains past it (every iteration full, the row never trained on, counted, said once), and a run
    resumed from a checkpoint taken after skips draws exactly what the uninterrupted run drew."""
    import torch
    from safetensors.torch import load_file

    from tests.helpers.runs import killed_run_copy

    long = set(PromptSampler(len(PROMPTS), seed=3).next(2))  # base_config's seed: iteration 1 draws both
    data = {"prompts": _long_rows(tmp_path, long)}

    def cfg(name: str) -> Path:
        c = base_config(tiny_model, tmp_path / name, data=data, rollout={"num_rollouts": 4, "chunk_size": 2},
                        train={"iterations": 3}, checkpoint={"interval": 1, "keep_last": 3}, dist={"timeout_s": 120})
        return write_config(tmp_path / f"{name}.yaml", c)

    env = {"HF_DATASETS_CACHE": str(tmp_path / "hf_cache")}
    a = rallyrl_train(cfg("A"), 2, timeout=300, **env)
    assert a.returncode == 0, a.stderr[-5000:]
    assert a.stderr.count("rallyrl: note: data.prompts: prompt") == 1  # rank 0, once
    assert "skipped (data.long_prompts: skip)" in a.stderr
    metrics = read_jsonl(tmp_path / "A" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3] and metrics[0]["data/skipped_prompts"] == 2
    rollouts = read_jsonl(tmp_path / "A" / "rollouts.jsonl")
    assert [sum(r["step"] == s for r in rollouts) for s in (1, 2, 3)] == [4, 4, 4]
    assert {r["prompt"] for r in rollouts} <= {p for i, p in enumerate(PROMPTS) if i not in long}

    killed_run_copy(tmp_path / "A", tmp_path / "B", step=1)  # killed after iteration 1's checkpoint
    b = rallyrl_train(cfg("B"), 2, "--set", "train.resume=latest", timeout=300, **env)
    assert b.returncode == 0, b.stderr[-5000:]
    wa, wb = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("A", "B"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("time/")}  # noqa: E731
    assert [strip(m) for m in read_jsonl(tmp_path / "B" / "metrics.jsonl")] == [strip(m) for m in metrics]
    assert read_jsonl(tmp_path / "B" / "rollouts.jsonl") == rollouts


def test_long_prompts_error_refuses_at_start_naming_the_row(tiny_model, tmp_path):
    long = {5, 2}
    data = {"prompts": _long_rows(tmp_path, long), "long_prompts": "error"}
    proc = rallyrl_train(_cfg(tmp_path, tiny_model, "run", data), 2, timeout=180,
                         HF_DATASETS_CACHE=str(tmp_path / "hf_cache"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "data.prompts: prompt 2 has" in proc.stderr and "generation.max_new_tokens" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any iteration (or model)
