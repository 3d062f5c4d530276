"""Prompts from files and data sets (issue #20, item 1): every format, the prompt column, the offline
error of a data set name, rows read lazily and checked when drawn, and the same prompt order as before."""

import json

import numpy as np
import pytest

from rallyrl.config import ConfigError
from rallyrl.data import ArrowTable, DataError, ListTable, PromptSampler, load_prompts, open_prompts
from rallyrl.inputs import PromptSet

ROWS = [{"prompt": "the cat", "answer": 1}, {"prompt": "a dog", "answer": 2}, {"prompt": "we walk", "answer": 3}]


@pytest.fixture(autouse=True)
def _own_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _all(table):
    return table.rows(list(range(len(table))))


def _write(tmp_path, fmt, rows=ROWS):
    import datasets

    path = tmp_path / f"p.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "csv":
        cols = list(rows[0])
        path.write_text(",".join(cols) + "\n" + "".join(",".join(str(r[c]) for c in cols) + "\n" for r in rows))
    elif fmt == "parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif fmt == "disk":
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "disk"])
def test_each_format_loads_as_arrow(tmp_path, fmt):
    table = open_prompts(str(_write(tmp_path, fmt)))
    assert isinstance(table, ArrowTable) and not table.chat and len(table) == 3
    assert _all(table) == ROWS
    assert table.rows([2, 0, 2]) == [ROWS[2], ROWS[0], ROWS[2]]  # any order, repeats


def test_a_dataset_dict_folder_picks_the_split(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(ROWS[:1])}).save_to_disk(str(tmp_path / "dd"))
    assert _all(open_prompts(str(tmp_path / "dd"))) == ROWS  # data.split defaults to train
    assert _all(open_prompts(str(tmp_path / "dd"), "data.eval_prompts", split="test")) == ROWS[:1]
    with pytest.raises(DataError, match=r"^data.eval_prompts: .*dd has no split 'validation' \(it has \['test', "
                                        r"'train'\]\); set data.eval_split"):
        open_prompts(str(tmp_path / "dd"), "data.eval_prompts", split="validation")


def test_a_dataset_object_from_the_python_api():
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    assert _all(open_prompts(ds, "prompts")) == ROWS
    assert _all(open_prompts(datasets.DatasetDict({"test": ds}), "eval_prompts", split="test")) == ROWS


def test_prompt_column(tmp_path):
    rows = [{"question": r["prompt"], "answer": r["answer"]} for r in ROWS]
    for fmt in ("csv", "jsonl"):
        assert _all(open_prompts(str(_write(tmp_path, fmt, rows)), prompt_column="question")) == ROWS
    assert open_prompts(rows, prompt_column="question").rows([0]) == [ROWS[0]]  # an inline list too
    with pytest.raises(DataError, match=r"p.csv has no 'prompt' column \(its columns: \['question', 'answer'\]\); "
                                        r"set data.prompt_column"):
        open_prompts(str(tmp_path / "p.csv"))
    clash = _write(tmp_path, "parquet", [{"prompt": "x", "question": "y"}])
    with pytest.raises(DataError, match=r"has both a 'prompt' column and data.prompt_column 'question'"):
        open_prompts(str(clash), prompt_column="question")


def test_a_data_set_name_offline_is_a_clear_error():
    with pytest.raises(DataError, match=r"^data.prompts: 'nobody/no-such-set' is not a file or folder, so it was "
                                        r"taken as a data set name for datasets.load_dataset.*HF_DATASETS_OFFLINE"):
        open_prompts("nobody/no-such-set", subset="main")


def test_a_missing_file_is_still_file_not_found(tmp_path):
    for name in (str(tmp_path / "p.parquet"), "data/p.jsonl", "./prompts"):
        with pytest.raises(DataError, match=r"^data.prompts: file not found: "):
            open_prompts(name)


@pytest.mark.parametrize("rows, match", [
    ([{"prompt": "a"}, {"prompt": None}], r"p.parquet row 1 has no 'prompt' \(null\)"),
    ([{"prompt": 1}], r"p.parquet: column 'prompt' holds Value\('int64'\), not strings or lists of chat messages"),
])
def test_what_is_cheap_is_checked_up_front(tmp_path, rows, match):
    with pytest.raises(DataError, match=match):
        open_prompts(str(_write(tmp_path, "parquet", rows)))


