"""Newcomer mistakes, one table: each bad input -> its exit code, exactly one line on stderr, and nothing
written to the run directory. `rallyrl check` (the dry run) fails with exactly the line `train` gives.

Runs ``rallyrl.cli.main`` in-process on the tiny model (tests/smoke: it builds one). Every case is also
run as ``check`` and with ``--nproc 2``, where the launcher must find it before it starts a worker
(``subprocess.Popen`` is patched to fail the test).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from rallyrl.cli import main

pytestmark = pytest.mark.smoke


@dataclass
class Case:
    id: str
    make: Callable[[Path, Path], tuple[dict, list[str]]]  # (tmp, model) -> (config changes, --set items)
    needles: tuple[str, ...]
    code: int = 2


def _cfg(tmp: Path, model: Path, /, **sections) -> dict:
    cfg = {
        "model": {"path": str(model)},
        "data": {"prompts": ["the cat", "a dog"]},
        "train": {"run_dir": str(tmp / "run"), "iterations": 1, "num_threads": 1, "progress": False},
        "rollout": {"num_rollouts": 2, "chunk_size": 2},
        "generation": {"max_new_tokens": 4},
        "reward": {"fn": "tests.helpers.rewards:hashed"},
    }
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    return cfg


def _bad_bytes_prompts(tmp, model):
    f = tmp / "prompts.txt"
    f.write_bytes(b"the cat\nun caf\xe9\n")  # Latin-1, as an old editor saves it
    return {"data": {"prompts": str(f)}}, []


def _model_copy(tmp: Path, model: Path, name: str) -> Path:
    out = tmp / name
    shutil.copytree(model, out)
    return out


def _broken_config_json(tmp, model):
    m = _model_copy(tmp, model, "broken-config")
    (m / "config.json").write_text('{"model_type": "gpt2", "n_embd": 64,')  # cut off mid-write
    return {"model": {"path": str(m)}}, []


def _unknown_model_type(tmp, model):
    m = _model_copy(tmp, model, "unknown-type")
    cfg = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps({**cfg, "model_type": "no-such-architecture"}))
    return {"model": {"path": str(m)}}, []


def _no_weights(tmp, model):
    m = _model_copy(tmp, model, "no-weights")
    for f in m.glob("*.safetensors"):
        f.unlink()
    return {"model": {"path": str(m)}}, []


CASES = [
    Case("nan-lr", lambda t, m: ({}, ["ppo.lr=.nan"]), ("ppo.lr: must be a finite number, got nan",)),
    Case("nan-clip-range", lambda t, m: ({}, ["ppo.clip_range=.nan"]), ("ppo.clip_range: must be a finite",)),
    Case("inf-timeout", lambda t, m: ({}, ["dist.timeout_s=.inf"]), ("dist.timeout_s: must be a finite number",)),
    Case("typo-in-key", lambda t, m: ({}, ["ppo.lrr=3e-4"]), ("unknown config key 'ppo.lrr'", "'ppo.lr'")),
    Case("lr-as-words", lambda t, m: ({}, ["ppo.lr=fast"]), ("ppo.lr: expected a number, got str 'fast'",)),
    Case("non-utf8-prompts", _bad_bytes_prompts, ("data.prompts:", "prompts.txt is not UTF-8 text (byte 0xe9",
                                                  "save it as UTF-8")),
    Case("broken-config-json", _broken_config_json, ("model.path:", "config.json is not valid JSON",
                                                     "save_pretrained")),
    Case("unknown-model-type", _unknown_model_type, ("model.path:", "config.json is not a usable model config",)),
    Case("no-weights", _no_weights, ("model.path:", "has no weights", "*.safetensors")),
    Case("reward-module-typo", lambda t, m: ({"reward": {"fn": "tests.helpers.reward:hashed"}}, []),
         ("reward.fn: cannot import module 'tests.helpers.reward'",)),
    Case("too-many-minibatches", lambda t, m: ({"ppo": {"num_minibatches": 3}}, []),
         ("ppo.num_minibatches=3 exceeds the smallest per-rank batch",)),
    Case("resume-latest-without-checkpoint", lambda t, m: ({}, ["train.resume=latest"]),
         ("train.resume=latest: no checkpoint in", "; start a new run with --set train.resume=auto")),
    Case("resume-from-missing-folder", lambda t, m: ({}, [f"train.resume={t / 'nope'}"]),
         ("checkpoint not found:", "nope")),
]


@pytest.fixture
def no_workers(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a worker was started before the bad input was found")

    monkeypatch.setattr(subprocess, "Popen", boom)


def _one_line(capsys, argv: list[str]) -> tuple[int, str]:
    rc = main(argv)
    err = capsys.readouterr().err
    return rc, err


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_newcomer_mistake(case, tmp_path, tiny_model, capsys, no_workers):
    changes, sets = case.make(tmp_path, tiny_model)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_cfg(tmp_path, tiny_model, **changes)))
    argv = ["train", str(path), *[a for s in sets for a in ("--set", s)]]
    rc, err = _one_line(capsys, argv)
    assert rc == case.code, err
    assert err.count("\n") == 1 and err.startswith("rallyrl: error: "), err  # exactly one line
    for n in case.needles:
        assert n in err, f"{n!r} not in {err!r}"
    assert not (tmp_path / "run").exists()  # nothing written
    # The dry run and the 2-process launcher fail with the same line, before any worker exists (with 2
    # processes, 2 rollouts are still enough: 1 per rank, 1 minibatch).
    for other in (["check", *argv[1:]], [*argv, "--nproc", "2"]):
        if case.id == "too-many-minibatches" and "--nproc" in other:
            continue  # 1 sample per rank: the message names the 2-process split instead (next test)
        assert _one_line(capsys, other) == (rc, err), other
    assert not (tmp_path / "run").exists()


def test_too_many_minibatches_for_n_processes_in_check_as_in_train(tmp_path, tiny_model, capsys, no_workers):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_cfg(tmp_path, tiny_model, rollout={"num_rollouts": 4},
                                        ppo={"num_minibatches": 2})))
    assert main(["check", str(path)]) == 0  # 4 samples in 1 process: fine
    capsys.readouterr()
    expected = ("rallyrl: error: ppo.num_minibatches=2 exceeds the smallest per-rank batch (1 = "
                "rollout.num_rollouts 4 split over 4 processes); every rank must take the same number of "
                "optimizer steps\n")
    assert _one_line(capsys, ["check", str(path), "--nproc", "4"]) == (2, expected)
    assert _one_line(capsys, ["train", str(path), "--nproc", "4"]) == (2, expected)


def test_a_config_with_a_bom_is_read(tmp_path, tiny_model, capsys):
    path = tmp_path / "config.yaml"
    path.write_bytes(b"\xef\xbb\xbf" + yaml.safe_dump(_cfg(tmp_path, tiny_model)).encode())
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "# ok: this config trains on 1 process(es)" in out
    assert "# batch plan: 2 rollouts per iteration, 2 per rank, 1 chunk round(s)" in out


def test_a_non_utf8_config_file_is_one_line(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_bytes(b"train:\n  run_dir: runs/caf\xe9\n")
    rc, err = _one_line(capsys, ["train", str(path)])
    assert (rc, err) == (2, f"rallyrl: error: config file {path} is not UTF-8 text (byte 0xe9 at offset 26); "
                            f"save it as UTF-8\n")


def test_a_module_path_resolves_from_the_working_directory(tmp_path, tiny_model, capsys, monkeypatch):
    # `my_pkg_quickcheck.scores:score`, a package in the folder rallyrl runs in: found as `python -m` would
    pkg = tmp_path / "my_pkg_quickcheck"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scores.py").write_text("def score(samples, prompts, outputs, **kw):\n    return [1.0] * len(samples)\n")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_cfg(tmp_path, tiny_model, reward={"fn": "my_pkg_quickcheck.scores:score"})))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    assert main(["check", str(path)]) == 0, capsys.readouterr().err
    assert "# reward: score (weight 1)" in capsys.readouterr().out
