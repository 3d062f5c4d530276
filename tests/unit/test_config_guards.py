"""Non-finite numbers, the fields of issue #13, config_changes and UTF-8 reading (all pure, ms)."""

from __future__ import annotations

import math
import typing

import pytest

from rallyrl.config import (
    DTYPES,
    FREE_TO_CHANGE,
    Change,
    Config,
    ConfigError,
    ModelConfig,
    config_changes,
    format_changes,
    load_config,
    read_text,
)

# --------------------------------------------------------------------------------------------------
# every float must be finite


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "1e400"])
@pytest.mark.parametrize("key", ["ppo.lr", "ppo.clip_range", "dist.timeout_s", "generation.temperature",
                                 "ppo.target_kl", "ppo.reward_clip", "model.value_head_std", "ppo.gamma"])
def test_non_finite_floats_are_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"^{key}: must be a finite number, got (nan|-?inf)$"):
        load_config({}, [f"{key}={value}"])


def test_non_finite_in_a_reward_fns_weight_names_the_entry():
    with pytest.raises(ConfigError, match=r"reward\.fns\[1\]\.weight: must be a finite number"):
        load_config({"reward": {"fns": [{"fn": "a:b"}, {"fn": "a:c", "weight": float("nan")}]}})


def test_every_float_field_is_covered():
    # The check is generic (in _build), so every float field of every section refuses NaN; list them
    # so a new float field is exercised too.
    cfg = Config()
    floats = []
    for section in cfg.to_dict():
        hints = typing.get_type_hints(type(getattr(cfg, section)))
        floats += [f"{section}.{k}" for k, tp in hints.items() if tp is float or float in typing.get_args(tp)]
    assert len(floats) > 15
    for key in floats:
        with pytest.raises(ConfigError, match=rf"^{key}: must be a finite number"):
            load_config({}, [f"{key}=.nan"])


def test_free_form_kwargs_are_the_users_own():
    cfg = load_config({"reward": {"fn": "a:b", "kwargs": {"threshold": float("inf")}}})
    assert math.isinf(cfg.reward.kwargs["threshold"])


def test_finite_values_still_load():
    cfg = load_config({}, ["ppo.lr=3e-4", "dist.timeout_s=5", "ppo.target_kl=6"])
    assert cfg.ppo.lr == 3e-4 and cfg.dist.timeout_s == 5.0 and cfg.ppo.target_kl == 6.0


# --------------------------------------------------------------------------------------------------
# new fields (the trainer implements their behaviour)


def test_new_fields_defaults_and_checks():
    cfg = load_config({})
    assert cfg.train.allow_config_change is False and cfg.ppo.max_nonfinite_skips == 0
    assert load_config({}, ["train.resume=auto"]).train.resume == "auto"
    assert load_config({}, ["ppo.max_nonfinite_skips=3"]).ppo.max_nonfinite_skips == 3
    with pytest.raises(ConfigError, match=r"ppo\.max_nonfinite_skips must be >= 0, got -1"):
        load_config({}, ["ppo.max_nonfinite_skips=-1"])
    with pytest.raises(ConfigError, match="train.allow_config_change: expected true/false"):
        load_config({}, ["train.allow_config_change=yes please"])


def test_dtype_list_is_config_dtypes():
    assert typing.get_args(typing.get_type_hints(ModelConfig)["dtype"]) == DTYPES
    with pytest.raises(ConfigError, match=r"model\.dtype: expected one of \['float32', 'bfloat16', 'float16'\]"):
        load_config({"model": {"dtype": "fp16"}})


# --------------------------------------------------------------------------------------------------
# config_changes / format_changes


def test_no_change_after_a_yaml_round_trip():
    import yaml

    cfg = load_config({"data": {"prompts": ["a", "b"]}, "ppo": {"lr": 1}})
    assert config_changes(cfg.to_dict(), yaml.safe_load(cfg.to_yaml())) == []
    assert config_changes({"ppo": {"lr": 1}}, {"ppo": {"lr": 1.0}}) == []