def test_malformed_files_name_the_line_or_offset(tmp_path):
    f = tmp_path / "p.json"
    f.write_text('[{"prompt": "a"},\n{"prompt" "b"}]')
    with pytest.raises(DataError, match=rf"^data.prompts: {f}:2 is not valid JSON"):
        open_prompts(str(f))
    c = tmp_path / "p.csv"
    c.write_bytes(b"prompt\ncaf\xe9\n")
    with pytest.raises(DataError, match=rf"^data.prompts: {c} is not UTF-8 text \(byte 0xe9 at offset 10\)"):
        open_prompts(str(c))


def test_jsonl_and_txt_keep_their_rows(tmp_path):
    """Arrow reads the rows the Python reader read (blank lines skipped, a BOM dropped), so row i, and
    with it the prompt order, is what it was; a file Arrow cannot type is read by the Python reader."""
    t = tmp_path / "p.txt"
    t.write_bytes("\ufeffcafé\r\nthe dog\n\n   \n\tx \n".encode())
    j = tmp_path / "p.jsonl"
    j.write_text('{"prompt": "a", "id": 1}\n\n  \n{"prompt": "b"}\n')
    for path in (t, j):
        table = open_prompts(str(path))
        assert isinstance(table, ArrowTable)
        assert [r["prompt"] for r in _all(table)] == [r["prompt"] for r in load_prompts(str(path))]
    mixed = tmp_path / "m.jsonl"  # a string and a conversation in one column: valid before, still valid
    mixed.write_text('{"prompt": "a"}\n{"prompt": [{"role": "user", "content": "b"}]}\n')
    table = open_prompts(str(mixed))
    assert isinstance(table, ListTable) and _all(table) == load_prompts(str(mixed))
    ff = tmp_path / "f.txt"  # a form feed: str.splitlines breaks there, datasets does not
    ff.write_text("a\fb\nc\n")
    assert [r["prompt"] for r in _all(open_prompts(str(ff)))] == ["a", "b", "c"]


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_the_prompt_order_is_the_permutation_over_the_non_blank_rows(tmp_path, tiny_model, suffix):
    """Hand-built expectation: the file's non-blank lines, in the order of the permutation the shared
    sampler draws from (seed, epoch) — what a run drew before prompts came from Arrow."""
    from transformers import AutoTokenizer

    from rallyrl.seeding import stream_seed

    lines = [f"prompt number {i}" for i in range(23)]
    path = tmp_path / f"p{suffix}"
    body = [json.dumps({"prompt": p}) if suffix == ".jsonl" else p for p in lines]
    path.write_text("\n".join(b + ("\n\n" if i % 5 == 0 else "") for i, b in enumerate(body)) + "\n")
    ps = PromptSet.of(open_prompts(str(path)), AutoTokenizer.from_pretrained(tiny_model), 128, 4, "data.prompts")
    sampler = PromptSampler(len(ps), seed=7)
    drawn = sampler.next(30)  # past the end of the first pass
    ps.prepare(drawn)
    perm0 = np.random.default_rng([stream_seed(7, "prompt_order"), 0]).permutation(23)
    perm1 = np.random.default_rng([stream_seed(7, "prompt_order"), 1]).permutation(23)
    assert ps.texts(drawn) == [lines[i] for i in [*perm0, *perm1[:7]]]


