"""Prompt length (issue 28, item 2): data.max_prompt_tokens and data.long_prompts (error | truncate_left |
skip), the draw that replaces skipped rows (deterministic, resumable), the metrics and the one-line note,
and the length index that `error` checks at start (cached, invalidated by a changed file, tokenizer or
chat template)."""

import json
from pathlib import Path

import numpy as np
import pytest

from rallyrl.config import ConfigError
from rallyrl.data import DataError, PromptLimit, PromptSampler, PromptSet, open_prompts

LONG = "the cat sat on the mat " * 30  # over 300 tokens of the tiny tokenizer: more than 128 - 8


@pytest.fixture(autouse=True)
def _own_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("RANK", raising=False)


@pytest.fixture
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def _rows(n=20, long=(3, 11)):
    return [{"prompt": LONG + str(i) if i in long else f"the cat {i}", "answer": i} for i in range(n)]


def _parquet(tmp_path, rows, name="p.parquet"):
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / name))
    return str(tmp_path / name)


def _set(source, tok, mode, tokens=None, what="data.prompts"):
    return PromptSet.of(open_prompts(source, what), tok, 128, 8, what, limit=PromptLimit.of(tokens, mode, 128, 8))


def test_the_limit_defaults_to_the_positions_the_model_leaves_and_must_fit():
    derived = PromptLimit.of(None, "skip", 128, 8)
    assert (derived.tokens, derived.explicit) == (120, False)
    assert derived.describe() == "120 tokens (the model's 128 positions minus generation.max_new_tokens=8)"
    assert PromptLimit.of(None, "skip", None, 8).tokens is None  # no position limit (T5): no limit
    assert PromptLimit.of(64, "skip", None, 8).tokens == 64
    PromptLimit.of(120, "error", 128, 8).check_room()
    with pytest.raises(ConfigError, match=r"^data.max_prompt_tokens=121 with generation.max_new_tokens=8 exceeds "
                                          r"the model's 128 positions; set it to at most 120"):
        PromptLimit.of(121, "error", 128, 8).check_room()
    with pytest.raises(ConfigError, match=r"^data.prompts: generation.max_new_tokens=128 leaves no room for a prompt"):
        PromptLimit.of(None, "skip", 128, 128).check_room()


def test_error_names_the_row_with_the_limit_it_broke(tmp_path, tok):
    n = len(tok(LONG + "3")["input_ids"])
    ps = _set(_parquet(tmp_path, _rows()), tok, "error")
    with pytest.raises(ConfigError, match=rf"^data.prompts: prompt 3 has {n} tokens; with generation.max_new_tokens=8 "
                                          r"that exceeds the model's 128 positions"):
        ps.prepare([2, 3])
    ps = _set(_parquet(tmp_path, _rows()), tok, "error", tokens=4)
    with pytest.raises(ConfigError, match=r"^data.prompts: prompt 0 has 5 tokens, more than data.max_prompt_tokens=4"):
        ps.prepare([0])


def test_truncate_left_keeps_the_last_tokens_and_the_whole_text(tmp_path, tok, capsys):
    ps = _set(_parquet(tmp_path, _rows()), tok, "truncate_left")
    sampler = PromptSampler(20, seed=0, shuffle=False)
    assert ps.draw(sampler, 5) == [0, 1, 2, 3, 4]
    full = tok(LONG + "3")["input_ids"]
    assert ps.token_ids([3]) == [full[-120:]] and ps.texts([3]) == [LONG + "3"]  # the reward sees the prompt
    assert ps.token_ids([2]) == [tok("the cat 2")["input_ids"]]
    assert ps.draw_metrics() == {"data/truncated_prompts": 1.0}
    err = capsys.readouterr().err
    assert err == (f"rallyrl: note: data.prompts: prompt 3 has {len(full)} tokens, more than 120 tokens (the model's "
                   f"128 positions minus generation.max_new_tokens=8): its first {len(full) - 120} tokens dropped "
                   "(data.long_prompts: truncate_left); each iteration counts such prompts in data/truncated_prompts\n")
    ps.draw(sampler, 5)
    assert ps.draw_metrics() == {}  # rows 5-9: none long; the key is absent, as in a run without long prompts
    ps.draw(sampler, 5)
    assert ps.draw_metrics() == {"data/truncated_prompts": 1.0} and capsys.readouterr().err == ""  # said once


