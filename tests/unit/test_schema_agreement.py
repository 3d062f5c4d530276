"""The JSON schema and the loader accept and refuse the same values (issue 28 item 6), for every field of
the dataclasses x every kind of value: null, booleans, ints, ints given as floats (2.0), fractions,
numbers given as text ("2", "5e-1"), text, each choice of an enum, lists and mappings. The fields and
their types, ranges and choices are read from the dataclasses, not listed here.

The rules both follow (docs/config.md, "Values"):
- 2.0 is 2 for an integer key (JSON cannot tell them apart; 1.5 is refused);
- text is never a number or a boolean: `lr: 3e-5` in YAML is a number because rallyrl reads YAML 1.2,
  as editors do (a `"3e-5"` string is refused, naming the YAML 1.1 cause);
- booleans are true / false; an enum's choices are exact strings; null only where a key may be null.
Non-finite numbers are left out: JSON has none (the loader refuses them, test_config_guards.py).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

import jsonschema
import pytest

from rallyrl.config import Config, ConfigError, load_config, load_yaml
from rallyrl.config.fields import bounds, in_range
from rallyrl.config.schema import config_schema

VALIDATOR = jsonschema.Draft202012Validator(config_schema())

# What a key needs from other keys to be judged on its own (checks across keys the schema leaves to the
# loader: `rallyrl check`).
CONTEXT: dict[str, dict[str, Any]] = {
    "eval.samples_per_prompt": {"eval": {"do_sample": True}},
    "ppo.estimator": {"rollout": {"samples_per_prompt": 2}},
    "ppo.drop_zero_std_groups": {"ppo": {"estimator": "grpo"}, "rollout": {"samples_per_prompt": 2}},
    "rollout.dynamic_sampling": {"ppo": {"estimator": "grpo"}, "rollout": {"samples_per_prompt": 2}},
    "reward.overlap": {"reward": {"url": "http://localhost:8000"}},
    "ppo.engine_correction": {"generation": {"engine": "vllm"}},  # corrects for a separate engine only
    "reward.server": {"reward": {"fn": "a:b"}},
    "reward.server_args": {"reward": {"server": "local", "fn": "a:b"}},
}
# Keys whose text the loader checks beyond its type (the schema leaves that to `rallyrl check`): their text
# kinds use a text the loader accepts.
VALID_TEXT = {"reward.url": "http://localhost:8000", "model.lora.target_modules": "all-linear",
              "reward.server_args": "--no-batching"}


def fields() -> list[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, annotation) of every field, sections and reward.fns entries included."""
    out = []

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            tp, key = typing.get_type_hints(cls)[f.name], f"{prefix}.{f.name}" if prefix else f.name
            out.append((key, f, tp))
            if dataclasses.is_dataclass(tp):
                walk(tp, key)
            elif typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
                walk(typing.get_args(tp)[0], f"{key}[]")

    walk(Config, "")
    return out


def choices(tp: Any) -> list[Any]:
    """Every enum choice that appears in the annotation (also inside unions and lists)."""
    if typing.get_origin(tp) is Literal:
        return list(typing.get_args(tp))
    return [c for arg in typing.get_args(tp) for c in choices(arg)]


def kinds(key: str, f: dataclasses.Field, tp: Any) -> dict[str, Any]:
    b = bounds(f)
    whole = next((v for v in (2, 1, 0) if in_range(v, b)), 2)
    fraction = next((v for v in (0.5, 1.5, 2.5) if in_range(v, b)), 0.5)
    text = VALID_TEXT.get(key)
    out = {"null": None, "true": True, "false": False, "int": whole, "int as float": float(whole),
           "fraction": fraction, "int as text": text or str(whole), "exponent as text": text or "5e-1",
           "text": text or "x", "list": [text or "x"], "empty list": [], "mapping": {}}
    out.update({f"choice {c!r}": c for c in choices(tp)})
    out.update({f"[choice {c!r}]": [c] for c in choices(tp) if typing.get_origin(tp) is not Literal})
    return out


def data_for(key: str, value: Any) -> dict[str, Any]:
    data: dict[str, Any] = {s: dict(v) for s, v in CONTEXT.get(key.replace("[]", ""), {}).items()}
    if "fns[]." in key:  # a field of a reward.fns entry: in an entry that is otherwise valid
        entry = {"fn": "a:b", key.rsplit(".", 1)[1]: value}
        data.setdefault("reward", {})["fns"] = [entry]
        return data
    *parents, leaf = key.split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return data


CASES = [(key, kind, value) for key, f, tp in fields() for kind, value in kinds(key, f, tp).items()]