def test_changes_that_alter_training_need_permission():
    old = load_config({"data": {"prompts": ["a", "b"]}}).to_dict()
    new = load_config({"data": {"prompts": ["a", "c"]}}, [
        "ppo.lr=2e-5", "rollout.num_rollouts=32", "train.seed=1", "ppo.epochs=2", "generation.top_k=5",
        "model.path=other", "reward.fn=m:f", "train.iterations=40", "train.progress=false",
        "checkpoint.interval=5", "checkpoint.keep_last=4", "train.tensorboard=true",
        "train.resume=latest", "train.allow_config_change=true"]).to_dict()
    got = {c.key: c for c in config_changes(old, new)}
    assert set(got) == {"data.prompts", "ppo.lr", "rollout.num_rollouts", "train.seed", "ppo.epochs",
                        "generation.top_k", "model.path", "reward.fn", "train.iterations", "train.progress",
                        "checkpoint.interval", "checkpoint.keep_last", "train.tensorboard", "train.resume",
                        "train.allow_config_change"}
    needs = {k for k, c in got.items() if c.needs_permission}
    assert needs == {"data.prompts", "ppo.lr", "rollout.num_rollouts", "train.seed", "ppo.epochs",
                     "generation.top_k", "model.path", "reward.fn"}
    assert got["ppo.lr"] == Change("ppo.lr", 1e-5, 2e-5, True)
    assert got["train.iterations"] == Change("train.iterations", 10, 40, False)
    assert got["data.prompts"].old == ["a", "b"] and got["data.prompts"].new == ["a", "c"]


def test_reward_kwargs_and_fns_compare_as_whole_values():
    old = {"reward": {"fn": "m:f", "kwargs": {"a": 1}, "fns": []}}
    new = {"reward": {"fn": "m:f", "kwargs": {"a": 2, "b": 3}, "fns": [{"fn": "m:g"}]}}
    assert config_changes(old, new) == [Change("reward.kwargs", {"a": 1}, {"a": 2, "b": 3}, True),
                                        Change("reward.fns", [], [{"fn": "m:g"}], True)]


def test_keys_only_one_side_has_are_changes_needing_permission():
    old = {"ppo": {"lr": 1e-5, "retired": 1}}
    new = {"ppo": {"lr": 1e-5, "max_nonfinite_skips": 3}}
    assert config_changes(old, new) == [Change("ppo.max_nonfinite_skips", "<absent>", 3, True),
                                        Change("ppo.retired", 1, "<absent>", True)]


def test_a_new_key_at_its_default_is_no_change():
    """A run recorded by an older rallyrl (its config.yaml lacks the options added since) resumes after an
    upgrade: a new key at its default keeps the behaviour the run had. Set to anything else, it is a change."""
    new = load_config({}).to_dict()
    old = {s: {k: v for k, v in keys.items() if (s, k) != ("data", "long_prompts")} for s, keys in new.items()}
    assert config_changes(old, new) == []
    new["data"]["long_prompts"] = "error"
    assert config_changes(old, new) == [Change("data.long_prompts", "<absent>", "error", True)]


def test_free_keys_exist_in_the_config():
    keys = set(_dotted(load_config({}).to_dict()))
    assert FREE_TO_CHANGE <= keys, FREE_TO_CHANGE - keys


def _dotted(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        out += _dotted(v, key) if isinstance(v, dict) and v and k != "kwargs" else [key]
    return out


def test_format_changes_lines():
    changes = [Change("ppo.lr", 1e-5, 2e-5, True), Change("model.tokenizer_path", None, "tok", True),
               Change("data.prompts", ["a" * 50, "b" * 50], ["c"], True), Change("x.y", "<absent>", 1, True)]
    assert format_changes(changes).splitlines() == [
        "  ppo.lr: 1.0e-05 -> 2.0e-05",
        "  model.tokenizer_path: null -> tok",
        f"  data.prompts: [{'a' * 50}, {'b' * 4}... -> [c]",
        "  x.y: <absent> -> 1",
    ]
    assert format_changes([]) == ""


# --------------------------------------------------------------------------------------------------
# UTF-8 files


def test_read_text_accepts_a_bom_and_names_bad_bytes(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_bytes(b"\xef\xbb\xbfppo:\n  lr: 0.5\n")
    assert read_text(f, "config file") == "ppo:\n  lr: 0.5\n"
    assert load_config(f).ppo.lr == 0.5
    f.write_bytes(b"ppo:\n  lr: 0.5 # caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"^config file {f} is not UTF-8 text \(byte 0xe9 at offset 20\); "
                                          r"save it as UTF-8$"):
        load_config(f)


def test_prompt_files_are_utf8(tmp_path):
    from rallyrl.data import DataError, load_prompts

    f = tmp_path / "p.txt"
    f.write_bytes("\ufeffcafé\nthe dog\n".encode())
    assert load_prompts(str(f)) == [{"prompt": "café"}, {"prompt": "the dog"}]
    j = tmp_path / "p.jsonl"
    j.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=rf"^data\.prompts: {j} is not UTF-8 text \(byte 0xe9"):
        load_prompts(str(j))