def test_truncate_left_of_a_conversation_cuts_the_rendered_ids(tmp_path, tok):
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": LONG}]
    ps = PromptSet.of(open_prompts([chat, [{"role": "user", "content": "hi"}]]), tok, 128, 8, "data.prompts",
                      limit=PromptLimit.of(None, "truncate_left", 128, 8))
    ps.prepare_all()
    rendered = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    full = tok(rendered, add_special_tokens=False)["input_ids"]
    assert len(full) > 120 and ps.token_ids([0]) == [full[-120:]]  # the system message is what goes
    assert ps.texts([0]) == [rendered] and ps.metadata([0])[0]["prompt_messages"] == chat


def test_skip_draws_replacements_deterministically_and_resumes_exactly(tmp_path, tok, capsys):
    path = _parquet(tmp_path, _rows())
    ps, sampler = _set(path, tok, "skip"), PromptSampler(20, seed=5)
    order = PromptSampler(20, seed=5).next(60)  # the shared order, as drawn without any skip
    draws, metrics = [], []
    for _ in range(6):
        draws.append(ps.draw(sampler, 7))
        metrics.append(ps.draw_metrics())
    flat = [i for d in draws for i in d]
    assert all(len(d) == 7 for d in draws) and not {3, 11} & set(flat)  # every iteration full, none long
    assert flat == [i for i in order if i not in (3, 11)][:42]  # the next rows of the order take their place
    skipped, consumed = sum(m.get("data/skipped_prompts", 0) for m in metrics), sampler.epoch * 20 + sampler.pos
    assert skipped == consumed - 42 == order[:consumed].count(3) + order[:consumed].count(11) > 0
    assert all(set(m) <= {"data/skipped_prompts"} for m in metrics)
    assert capsys.readouterr().err.count("rallyrl: note: data.prompts: prompt") == 1
    assert set(ps._cache) == set(draws[-1])  # the skipped rows are not kept
    # resume: a sampler restored from the state after draw 3 continues with draws 4-6, exactly
    again, sampler2 = _set(path, tok, "skip"), PromptSampler(20, seed=5)
    for _ in range(3):
        again.draw(sampler2, 7)
    state = json.loads(json.dumps(sampler2.state_dict()))  # as a checkpoint stores it
    resumed = PromptSampler(20, seed=5)
    resumed.load_state_dict(state)
    fresh = _set(path, tok, "skip")
    assert [fresh.draw(resumed, 7) for _ in range(3)] == draws[3:]


def test_skip_with_every_row_long_is_an_error(tmp_path, tok):
    ps = _set(_parquet(tmp_path, _rows(4, long=(0, 1, 2, 3))), tok, "skip")
    with pytest.raises(DataError, match=r"^data.prompts: every prompt of .*p.parquet is longer than 120 tokens \(the "
                                        r"model's 128 positions minus generation.max_new_tokens=8\), so "
                                        r"data.long_prompts: skip leaves none"):
        ps.draw(PromptSampler(4, seed=0), 2)
    inline = PromptSet.of(open_prompts([LONG, LONG + "x"]), tok, 128, 8, "data.prompts",
                          limit=PromptLimit.of(None, "skip", 128, 8))
    with pytest.raises(DataError, match=r"every prompt of the list is longer"):
        inline.prepare_all()  # an inline list: found at start


def test_skip_in_an_inline_list_and_the_eval_set(tok, capsys):
    records = [f"the cat {i}" if i != 1 else LONG for i in range(4)]
    limit = PromptLimit.of(None, "skip", 128, 8)
    train = PromptSet.of(open_prompts(records), tok, 128, 8, "data.prompts", limit=limit)
    train.prepare_all()
    assert train.draw(PromptSampler(4, seed=0, shuffle=False), 3) == [0, 2, 3]
    assert train.draw_metrics() == {"data/skipped_prompts": 1.0}
    capsys.readouterr()
    ev = PromptSet.of(open_prompts(records, "data.eval_prompts"), tok, 128, 8, "data.eval_prompts", limit=limit)
    ev.prepare_all(drop_long=True)  # the eval set: long rows left out, the rest renumbered, said once
    assert len(ev) == 3 and ev.texts([0, 1, 2]) == ["the cat 0", "the cat 2", "the cat 3"]
    assert "data.eval_prompts: 1 of 4 prompts are longer than 120 tokens" in capsys.readouterr().err


