"""Empty and degenerate data (issue 28, item 4): every source says "no prompts in X" (or names the empty
split or column) in one line, before any model is loaded; a streaming data set and a pandas DataFrame
are refused saying what is accepted."""

import json

import pytest

from rallyrl.data import DataError, open_prompts


@pytest.fixture(autouse=True)
def _own_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _fails(source, match, **kw):
    with pytest.raises(DataError, match=match) as info:
        open_prompts(source, kw.pop("what", "data.prompts"), **kw)
    assert "\n" not in str(info.value)  # one line
    return str(info.value)


def _string_table(rows):
    import pyarrow as pa

    return pa.table({"prompt": pa.array(rows, pa.string()), "answer": pa.array(range(len(rows)), pa.int64())})


def test_files_with_no_rows(tmp_path):
    import pyarrow.parquet as pq

    pq.write_table(_string_table([]), tmp_path / "p.parquet")  # datasets: "BatchSize must be greater than 0"
    _fails(str(tmp_path / "p.parquet"), rf"^data.prompts: no prompts in {tmp_path}/p.parquet \(0 rows\)$")
    (tmp_path / "p.csv").write_text("prompt,answer\n")  # datasets: 'Instruction "train" corresponds to no data!'
    _fails(str(tmp_path / "p.csv"), rf"^data.prompts: no prompts in {tmp_path}/p.csv \(a header row only\)$")
    (tmp_path / "p.json").write_text("[]")
    _fails(str(tmp_path / "p.json"), rf"^data.prompts: no prompts in {tmp_path}/p.json \(it holds \[\]\)$")
    (tmp_path / "o.json").write_text("{}")
    _fails(str(tmp_path / "o.json"), r"no prompts in .*o.json \(it holds \{\}\)$")
    for name in ("z.parquet", "z.csv", "z.json"):  # zero bytes
        (tmp_path / name).write_text("")
        _fails(str(tmp_path / name), rf"^data.prompts: no prompts in {tmp_path}/{name} \(the file is empty\)$")
    for name, text in (("e.jsonl", "\n\n"), ("e.txt", " \n\n")):  # as before
        (tmp_path / name).write_text(text)
        _fails(str(tmp_path / name), rf"^data.prompts: no prompts in {tmp_path}/{name}$")


def test_a_file_that_is_not_empty_still_names_its_problem(tmp_path):
    """The empty-file checks run only on datasets' error path and do not hide other causes."""
    (tmp_path / "p.csv").write_text("prompt,answer\nthe cat,1\n")
    assert len(open_prompts(str(tmp_path / "p.csv"))) == 1
    (tmp_path / "bad.json").write_text('[{"prompt": "a"},')
    _fails(str(tmp_path / "bad.json"), r"bad.json:1 is not valid JSON")
    (tmp_path / "bad.parquet").write_text("not parquet")
    _fails(str(tmp_path / "bad.parquet"), r"could not be read as a parquet table")


def test_a_column_of_nulls_is_named(tmp_path):
    (tmp_path / "p.csv").write_text("question,answer\n,1\n,2\n")  # pandas types it float64
    _fails(str(tmp_path / "p.csv"), r"p.csv: column 'question' is empty \(null in every row\)$",
           prompt_column="question")
    (tmp_path / "p.json").write_text(json.dumps([{"prompt": None, "answer": 1}]))
    _fails(str(tmp_path / "p.json"), r"p.json: column 'prompt' is empty \(null in every row\)$")


def test_save_to_disk_folders(tmp_path):
    import datasets

    empty = datasets.Dataset.from_dict({"prompt": []}, features=datasets.Features({"prompt": datasets.Value("string")}))
    empty.save_to_disk(str(tmp_path / "ds"))  # datasets' own load_from_disk fails on it (IndexError)
    _fails(str(tmp_path / "ds"), rf"^data.prompts: no prompts in {tmp_path}/ds$")
    (tmp_path / "nothing").mkdir()
    _fails(str(tmp_path / "nothing"), rf"^data.prompts: no prompts in {tmp_path}/nothing \(an empty folder\)$")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["the cat", "a dog"]}), "test": empty})
    dd.save_to_disk(str(tmp_path / "dd"))
    _fails(str(tmp_path / "dd"), rf"^data.eval_prompts: no prompts in split 'test' of {tmp_path}/dd$",
           what="data.eval_prompts", split="test")
    assert len(open_prompts(str(tmp_path / "dd"))) == 2  # the empty split does not stop the other one
    _fails(str(tmp_path / "dd"), r"has no split 'validation' \(it has \['test', 'train'\]\); set data.split",
           split="validation")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.bin").write_bytes(b"1")
    _fails(str(tmp_path / "other"), r"is a folder, but not one written by datasets' save_to_disk")


def test_dataset_objects(tmp_path):
    import datasets

    _fails(datasets.Dataset.from_dict({"prompt": []}), r"^prompts: no prompts in the Dataset$", what="prompts")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["a"]}),
                               "test": datasets.Dataset.from_dict({"prompt": []})})
    _fails(dd, r"^eval_prompts: no prompts in split 'test' of the DatasetDict$", what="eval_prompts", split="test")
    _fails(datasets.DatasetDict(), r"no prompts in the DatasetDict \(it has no splits\)")
    assert len(open_prompts(dd, "prompts")) == 1


def test_streaming_sets_and_dataframes_are_refused_saying_what_is_accepted():
    import datasets

    stream = datasets.Dataset.from_dict({"prompt": ["the cat"]}).to_iterable_dataset()
    msg = _fails(stream, r"^prompts: got a datasets.IterableDataset \(a streaming data set\), which has no rows "
                         r"by index", what="prompts")
    assert "pass a datasets.Dataset" in msg and "Accepted: a path" in msg
    pd = pytest.importorskip("pandas")
    msg = _fails(pd.DataFrame({"prompt": ["the cat"]}), r"^prompts: got a pandas DataFrame; pass "
                                                        r"datasets.Dataset.from_pandas\(df\)", what="prompts")
    assert "a datasets.Dataset / DatasetDict" in msg
    _fails(42, r"^data.prompts: expected a path .*, a data set name, a list of prompts, or a datasets.Dataset / "
               r"DatasetDict, got int$")


def test_a_data_set_name_with_an_empty_split(monkeypatch):
    import datasets

    def load_dataset(name, subset, split):  # offline: a data set name that loads, with no rows in the split
        return datasets.Dataset.from_dict({"prompt": []})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    _fails("someone/gsm-like", r"^data.prompts: no prompts in split 'train' of someone/gsm-like$")


def test_empty_data_stops_before_the_model_is_looked_at(tmp_path):
    """prepare_inputs opens the prompts first: an empty eval set is named even with no model folder."""
    import pyarrow.parquet as pq

    from rallyrl.config import load_config
    from rallyrl.inputs import prepare_inputs

    pq.write_table(_string_table([]), tmp_path / "eval.parquet")
    cfg = load_config({"model": {"path": str(tmp_path / "no-model")}, "train": {"run_dir": str(tmp_path / "run")},
                       "data": {"prompts": ["the cat"], "eval_prompts": str(tmp_path / "eval.parquet")},
                       "rollout": {"num_rollouts": 2, "chunk_size": 2},
                       "reward": {"fn": "tests.helpers.rewards:hashed"}})
    with pytest.raises(DataError, match=r"^data.eval_prompts: no prompts in .*eval.parquet \(0 rows\)$"):
        prepare_inputs(cfg, 1)
