"""Conversational prompts: loading, checking, rendering with the chat template, tokenizing."""

import json

import pytest

from rallyrl.data import DataError, load_prompts
from rallyrl.inputs import PromptSet, render_prompts, tokenize_prompts

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}]


@pytest.fixture()
def tok(tiny_model):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tiny_model)
    t.chat_template = TEMPLATE
    return t


def test_loading_accepts_conversations_in_every_form(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": CHAT, "answer": 4}) + "\n" + json.dumps(CHAT) + "\n"
                 + json.dumps({"prompt": "plain", "answer": 5}) + "\n")
    assert load_prompts(str(f)) == [{"prompt": CHAT, "answer": 4}, {"prompt": CHAT}, {"prompt": "plain", "answer": 5}]
    assert load_prompts([CHAT, "plain", {"prompt": CHAT, "x": 1}]) == [
        {"prompt": CHAT}, {"prompt": "plain"}, {"prompt": CHAT, "x": 1}]


@pytest.mark.parametrize("bad, match", [
    ([], r"item 1: the list of chat messages is empty"),
    (["hi"], r"item 1: chat message 0 must be an object with 'role' and 'content', got str"),
    ([{"role": "user", "content": "a"}, {"content": "b"}], r"item 1: chat message 1 has no string 'role'"),
    ([{"role": "user"}], r"item 1: chat message 0 has no 'content'"),
    ([{"role": "user", "content": 3}], r"item 1: chat message 0 has no 'content'"),
    ({"prompt": CHAT, "prompt_messages": 1}, r"item 1 has a 'prompt_messages' column"),
    ({"prompt": 3}, r"item 1 has no 'prompt' field that is a string or a list of chat messages"),
])
def test_malformed_conversations_name_the_row(bad, match):
    with pytest.raises(DataError, match=r"^data.eval_prompts: " + match):
        load_prompts(["fine", {"prompt": bad} if isinstance(bad, list) else bad], "data.eval_prompts")


def test_malformed_jsonl_row_names_file_and_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "ok"}) + "\n\n" + json.dumps({"prompt": [{"role": "user"}]}) + "\n")
    with pytest.raises(DataError, match=rf"data.prompts: {f}:3: chat message 0 has no 'content'"):
        load_prompts(str(f))


def test_rendering_and_tokenizing(tok):
    records = load_prompts([{"prompt": CHAT, "answer": 4}, {"prompt": "the cat", "answer": 5}])
    out, chat = render_prompts(records, tok, "data.prompts")
    assert chat == [True, False]
    text = "<|system|>be brief\n<|user|>the cat\n<|assistant|>"
    assert out[0] == {"prompt": text, "answer": 4, "prompt_messages": CHAT}
    assert out[1] == {"prompt": "the cat", "answer": 5, "prompt_messages": None}  # the column is in every record
    ids = tokenize_prompts(out, tok, 128, 4, "data.prompts", chat)
    assert ids[0] == tok(text, add_special_tokens=False)["input_ids"]
    assert ids[1] == tok("the cat", add_special_tokens=True)["input_ids"]
    ps = PromptSet(out, ids)
    assert ps.texts([0, 1]) == [text, "the cat"]
    # the messages reach the reward function as the per-sample kwarg `prompt_messages` (None for plain)
    from rallyrl.reward.step import Samples, call_kwargs

    kw = call_kwargs(Samples(ps.texts([1, 0]), ["a", "b"], [[1], [2]], ps.metadata([1, 0])), tok)
    assert kw["prompt_messages"] == [None, CHAT] and kw["answer"] == [5, 4]


def test_a_user_column_named_prompt_messages_beside_conversations_is_an_error(tok):
    with pytest.raises(DataError, match=r"data.prompts: prompt 0 has a 'prompt_messages' column"):
        render_prompts(load_prompts([{"prompt": "x", "prompt_messages": 1}, CHAT]), tok, "data.prompts")


def test_plain_prompts_are_unchanged(tok):
    records = load_prompts(["the cat", {"prompt": "a dog", "prompt_messages": "a user column"}])
    out, chat = render_prompts(records, tok, "data.prompts")
    assert out is records and chat == [False, False]
    assert tokenize_prompts(out, tok, 128, 4, "data.prompts", chat) == tokenize_prompts(out, tok, 128, 4, "data.prompts")


def test_no_second_bos_when_the_template_writes_it(tiny_model):
    """A Llama-style tokenizer adds BOS to every encoded text, and its template writes BOS too: the
    rendered prompt must start with exactly one BOS."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tiny_model)
    bos = t.bos_token_id
    t._tokenizer.post_processor = processors.TemplateProcessing(single=f"{t.bos_token} $A",
                                                               special_tokens=[(t.bos_token, bos)])
    assert t("the cat")["input_ids"][0] == bos  # the tokenizer adds BOS ...
    t.chat_template = "{{ bos_token }}" + TEMPLATE  # ... and so does the template
    out, chat = render_prompts(load_prompts([CHAT, "the cat"]), t, "data.prompts")
    ids = tokenize_prompts(out, t, 128, 4, "data.prompts", chat)
    assert ids[0][0] == bos and ids[0][1] != bos
    assert ids[1][0] == bos  # a plain prompt still gets the tokenizer's BOS


def test_a_tokenizer_without_chat_template_is_a_clear_error(tiny_model):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tiny_model)
    assert not t.chat_template
    records = load_prompts(["plain", "also plain", CHAT, CHAT])
    with pytest.raises(DataError, match=r"^data.eval_prompts: prompt 2 is a list of chat messages, but the tokenizer "
                                        r"of model.path \(/m\) has no chat template"):
        render_prompts(records, t, "data.eval_prompts", "model.path (/m)")
    render_prompts(records[:2], t, "data.prompts")  # plain prompts need no template


def test_a_failing_template_names_the_prompt(tok):
    tok.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x"
    with pytest.raises(DataError, match=r"prompts: prompt 1: the chat template of the tokenizer failed on its "
                                        r"messages: .*user first"):
        render_prompts(load_prompts([[{"role": "user", "content": "a"}], CHAT]), tok, "prompts")


def test_messages_reach_a_remote_reward_server():
    """``prompt_messages`` is a metadata column like any other: the HTTP client sends it as JSON and the
    server hands it to its reward function as the same per-sample kwarg."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from rallyrl.reward.server import Batcher, create_app
    from rallyrl.reward.step import NamedRewardFn

    seen = []

    def fn(samples, prompts, outputs, **kw):
        seen.append(kw["prompt_messages"])
        return [0.0] * len(samples)

    with TestClient(create_app(Batcher(NamedRewardFn("f", fn), max_batch=8, max_wait_ms=1), token=None,
                               max_body_bytes=1 << 20)) as c:
        body = {"samples": ["<|user|>a\n<|assistant|>x", "plainy"], "prompts": ["<|user|>a\n<|assistant|>", "plain"],
                "outputs": ["x", "y"], "metadata": {"prompt_messages": [[{"role": "user", "content": "a"}], None]}}
        assert c.post("/score", json=body).status_code == 200
    assert seen == [[[{"role": "user", "content": "a"}], None]]
