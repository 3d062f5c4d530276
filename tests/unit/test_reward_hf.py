"""`rallyrl.reward.hf_classifier`: lazy loading, label resolution, logit/prob, text choice, batching."""

import pytest
import torch
from transformers import AutoTokenizer, GPT2ForSequenceClassification

import rallyrl
from rallyrl.reward import HFClassifierError, HFClassifierReward, hf_classifier
from rallyrl.reward.loading import RewardFactoryError
from rallyrl.reward.loading import resolve_reward_fns
from tests.helpers.rewards import build_tiny_classifier

PROMPTS = ["the cat", "a dog", "good morning to", "we"]
OUTPUTS = [" sat on the mat", " ran", " you", " walk home slowly today"]
SAMPLES = [p + o for p, o in zip(PROMPTS, OUTPUTS)]


@pytest.fixture(scope="module")
def clf(tiny_model, tmp_path_factory):
    return build_tiny_classifier(tmp_path_factory.mktemp("clf") / "clf", tiny_model)


def manual_logits(path, texts):
    """Reference: the plain transformers forward, one text at a time (no padding at all)."""
    tok = AutoTokenizer.from_pretrained(path)
    model = GPT2ForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return torch.cat([model(**tok([t], return_tensors="pt")).logits for t in texts])  # (N, 2)


@pytest.fixture
def count_loads(monkeypatch):
    import transformers

    loads = []
    orig = transformers.AutoModelForSequenceClassification.from_pretrained.__func__

    def counting(cls, *a, **kw):
        loads.append(a[0] if a else kw)
        return orig(cls, *a, **kw)

    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_pretrained", classmethod(counting))
    return loads


def test_loads_lazily_once_in_the_calling_process(clf, count_loads):
    fn = hf_classifier(str(clf), label="POS")
    assert isinstance(fn, HFClassifierReward) and not fn.loaded and fn.model is None and count_loads == []
    fn(SAMPLES, PROMPTS, OUTPUTS)
    fn(SAMPLES[:2], PROMPTS[:2], OUTPUTS[:2])
    assert fn.loaded and fn.loads == 1 and len(count_loads) == 1


def test_logit_and_prob_of_a_label_by_name_or_index(clf):
    ref = manual_logits(clf, SAMPLES)
    pos = hf_classifier(str(clf), label="POS")(SAMPLES, PROMPTS, OUTPUTS)
    assert pos == pytest.approx(ref[:, 1].tolist(), abs=1e-5)
    assert hf_classifier(str(clf), label=1)(SAMPLES, PROMPTS, OUTPUTS) == pytest.approx(pos, abs=1e-6)
    neg = hf_classifier(str(clf), label="NEG")(SAMPLES, PROMPTS, OUTPUTS)
    assert neg == pytest.approx(ref[:, 0].tolist(), abs=1e-5)
    prob = hf_classifier(str(clf), label="POS", output="prob")(SAMPLES, PROMPTS, OUTPUTS)
    assert prob == pytest.approx(ref.softmax(-1)[:, 1].tolist(), abs=1e-6)
    assert len(set(round(x, 4) for x in pos)) > 1  # the scores do differ between samples


def test_text_output_scores_the_response_alone(clf):
    ref = manual_logits(clf, OUTPUTS)
    got = hf_classifier(str(clf), label="POS", text="output")(SAMPLES, PROMPTS, OUTPUTS)
    assert got == pytest.approx(ref[:, 1].tolist(), abs=1e-5)


def test_batch_size_and_padding_do_not_change_scores(clf):
    one = hf_classifier(str(clf), label="POS", batch_size=1)(SAMPLES, PROMPTS, OUTPUTS)
    many = hf_classifier(str(clf), label="POS", batch_size=3)(SAMPLES, PROMPTS, OUTPUTS)
    assert many == pytest.approx(one, abs=1e-5)


def test_max_length_truncates(clf):
    tok = AutoTokenizer.from_pretrained(clf)
    first2 = [tok.decode(tok(s)["input_ids"][:2]) for s in SAMPLES]
    ref = manual_logits(clf, first2)
    got = hf_classifier(str(clf), label="POS", max_length=2)(SAMPLES, PROMPTS, OUTPUTS)
    assert got == pytest.approx(ref[:, 1].tolist(), abs=1e-5)


def test_unknown_label_lists_the_model_labels(clf):
    with pytest.raises(HFClassifierError, match=r"label 'POSITIVE' is not a label of the model at .*; "
                                                r"its labels are 0='NEG', 1='POS'"):
        hf_classifier(str(clf), label="POSITIVE")
    with pytest.raises(HFClassifierError, match=r"label index 2 is out of range .* 2 label\(s\): 0='NEG', 1='POS'"):
        hf_classifier(str(clf), label=2)
    with pytest.raises(HFClassifierError, match=r"has 2 labels \(0='NEG', 1='POS'\); set label="):
        hf_classifier(str(clf))


def test_bad_options(clf, tmp_path):
    with pytest.raises(HFClassifierError, match=r"output must be 'logit' or 'prob', got 'probability'"):
        hf_classifier(str(clf), label="POS", output="probability")
    with pytest.raises(HFClassifierError, match=r"text must be 'sample' or 'output'"):
        hf_classifier(str(clf), label="POS", text="prompt")
    with pytest.raises(HFClassifierError, match=r"batch_size must be a positive integer"):
        hf_classifier(str(clf), label="POS", batch_size=0)
    with pytest.raises(HFClassifierError, match=r"cannot read the model config at"):
        hf_classifier(str(tmp_path / "missing"), label="POS")


def test_single_output_reward_model_needs_no_label(tiny_model, tmp_path):
    from transformers import AutoConfig

    path = build_tiny_classifier(tmp_path / "rm", tiny_model)
    cfg = AutoConfig.from_pretrained(path)
    cfg.num_labels = 1
    cfg.id2label, cfg.label2id = {0: "LABEL_0"}, {"LABEL_0": 0}
    GPT2ForSequenceClassification(cfg).save_pretrained(path)
    logit = hf_classifier(str(path))(SAMPLES, PROMPTS, OUTPUTS)
    prob = hf_classifier(str(path), output="prob")(SAMPLES, PROMPTS, OUTPUTS)
    assert prob == pytest.approx(torch.tensor(logit).sigmoid().tolist(), abs=1e-6)


def test_usable_from_yaml_as_a_factory(clf, tiny_model, tmp_path, count_loads):
    cfg = rallyrl.load_config({"model": {"path": str(tiny_model)},
                               "reward": {"fn": "rallyrl.reward:hf_classifier",
                                          "kwargs": {"path": str(clf), "label": "POS", "output": "prob",
                                                     "device": "cpu", "batch_size": 2}}})
    (named,) = resolve_reward_fns(cfg.reward, None)
    assert named.name == "hf_classifier" and isinstance(named.fn, HFClassifierReward)
    assert not named.fn.loaded and count_loads == []  # building it read config.json only
    assert named.fn.batch_size == 2 and named.fn.output == "prob"
    # a wrong label fails while the config is resolved, before any model is loaded
    bad = rallyrl.load_config({"model": {"path": str(tiny_model)},
                               "reward": {"fn": "rallyrl.reward:hf_classifier",
                                          "kwargs": {"path": str(clf), "label": "GOOD"}}})
    with pytest.raises(RewardFactoryError, match=r"reward.fn: rallyrl.reward:hf_classifier\(\*\*kwargs\) failed: "
                                                 r"HFClassifierError: .*its labels are 0='NEG', 1='POS'"):
        resolve_reward_fns(bad.reward, None)
