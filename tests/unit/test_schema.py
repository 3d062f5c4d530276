"""`rallyrl schema` (issue 20 item 3): a JSON Schema (draft 2020-12) of the whole config, generated from
the dataclasses. Every shipped config validates against it; a wrong type, an unknown key, a misspelled
choice and a value out of range are rejected; and for every number field the schema and the loader agree
on which values are allowed (both read each range from the field's metadata; a bound checked only in validate fails here)."""

from __future__ import annotations

import dataclasses
import json
import re
import typing

import jsonschema
import pytest
import yaml

from rallyrl.cli import main as cli_main
from rallyrl.config import Config, ConfigError, load_config
from rallyrl.config.fields import BOUNDS, _f, bounds, range_text
from rallyrl.schema import DRAFT, config_schema
from tests.unit.test_config import shipped_configs

SCHEMA = config_schema()
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
LAUNCHER_KEYS = {"compute_environment", "distributed_type", "deepspeed_config", "zero_optimization"}


def _errors(data: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(data)]


def test_it_is_a_valid_draft_2020_12_schema_of_every_section():
    assert SCHEMA["$schema"] == DRAFT
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert list(SCHEMA["properties"]) == [f.name for f in dataclasses.fields(Config)]
    lr = SCHEMA["properties"]["ppo"]["properties"]["lr"]
    assert lr["type"] == "number" and lr["default"] == 1e-5 and lr["exclusiveMinimum"] == 0
    assert lr["description"] == "AdamW learning rate."
    assert SCHEMA["properties"]["model"]["properties"]["arch"]["enum"] == ["causal", "seq2seq"]


@pytest.mark.parametrize("path", shipped_configs(), ids=lambda p: p.name if hasattr(p, "name") else str(p))
def test_every_shipped_config_validates(path):
    data = yaml.safe_load(path.read_text())
    if LAUNCHER_KEYS & set(data):
        pytest.skip("an accelerate/DeepSpeed launcher config")
    assert _errors(data) == []


def test_the_config_rallyrl_writes_validates():
    assert _errors(yaml.safe_load(load_config({}).to_yaml())) == []  # config.yaml of a run


@pytest.mark.parametrize("data, where", [
    ({"ppo": {"lr": "fast"}}, "ppo.lr: 'fast' is not of type 'number'"),
    ({"ppo": {"lrr": 1e-4}}, "ppo: Additional properties are not allowed ('lrr' was unexpected)"),
    ({"model": {"arch": "causl"}}, "model.arch: 'causl' is not one of ['causal', 'seq2seq']"),
    ({"generation": {"top_p": 1.5}}, "generation.top_p: 1.5 is greater than the maximum of 1"),
    ({"train": {"iterations": True}}, "train.iterations: True is not of type 'integer'"),
    ({"reward": {"fns": [{"weight": 2}]}}, "reward.fns.0: 'fn' is a required property"),
])
def test_it_rejects_what_the_loader_rejects(data, where):
    assert where in _errors(data)
    with pytest.raises(ConfigError):
        load_config(data)


def _number_fields():
    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp, key = hints[f.name], f"{prefix}.{f.name}" if prefix else f.name
            if dataclasses.is_dataclass(tp):
                yield from walk(tp, key)
                continue
            kinds = set(typing.get_args(tp) or (tp,)) - {type(None)}
            if kinds == {int} or kinds == {float}:
                yield key, kinds.pop()

    return list(walk(Config, ""))


# What a probed key needs from other keys to be judged on its own (a check across keys the schema leaves
# to the loader): G must divide the global batch; k eval samples need sampling.
CONTEXT = {"rollout.samples_per_prompt": {"rollout": {"num_rollouts": 2 * 10**6}},
           "eval.samples_per_prompt": {"eval": {"do_sample": True}}}


@pytest.mark.parametrize("key, kind", _number_fields(), ids=lambda v: v if isinstance(v, str) else "")
def test_schema_and_loader_agree_on_every_number(key, kind):
    probes = [-1, 0, 1, 2, 10**6] + ([-0.5, 0.5, 1.5] if kind is float else [])
    for v in probes:
        section, *rest = key.split(".")
        data: dict = {k: dict(v) for k, v in CONTEXT.get(key, {}).items()}
        node = data.setdefault(section, {})
        for part in rest[:-1]:
            node = node.setdefault(part, {})
        node[rest[-1]] = v
        try:
            load_config(data)
            loader_ok = True
        except ConfigError:
            loader_ok = False
        assert (not _errors(data)) == loader_ok, (
            f"{key}={v}: the loader {'accepts' if loader_ok else 'rejects'} it, the schema does not agree; "
            f"declare the range once, in the field's metadata (rallyrl/config/fields.py _f)")


def test_cli_prints_the_schema(capsys):
    assert cli_main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == SCHEMA


def _bounded_fields():
    """(dotted key, field) of every field that declares a range, found from the dataclasses."""
    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            if dataclasses.is_dataclass(hints[f.name]):
                yield from walk(hints[f.name], key)
            elif bounds(f):
                yield key, f
    return list(walk(Config, ""))


def test_each_range_is_declared_once_and_read_by_both():
    found = dict(_bounded_fields())
    assert len(found) >= 35 and "ppo.lr" in found and "model.lora.dropout" in found
    for key, f in found.items():
        section, *rest = key.split(".")
        prop = SCHEMA["properties"][section]
        for part in rest:
            prop = prop["properties"][part]
        # the schema's bound keywords are exactly the field's declaration
        assert {k: prop[k] for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum") if k in prop} \
            == {BOUNDS[k]: v for k, v in bounds(f).items()}, key


@pytest.mark.parametrize("key, bound, message", [
    ("ppo.epochs", {"gt": 0}, "> 0"), ("ppo.warmup_steps", {"ge": 0}, ">= 0"),
    ("generation.top_p", {"gt": 0, "le": 1}, "in (0, 1]"), ("ppo.gamma", {"ge": 0, "le": 1}, "in [0, 1]"),
    ("rollout.samples_per_prompt", {"ge": 1}, ">= 1"), ("model.lora.dropout", {"ge": 0, "le": 0}, "0"),
])
def test_the_validator_says_the_declared_range(key, bound, message):
    f = dict(_bounded_fields())[key]
    assert bounds(f) == bound and range_text(bound) == message
    bad = {"gt": lambda b: b, "ge": lambda b: b - 1}
    lo = next(k for k in ("gt", "ge") if k in bound)
    value = bad[lo](bound[lo])
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)} must be {re.escape(message)}, got {value}"):
        load_config({}, [f"{key}={value}"])


def test_a_misspelled_range_keyword_is_refused_where_the_field_is_declared():
    with pytest.raises(TypeError, match="unknown field metadata"):
        _f(1, "doc", gte=0)