def test_rows_are_tokenized_when_drawn_and_only_an_iterations_rows_are_kept(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    rows = [{"prompt": f"the cat {i}", "answer": i} for i in range(50)]
    rows[37]["prompt"] = "the cat sat on the mat " * 30
    ps = PromptSet.of(open_prompts(str(_write(tmp_path, "parquet", rows))), tok, 128, 8, "data.prompts")
    assert len(ps) == 50 and not ps._cache  # nothing read yet
    ps.prepare([3, 1, 3])
    assert set(ps._cache) == {1, 3}
    assert ps.texts([3, 1]) == ["the cat 3", "the cat 1"] and ps.metadata([1]) == [{"answer": 1}]
    assert ps.token_ids([3]) == [tok("the cat 3")["input_ids"]]
    ps.prepare([5])
    assert set(ps._cache) == {5}  # the previous iteration's rows are gone
    with pytest.raises(ConfigError, match=r"^data.prompts: prompt 37 has \d+ tokens; with "
                                          r"generation.max_new_tokens=8 that exceeds the model's 128 positions"):
        ps.prepare([36, 37])
    with pytest.raises(ConfigError, match=r"prompt 37 has"):
        ps.longest()  # `rallyrl check` reads every row


def test_conversations_from_a_file_are_rendered_when_drawn(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat", "name": "x"}]
    rows = [{"prompt": chat, "answer": 4}, {"prompt": chat[1:], "answer": 5}]  # message keys differ
    table = open_prompts(str(_write(tmp_path, "jsonl", rows)))
    assert isinstance(table, ArrowTable) and table.chat and _all(table) == rows
    with pytest.raises(DataError, match=r"prompt 0 is a list of chat messages, but the tokenizer"):
        PromptSet.of(table, tok, 128, 4, "data.prompts")  # no template: up front, for the whole set
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    ps = PromptSet.of(table, tok, 128, 4, "data.prompts")
    assert ps.texts([1]) == ["<|user|>the cat\n"]
    assert ps.metadata([1, 0]) == [{"answer": 5, "prompt_messages": rows[1]["prompt"]},
                                   {"answer": 4, "prompt_messages": chat}]
    # messages with the same keys are Arrow structs, checked up front ...
    same_keys = [{"prompt": [{"role": "user", "content": "a"}]}, {"prompt": [{"role": "user", "content": None}]}]
    with pytest.raises(DataError, match=r"^data.prompts: .*p.parquet row 1: chat message 0 has no 'content'"):
        open_prompts(str(_write(tmp_path, "parquet", same_keys)))
    # ... messages whose keys differ are stored as JSON: checked when drawn, naming the row
    bad = open_prompts(str(_write(tmp_path, "jsonl", [rows[0], {"prompt": [{"role": "user"}]}])))
    with pytest.raises(DataError, match=r"^data.prompts: prompt 1: chat message 0 has no 'content'"):
        PromptSet.of(bad, tok, 128, 4, "data.prompts").prepare([1])


def test_long_prompts_error_checks_every_set_up_front(tmp_path, tiny_model):
    """data.long_prompts: error: the training set's long row is found at start (its length index), before
    any model loads, as the eval set's and an inline list's always were."""
    from rallyrl.config import load_config
    from rallyrl.inputs import prepare_inputs

    rows = [{"prompt": "the cat"}, {"prompt": "the cat sat on the mat " * 30}]
    f = _write(tmp_path, "parquet", rows)
    base = {"model": {"path": str(tiny_model)}, "train": {"run_dir": str(tmp_path / "run")},
            "rollout": {"num_rollouts": 2, "chunk_size": 2}, "reward": {"fn": "tests.helpers.rewards:hashed"}}
    err = {"long_prompts": "error"}
    with pytest.raises(ConfigError, match=r"^data.prompts: prompt 1 has"):
        prepare_inputs(load_config({**base, "data": {"prompts": str(f), **err}}), 1)
    with pytest.raises(ConfigError, match=r"^data.eval_prompts: prompt 1 has"):
        prepare_inputs(load_config({**base, "data": {"prompts": ["the cat"], "eval_prompts": str(f), **err}}), 1)
    with pytest.raises(ConfigError, match=r"^data.prompts: prompt 1 has"):  # an inline list
        prepare_inputs(load_config({**base, "data": {"prompts": [r["prompt"] for r in rows], **err}}), 1)
    inp = prepare_inputs(load_config({**base, "data": {"prompts": str(f)}}), 1)  # skip (the default): starts
    assert len(inp.train_set) == 2


def test_inline_prompts_never_import_datasets():
    import subprocess
    import sys

    code = ("import sys, rallyrl, rallyrl.trainer, rallyrl.cli; from rallyrl.data import open_prompts; "
            "open_prompts(['the cat', {'prompt': 'a dog', 'x': 1}]); "
            "assert 'datasets' not in sys.modules and 'pyarrow' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
