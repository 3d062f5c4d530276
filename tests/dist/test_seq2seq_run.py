"""model.arch: seq2seq end to end on 2 processes (tiny local T5): rollouts, the central reward step on
rank 0, PPO, checkpoints, a SIGKILL of every process mid-iteration + resume equal to an uninterrupted run
bit for bit, and final/ loadable with AutoModelForSeq2SeqLM."""


import pytest
import torch
from safetensors.torch import load_file

from rallyrl.run.logs import read_jsonl
from tests.helpers.rewards import deterministic_score
from tests.helpers.runs import base_config, kill_when_paused, rallyrl_train, resume_latest, write_config

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory):
    from rallyrl.testing import build_tiny_t5

    return build_tiny_t5(tmp_path_factory.mktemp("tiny") / "t5")


def _cfg(model, run_dir):
    # 7 rollouts on 2 ranks (4 + 3), chunk_size 2: 2 chunk rounds, so 2 reward calls, per iteration
    cfg = base_config(model, run_dir, train={"iterations": 2}, checkpoint={"interval": 1, "keep_last": 2},
                      reward={"fn": "tests.helpers.rewards:hashed_with_crashes", "placement": "main"})
    cfg["model"]["arch"] = "seq2seq"
    return cfg


def test_seq2seq_two_processes_sigkill_resume_is_bit_identical(tiny_t5, tmp_path):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    calls = tmp_path / "calls.jsonl"
    ref = rallyrl_train(write_config(tmp_path / "a.yaml", _cfg(tiny_t5, tmp_path / "A")), 2,
                        RALLYRL_TEST_CALL_LOG=str(calls))
    assert ref.returncode == 0, ref.stderr[-3000:]
    # the central reward step: rank 0 scored both ranks' samples, one call per chunk round
    assert [(c["rank"], c["n"]) for c in read_jsonl(calls)] == [(0, 4), (0, 3)] * 2
    rows = read_jsonl(tmp_path / "A" / "rollouts.jsonl")
    assert {r["rank"] for r in rows} == {0, 1} and len(rows) == 2 * 7
    for r in rows:  # every sample got its own reward back
        assert r["reward"] == pytest.approx(deterministic_score(r["prompt"], r["output"]), abs=1e-6), r
    ma = read_jsonl(tmp_path / "A" / "metrics.jsonl")
    assert [m["step"] for m in ma] == [1, 2]
    assert ma[0]["policy/kl"] == 0.0 and ma[-1]["policy/kl"] != 0.0  # the policy moved off the reference

    # the same run, every process (CLI, launcher, both ranks) SIGKILLed in reward call 4: the 2nd chunk
    # round of iteration 2, after the step_1 checkpoint
    cfg_b = write_config(tmp_path / "b.yaml", _cfg(tiny_t5, tmp_path / "B"))
    cmd, e = kill_when_paused(cfg_b, 2, tmp_path / "count", pause_at=4)
    assert sorted(p.name for p in (tmp_path / "B" / "checkpoints").iterdir()) == ["step_1"]
    assert [m["step"] for m in read_jsonl(tmp_path / "B" / "metrics.jsonl")] == [1]

    resume_latest(cmd, e)

    a = load_file(tmp_path / "A" / "final" / "model.safetensors")
    b = load_file(tmp_path / "B" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("time/")}  # noqa: E731
    assert [strip(m) for m in read_jsonl(tmp_path / "B" / "metrics.jsonl")] == [strip(m) for m in ma]
    assert read_jsonl(tmp_path / "B" / "rollouts.jsonl") == rows

    # final/ is a plain transformers seq2seq model that moved away from the initial one
    lm = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "B" / "final").eval()
    base = AutoModelForSeq2SeqLM.from_pretrained(tiny_t5).eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "B" / "final")
    x = tok(["the cat sat"], return_tensors="pt")
    start = torch.tensor([[lm.config.decoder_start_token_id]])
    with torch.no_grad():
        got = lm(**x, decoder_input_ids=start).logits
        init = base(**x, decoder_input_ids=start).logits
    assert got.shape == init.shape and not torch.allclose(got, init, atol=1e-5)
