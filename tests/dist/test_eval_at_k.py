"""Evaluation with k samples per prompt on 2 processes (gloo): the k samples of one prompt are generated
on different ranks, and pass@k is still computed per prompt over all of them. The eval prompts are
conversations (rendered with the tokenizer's chat template in every rank and in the launcher's checks)."""

import shutil

import pytest

from rallyrl.evaluation import pass_at_k
from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import base_config, rallyrl_train, write_config

pytestmark = pytest.mark.dist

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_pass_at_k_over_samples_split_between_ranks(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    model = tmp_path / "chat-gpt2"
    shutil.copytree(tiny_model, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(model)
    evals = [{"prompt": [{"role": "user", "content": w}], "id": i} for i, w in enumerate(["the cat", "a dog", "we"])]
    # 3 prompts x k = 2 = 6 eval samples, 3 per rank: rank 0 holds prompt 0 twice and prompt 1 once,
    # rank 1 prompt 1 once and prompt 2 twice. `local` placement: each rank scores (and logs) its own.
    cfg = base_config(model, tmp_path / "run", data={"eval_prompts": evals}, train={"iterations": 0},
                      eval={"samples_per_prompt": 2, "do_sample": True, "metric_fn": "tests.helpers.metrics:coin"},
                      reward={"placement": "local"})
    log = tmp_path / "calls.jsonl"
    proc = rallyrl_train(write_config(tmp_path / "c.yaml", cfg), 2, RALLYRL_TEST_CALL_LOG=str(log))
    assert proc.returncode == 0, proc.stderr[-4000:]

    ids = {r: [i for c in read_jsonl(log) if c["rank"] == r for i in c["ids"]] for r in (0, 1)}
    assert sorted(ids[0]) == [0, 0, 1] and sorted(ids[1]) == [1, 2, 2]  # prompt 1 spans the ranks

    (m,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    samples = read_jsonl(tmp_path / "run" / "eval" / "step_0.jsonl")
    assert sorted((s["index"], s["sample"]) for s in samples) == [(i, j) for i in range(3) for j in range(2)]
    assert all(s["prompt"] == f"<|user|>{evals[s['index']]['prompt'][0]['content']}\n<|assistant|>" for s in samples)
    coins = {i: [s["coin"] for s in samples if s["index"] == i] for i in range(3)}
    assert m["eval/coin@2"] == pytest.approx(sum(map(sum, coins.values())) / 6)
    assert m["eval/coin_pass@2"] == pytest.approx(sum(pass_at_k(2, int(sum(v)), 2) for v in coins.values()) / 3)
    assert "eval/chars@2" not in m and m["eval/chars"] == pytest.approx(sum(s["chars"] for s in samples) / 6)
