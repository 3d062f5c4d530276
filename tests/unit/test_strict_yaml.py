"""Strict YAML: a key given twice (at any level, in a file or a --set value) is an error naming the key
and both lines; a config that is not a mapping is refused; YAML tags never construct objects."""

from __future__ import annotations

import pytest

from rallyrl.config import ConfigError, load_config, parse_overrides


def _load(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_config(path)


@pytest.mark.parametrize("text, key, lines", [
    ("train:\n  iterations: 1\n  seed: 2\n  iterations: 3\n", "iterations", (2, 4)),
    ("train:\n  seed: 1\nppo:\n  lr: 0.1\ntrain:\n  iterations: 3\n", "train", (1, 5)),
    ("reward:\n  fn: m:f\n  kwargs:\n    a: {x: 1, x: 2}\n", "x", (4, 4)),
    ("data:\n  prompts:\n    - {prompt: a, label: 1, label: 2}\n", "label", (3, 3)),
])
def test_a_key_given_twice_names_the_key_and_both_lines(tmp_path, text, key, lines):
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, text)
    msg = str(e.value)
    assert f"key '{key}' is given twice (lines {lines[0]} and {lines[1]})" in msg, msg
    assert "\n" not in msg and str(tmp_path / "c.yaml") in msg


def test_a_key_given_twice_in_a_set_value(tmp_path):
    with pytest.raises(ConfigError, match=r"^--set reward.kwargs: .*key 'a' is given twice \(lines 1 and 1\)"):
        parse_overrides(["reward.kwargs={a: 1, a: 2}"])
    assert parse_overrides(["reward.kwargs={a: 1, b: 2}"]) == [("reward.kwargs", {"a": 1, "b": 2})]


def test_merge_keys_may_override_and_distinct_keys_pass(tmp_path):
    cfg = _load(tmp_path, "train:\n  seed: 1\n  iterations: 2\nreward:\n  kwargs:\n    <<: {a: 1, b: 2}\n    a: 3\n")
    assert cfg.train.iterations == 2 and cfg.reward.kwargs == {"a": 3, "b": 2}


@pytest.mark.parametrize("text, what", [("- a\n- b\n", "list"), ("just text\n", "str"), ("3\n", "int")])
def test_a_config_that_is_not_a_mapping_is_refused(tmp_path, text, what):
    with pytest.raises(ConfigError, match=rf"must hold a mapping of sections .* at the top level, not a {what}$"):
        _load(tmp_path, text)


def test_an_empty_file_is_every_default(tmp_path):
    assert _load(tmp_path, "").train.iterations == load_config({}).train.iterations


@pytest.mark.parametrize("text", [
    "!!python/object/apply:os.system ['touch {marker}']\n",
    "train:\n  run_dir: !!python/object/apply:os.system ['touch {marker}']\n",
    "train:\n  run_dir: !!python/name:os.system\n",
    "train: !custom {{}}\n",
])
def test_yaml_tags_never_construct_objects(tmp_path, text):
    marker = tmp_path / "constructed"
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, text.format(marker=marker))
    msg = str(e.value)
    assert "YAML tag" in msg and "is not allowed" in msg and "line " in msg and "\n" not in msg, msg
    assert not marker.exists()
    with pytest.raises(ConfigError, match="YAML tag '!!python/object/apply:os.system' is not allowed"):
        parse_overrides([f"train.run_dir=!!python/object/apply:os.system ['touch {marker}']"])
    assert not marker.exists()


def test_a_syntax_error_is_one_line_with_its_position(tmp_path):
    with pytest.raises(ConfigError, match=r"is not valid YAML: line \d+, column \d+: .*") as e:
        _load(tmp_path, "train:\n  iterations: [1\n")
    assert "\n" not in str(e.value)