def test_the_cases_cover_every_field_and_kind():
    keys = {key for key, _, _ in CASES}
    assert {"ppo.lr", "train.iterations", "model.lora.r", "reward.fns[].weight", "ppo", "model.lora"} <= keys
    assert len(CASES) > 12 * 90


@pytest.mark.parametrize("key, kind, value", CASES, ids=[f"{k}-{kind}" for k, kind, _ in CASES])
def test_the_schema_and_the_loader_agree(key, kind, value):
    data = data_for(key, value)
    schema_errors = [e.message for e in VALIDATOR.iter_errors(data)]
    try:
        load_config(data)
        loader_error = None
    except ConfigError as e:
        loader_error = str(e)
    assert (not schema_errors) == (loader_error is None), (
        f"{key} = {value!r} ({kind}): the schema says {schema_errors or 'valid'}, the loader "
        f"{loader_error or 'accepts it'}")


# The rules, each at its example.

def test_an_int_given_as_a_float_is_the_int():
    cfg = load_config({"train": {"iterations": 2.0}, "rollout": {"num_rollouts": 1e2, "chunk_size": 4}})
    assert cfg.train.iterations == 2 and type(cfg.train.iterations) is int and cfg.rollout.num_rollouts == 100
    with pytest.raises(ConfigError, match=r"^train\.iterations: expected an integer, got float 1\.5$"):
        load_config({"train": {"iterations": 1.5}})


def test_3e_5_in_yaml_is_a_number_and_as_text_is_refused_naming_the_cause(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  lr: 3e-5\n  adam_eps: 1E-8\ntrain:\n  run_dir: '1e3'\n")
    cfg = load_config(path)
    assert cfg.ppo.lr == 3e-5 and cfg.ppo.adam_eps == 1e-8 and cfg.train.run_dir == "1e3"
    with pytest.raises(ConfigError, match=r"^ppo\.lr: expected a number, got str '3e-5' \(a string: YAML 1\.1"):
        load_config({"ppo": {"lr": "3e-5"}})
    assert not VALIDATOR.is_valid({"ppo": {"lr": "3e-5"}}) and VALIDATOR.is_valid(load_yaml(path.read_text()))


@pytest.mark.parametrize("text, value", [
    ("3e-5", 3e-5), ("1E6", 1e6), ("1.0e+5", 1e5), ("0o17", 15), ("0x1F", 31), ("true", True), ("False", False),
    ("~", None), ("null", None), (".inf", float("inf")), ("2024-01-01", "2024-01-01"), ("=", "="),
])
def test_yaml_is_read_as_yaml_1_2(text, value):
    assert load_yaml(f"a: {text}")["a"] == value


@pytest.mark.parametrize("text, message", [
    ("yes", "is not valid YAML: line 2: yes is True in YAML 1.1 but 'yes' in YAML 1.2 (rallyrl and editors read "
            "YAML 1.2): write true, or 'yes' in quotes for the text"),
    ("off", "write false, or 'off' in quotes"),
    ("1_000", "1_000 is 1000 in YAML 1.1 but '1_000' in YAML 1.2"),
    ("010", "010 is 8 in YAML 1.1 but 10 in YAML 1.2 (rallyrl and editors read YAML 1.2): write 10"),
])
def test_what_yaml_1_1_reads_otherwise_is_an_error_naming_both(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(f"generation:\n  do_sample: {text}\n")
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    assert message in str(ei.value)


def test_a_choice_named_no_is_written_in_quotes(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  mixed_precision: no\n")
    with pytest.raises(ConfigError, match="'no' in quotes for the text"):
        load_config(path)  # YAML 1.1 made it false, which no choice is; 1.2 makes it 'no': say so, not guess
    path.write_text("train:\n  mixed_precision: 'no'\n")
    assert load_config(path).train.mixed_precision == "no"


def test_an_unsupported_choice_is_refused_by_both():
    with pytest.raises(ConfigError, match=r"^train\.mixed_precision=fp16 is not supported: float16 training"):
        load_config({"train": {"mixed_precision": "fp16"}})
    assert not VALIDATOR.is_valid({"train": {"mixed_precision": "fp16"}})


def test_a_written_config_reads_back_the_same_with_yaml_1_1_and_1_2():
    import yaml

    cfg = load_config({"train": {"run_dir": "1e3", "resume": "no"}, "data": {"split": "yes", "subset": "0o7"}})
    text = cfg.to_yaml()
    assert load_config(yaml.safe_load(text)) == cfg == load_config(load_yaml(text))