def test_the_note_is_said_by_the_main_rank_only(tmp_path, tok, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    ps = _set(_parquet(tmp_path, _rows()), tok, "skip")
    ps.draw(PromptSampler(20, seed=0, shuffle=False), 5)
    assert ps.draw_metrics() == {"data/skipped_prompts": 1.0} and capsys.readouterr().err == ""


def test_error_checks_every_row_at_start_from_a_cached_index(tmp_path, tok, monkeypatch, capsys):
    path = _parquet(tmp_path, _rows())
    ps = _set(path, tok, "error")
    n = len(tok(LONG + "3")["input_ids"])
    with pytest.raises(ConfigError, match=rf"^data.prompts: prompt 3 has {n} tokens"):
        ps.check_lengths()  # the first long row, before any draw
    assert "prompt lengths of data.prompts cached in" in capsys.readouterr().err
    from rallyrl.data.lengths import _index_path

    index = _index_path(open_prompts(path), tok)
    arrow = Path(ps.table._ds.cache_files[0]["filename"])
    assert index.name.startswith("rallyrl-prompt-lengths-") and index.parent == arrow.parent  # beside the Arrow
    lengths = np.load(index)
    assert lengths.tolist() == [len(tok(r["prompt"])["input_ids"]) for r in _rows()]
    # a second start reads the index: no row is tokenized (only the long one, for its message)
    calls = []
    again = _set(path, tok, "error")
    load = again._load
    monkeypatch.setattr(again, "_load", lambda idx, limit=True: calls.append(list(idx)) or load(idx, limit))
    with pytest.raises(ConfigError, match=rf"prompt 3 has {n} tokens"):
        again.check_lengths()
    assert calls == [[3]]
    assert max(n, len(tok(LONG + "11")["input_ids"])) == again.lengths().max() and len(again.long_rows()) == 2
    ok = _set(_parquet(tmp_path, _rows(long=())), tok, "error")
    ok.check_lengths()  # no long row: nothing raised
    assert ok.long_summary() == ""


def test_the_index_is_invalidated_by_a_changed_file_tokenizer_or_template(tmp_path, tok):
    from rallyrl.data.lengths import _index_path

    rows = _rows(long=())
    path = _parquet(tmp_path, rows)
    first = _index_path(open_prompts(path), tok)
    assert _index_path(open_prompts(path), tok) == first  # the same table and tokenizer: the same index
    _set(path, tok, "error").check_lengths()
    assert first.is_file()
    # the file changes (a long row appears): another index, which finds it
    rows[5]["prompt"] = LONG
    _parquet(tmp_path, rows)
    assert _index_path(open_prompts(path), tok) != first
    with pytest.raises(ConfigError, match=r"prompt 5 has"):
        _set(path, tok, "error").check_lengths()
    # the chat template or the tokenizer changes: another index
    table = open_prompts(path)
    before = _index_path(table, tok)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert _index_path(table, tok) != before
    tok.add_special_tokens({"additional_special_tokens": ["<|new|>"]})
    assert len({before, _index_path(table, tok)}) == 2


def test_a_dataset_in_memory_is_scanned_not_cached(tok):
    import datasets

    from rallyrl.data.lengths import _index_path

    table = open_prompts(datasets.Dataset.from_list(_rows()), "prompts")
    assert _index_path(table, tok) is None
    ps = PromptSet.of(table, tok, 128, 8, "prompts", limit=PromptLimit.of(None, "skip", 128, 8))
    assert ps.long_rows().tolist() == [3, 11]
    assert ps.long_summary() == ("; 2 longer than 120 tokens (the model's 128 positions minus "
                                 "generation.max_new_tokens=8), first prompt 3: skipped when drawn "
                                 "(data.long_prompts: skip)")


def test_runs_without_long_prompts_draw_as_before(tok):
    """No long row: draw() is the sampler's next(k) and prepare(), and logs no data/* key."""
    ps = PromptSet.of(open_prompts([f"p {i}" for i in range(9)]), tok, 128, 8, "data.prompts",
                      limit=PromptLimit.of(None, "skip", 128, 8))
    ps.prepare_all()
    a, b = PromptSampler(9, seed=2), PromptSampler(9, seed=2)
    for _ in range(4):
        assert ps.draw(a, 4) == b.next(4) and ps.draw_metrics() == {}
    assert a.state_dict() == b.state_dict()
