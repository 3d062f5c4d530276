"""Bad input through the CLI: exit code 2, an error naming the key / path, and nothing started.

Runs ``rallyrl.cli.main([...])`` in-process (capsys captures stderr). "Before training starts" is checked
two ways: the run directory is never created, and loading the models or starting the process group
fails the test (both are patched to raise).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rallyrl.cli import main

ROOT = Path(__file__).resolve().parents[2]


class _Started(AssertionError):
    pass


@pytest.fixture(autouse=True)
def nothing_heavy_starts(monkeypatch):
    """Every error here must be found before models are loaded or processes are started."""

    def boom(*args, **kwargs):
        raise _Started("training was started before the bad input was detected")

    monkeypatch.setattr("rallyrl.trainer.load_models", boom)
    monkeypatch.setattr("rallyrl.dist.init_accelerator", boom)
    monkeypatch.setattr("subprocess.call", boom)  # --nproc N re-launches through torch.distributed.run


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def write_cfg(tmp_path, tiny_model, run_dir):
    """Write a valid config, its sections extended by (or, with ``replace=True``, replaced by) the given
    ones (None drops a section), and return its path."""

    def write(replace: bool = False, **sections) -> Path:
        cfg = {
            "model": {"path": str(tiny_model)},
            "data": {"prompts": ["the cat", "a dog"]},
            "train": {"run_dir": str(run_dir), "iterations": 1, "num_threads": 1, "progress": False},
            "rollout": {"num_rollouts": 2, "chunk_size": 2},
            "generation": {"max_new_tokens": 4},
            "reward": {"fn": "tests.helpers.rewards:hashed"},
        }
        for name, values in sections.items():
            if values is None:
                cfg.pop(name, None)
            else:
                cfg[name] = dict(values) if replace else {**cfg.get(name, {}), **values}
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    return write


def cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().err


@pytest.fixture
def train_fails(capsys, write_cfg, run_dir):
    """`rallyrl train` on the valid config with these sections changed must be a user error naming every
    needle, raised before the run directory exists."""

    def check(*needles: str, **sections) -> None:
        assert_user_error(*cli(capsys, "train", str(write_cfg(**sections))), *needles)
        assert not run_dir.exists()

    return check


def assert_user_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    assert err.startswith("rallyrl: error: "), err
    for n in needles:
        assert n in err, f"{n!r} not in stderr: {err}"
    assert "Traceback" not in err


# --------------------------------------------------------------------------------------------------
# the config file itself


def test_missing_config_file(capsys, tmp_path):
    path = tmp_path / "missing.yaml"
    for argv in (["train", str(path)], ["train", str(path), "--nproc", "2"], ["check", str(path)]):
        assert_user_error(*cli(capsys, *argv), str(path))


def test_missing_config_file_through_the_real_entry_point(tmp_path):
    path = tmp_path / "missing.yaml"
    p = subprocess.run([sys.executable, "-m", "rallyrl.cli", "train", str(path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert p.returncode == 2, p.stderr
    assert str(path) in p.stderr and "Traceback" not in p.stderr


def test_unknown_key(train_fails):
    train_fails("'ppo.lrr'", "'ppo.lr'", ppo={"lrr": 1e-3})


def test_bad_override(capsys, write_cfg, run_dir):
    path = str(write_cfg())
    assert_user_error(*cli(capsys, "train", path, "--set", "rollout.chunk_size=x"), "rollout.chunk_size")
    assert_user_error(*cli(capsys, "train", path, "--set", "ppo.lrr=3e-4"), "'ppo.lrr'")
    assert_user_error(*cli(capsys, "check", path, "--set", "ppo.lr"), "ppo.lr")
    assert not run_dir.exists()


def test_check_prints_the_resolved_config(capsys, write_cfg):
    rc = main(["check", str(write_cfg()), "--set", "ppo.lr=3e-4"])
    out = capsys.readouterr().out
    assert rc == 0
    assert yaml.safe_load(out)["ppo"]["lr"] == pytest.approx(3e-4)


@pytest.mark.parametrize(
    "sections, key",
    [
        ({"rollout": {"chunk_size": 0}}, "rollout.chunk_size"),
        ({"rollout": {"num_rollouts": 0}}, "rollout.num_rollouts"),
        ({"reward": {"placement": "mian"}}, "reward.placement"),
    ],
)
def test_bad_values(train_fails, sections, key):
    train_fails(key, **sections)


def test_nproc_zero(capsys, write_cfg, run_dir):
    assert_user_error(*cli(capsys, "train", str(write_cfg()), "--nproc", "0"), "--nproc")
    assert not run_dir.exists()


# --------------------------------------------------------------------------------------------------
# prompts


def test_missing_prompts_file(train_fails, tmp_path):
    missing = tmp_path / "nope.jsonl"
    train_fails("data.prompts", str(missing), data={"prompts": str(missing)})


def test_missing_eval_prompts_file(train_fails, tmp_path):
    missing = tmp_path / "eval.jsonl"
    train_fails("eval_prompts", str(missing), data={"eval_prompts": str(missing)})


def test_prompts_unset(train_fails):
    train_fails("data.prompts", data=None)


def test_malformed_prompts_jsonl(train_fails, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    train_fails("data.prompts", f"{f}:2", data={"prompts": str(f)})
    f.write_text('{"prompt": "ok"}\nnot json\n')
    train_fails("data.prompts", f"{f}:2", data={"prompts": str(f)})


@pytest.fixture(scope="module")
def short_model(tmp_path_factory) -> Path:
    """A tiny GPT-2 that allows only 16 positions."""
    from rallyrl.testing import build_tiny_gpt2

    return build_tiny_gpt2(tmp_path_factory.mktemp("short") / "gpt2", n_layer=1, n_embd=16, n_positions=16)


def test_prompt_longer_than_the_model_allows(capsys, write_cfg, run_dir, short_model):
    long = "the cat sat on the mat " * 4
    path = write_cfg(model={"path": str(short_model)}, data={"prompts": ["the", long], "long_prompts": "error"})
    assert_user_error(*cli(capsys, "train", str(path)), "data.prompts", "prompt 1", "16 positions",
                      "generation.max_new_tokens")
    assert not run_dir.exists()


def test_eval_prompt_longer_than_the_model_allows(capsys, write_cfg, run_dir, short_model):
    long = "the cat sat on the mat " * 4
    path = write_cfg(model={"path": str(short_model)}, data={"prompts": ["the"], "eval_prompts": [long],
                                                             "long_prompts": "error"})
    assert_user_error(*cli(capsys, "train", str(path)), "data.eval_prompts", "prompt 0", "16 positions")
    assert not run_dir.exists()


def test_check_reports_long_prompts_that_a_run_would_skip(capsys, write_cfg, short_model):
    long = "the cat sat on the mat " * 4
    path = write_cfg(model={"path": str(short_model)}, data={"prompts": ["the", long, "a dog"]})
    assert main(["check", str(path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("# prompts:"))
    assert re.fullmatch(r"# prompts: 3 training \(longest \d+ tokens; 1 longer than 12 tokens \(the model's 16 "
                        r"positions minus generation.max_new_tokens=4\), first prompt 1: skipped when drawn "
                        r"\(data.long_prompts: skip\)\), 0 eval", line), line


def test_every_prompt_too_long_to_skip(capsys, write_cfg, run_dir, short_model):
    """data.long_prompts: skip (the default) with nothing left to train on: refused at start."""
    long = "the cat sat on the mat " * 4
    path = write_cfg(model={"path": str(short_model)}, data={"prompts": [long, long + "again"]})
    assert_user_error(*cli(capsys, "train", str(path)), "data.prompts: every prompt of the list is longer than",
                      "the model's 16 positions", "data.long_prompts: truncate_left")
    assert not run_dir.exists()


def test_prompt_plus_new_tokens_over_the_limit(capsys, write_cfg, run_dir, short_model):
    # a short prompt is fine, until max_new_tokens pushes it past n_positions
    path = write_cfg(model={"path": str(short_model)}, data={"prompts": ["the cat"]},
                     generation={"max_new_tokens": 16})
    assert_user_error(*cli(capsys, "train", str(path)), "data.prompts", "generation.max_new_tokens=16")
    assert not run_dir.exists()


# --------------------------------------------------------------------------------------------------
# model folder


def test_missing_model_folder(train_fails, tmp_path):
    missing = tmp_path / "no-model"
    train_fails("model.path", str(missing), model={"path": str(missing)})


def test_model_path_unset(train_fails):
    train_fails("model.path", model=None)


def test_model_folder_without_config_json(train_fails, tmp_path):
    empty = tmp_path / "empty-model"
    empty.mkdir()
    train_fails("model.path", str(empty), "config.json", model={"path": str(empty)})


def test_missing_tokenizer_folder(train_fails, tmp_path):
    missing = tmp_path / "no-tokenizer"
    train_fails("model.tokenizer_path", str(missing), model={"tokenizer_path": str(missing)})


@pytest.fixture
def model_without_tokenizer(tiny_model, tmp_path) -> Path:
    out = tmp_path / "no-tok-model"
    shutil.copytree(tiny_model, out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                 "merges.txt"):
        (out / name).unlink(missing_ok=True)
    assert (out / "config.json").is_file()
    return out


def test_model_folder_without_tokenizer(capsys, write_cfg, run_dir, model_without_tokenizer):
    rc, err = cli(capsys, "train", str(write_cfg(model={"path": str(model_without_tokenizer)})))
    assert_user_error(rc, err, "model.path", str(model_without_tokenizer), "tokenizer")
    assert not run_dir.exists()


def test_model_folder_without_tokenizer_still_stops_before_training(capsys, write_cfg, run_dir,
                                                                    model_without_tokenizer):
    # Whatever the message, it is a user error (exit 2) before anything starts.
    rc, err = cli(capsys, "train", str(write_cfg(model={"path": str(model_without_tokenizer)})))
    assert rc == 2 and "Traceback" not in err, err
    assert not run_dir.exists()


# --------------------------------------------------------------------------------------------------
# reward function import paths


def test_reward_module_missing(capsys, write_cfg, run_dir):
    path = write_cfg(reward={"fn": "no_such_module_xyz.rewards:score"})
    assert_user_error(*cli(capsys, "train", str(path)), "reward.fn", "no_such_module_xyz")
    assert not run_dir.exists()


def test_reward_attribute_missing(capsys, write_cfg, run_dir):
    path = write_cfg(reward={"fn": "tests.helpers.rewards:no_such_fn"})
    assert_user_error(*cli(capsys, "train", str(path)), "reward.fn", "tests.helpers.rewards", "no_such_fn")
    assert not run_dir.exists()


def test_reward_attribute_not_callable(train_fails, tmp_path):
    f = tmp_path / "my_rewards_notcallable.py"
    f.write_text("SCORE = 3\n")
    train_fails("reward.fn", "SCORE", "not callable", reward={"fn": f"{f}:SCORE"})


def test_reward_py_file_missing(train_fails, tmp_path):
    f = tmp_path / "missing_rewards.py"
    train_fails("reward.fn", str(f), reward={"fn": f"{f}:score"})


def test_reward_py_file_that_fails_to_import(train_fails, tmp_path):
    f = tmp_path / "broken_rewards.py"
    f.write_text("import no_such_dependency_xyz\n\ndef score(samples, prompts, outputs, **kw):\n    return []\n")
    train_fails("reward.fn", str(f), "no_such_dependency_xyz", reward={"fn": f"{f}:score"})


def test_reward_path_without_colon(train_fails):
    train_fails("reward.fn", "module:attr", reward={"fn": "tests.helpers.rewards"})


def test_reward_fns_entry_names_its_index(capsys, write_cfg, run_dir):
    path = write_cfg(replace=True, reward={"fns": [{"fn": "tests.helpers.rewards:hashed"},
                                                   {"fn": "tests.helpers.rewards:missing_one"}]})
    assert_user_error(*cli(capsys, "train", str(path)), "reward.fns[1].fn", "missing_one")
    assert not run_dir.exists()


def test_no_reward_function(train_fails):
    train_fails("reward.fn", reward=None)


def test_reward_factory_that_fails(capsys, write_cfg, run_dir):
    # reward.kwargs makes reward.fn a factory: fn(**kwargs) must build the reward function. A plain
    # reward function called with unexpected kwargs fails; that is a config error, not a traceback.
    path = write_cfg(reward={"fn": "tests.helpers.rewards:hashed", "kwargs": {"scale": 2}})
    assert_user_error(*cli(capsys, "train", str(path)), "reward.fn", "tests.helpers.rewards:hashed", "kwargs")
    assert not run_dir.exists()


# --------------------------------------------------------------------------------------------------
# conversational prompts and eval with k samples


def test_conversational_prompt_without_chat_template(train_fails):
    chat = [{"role": "user", "content": "the cat"}]
    train_fails("data.eval_prompts", "prompt 1 is a list of chat messages", "has no chat template",
                data={"eval_prompts": ["a dog", chat]})


def test_malformed_chat_messages(train_fails):
    train_fails("data.prompts", "item 1: chat message 0 has no string 'role'",
                data={"prompts": ["the cat", {"prompt": [{"content": "a dog"}]}]})


def test_eval_samples_per_prompt_needs_sampling(train_fails):
    train_fails("eval.samples_per_prompt=4 needs eval.do_sample: true", eval={"samples_per_prompt": 4})
