"""Unknown keys name the rallyrl key they most likely are (issue 28 item 5): a TRL / OpenRLHF / veRL option
name gets the rallyrl key and what differs, at the top level or inside a section; a nested key written
flat, or a rallyrl key in the wrong section, gets the full dotted key. Cases for the table come from the
table itself (rallyrl/config/peers.py)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from rallyrl.config import Config, ConfigError, load_config
from rallyrl.config.peers import PEER_OPTIONS

ROOT = Path(__file__).resolve().parents[2]


def error_of(data) -> str:
    with pytest.raises(ConfigError) as ei:
        load_config(data)
    return str(ei.value)


def nest(dotted: str, value) -> dict:
    *parents, leaf = dotted.split(".")
    out: dict = {leaf: value}
    for p in reversed(parents):
        out = {p: out}
    return out


def rallyrl_keys() -> set[str]:
    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            tp, key = typing.get_type_hints(cls)[f.name], f"{prefix}.{f.name}" if prefix else f.name
            yield key
            if dataclasses.is_dataclass(tp):
                yield from walk(tp, key)
    return set(walk(Config, ""))


@pytest.mark.parametrize("name, key", [
    ("beta", "ppo.init_kl_coef"), ("num_generations", "rollout.samples_per_prompt"),
    ("max_completion_length", "generation.max_new_tokens"), ("loss_type", "ppo.loss_aggregation"),
    ("epsilon_high", "ppo.clip_range_high"), ("epsilon", "ppo.clip_range"), ("scale_rewards", "ppo.group_scale"),
    ("learning_rate", "ppo.lr"),
])
@pytest.mark.parametrize("where", ["", "ppo.", "train."])
def test_trl_option_names_suggest_the_rallyrl_key(name, key, where):
    msg = error_of(nest(where + name, 1))
    assert msg.startswith(f"unknown config key '{where}{name}' (did you mean '{key}'? {name} is the TRL name")


def test_a_note_says_what_differs():
    beta = error_of({"beta": 0.04})
    assert "ppo.kl_in: loss" in beta and "k3" in beta
    loss_type = error_of({"ppo": {"loss_type": "dr_grpo"}})
    for peer, ours in (("grpo", "seq_mean_token_mean"), ("dapo", "token_mean"), ("dr_grpo", "seq_mean_token_sum")):
        assert f"`{peer}`" in loss_type and f"`{ours}`" in loss_type
    assert "`false` / `none` is `none`" in error_of({"scale_rewards": False})


def test_a_dotted_peer_name_matches_its_tail():
    assert "did you mean 'rollout.samples_per_prompt'? rollout.n is the veRL name" in error_of({"rollout": {"n": 8}})


def test_every_entry_of_the_table_names_a_real_key_and_is_suggested():
    keys = rallyrl_keys()
    names = [p.name for p in PEER_OPTIONS]
    assert len(names) == len(set(names)), "a peer name is listed twice"
    for p in PEER_OPTIONS:
        assert p.key in keys, f"{p.name} -> {p.key}: no such rallyrl key"
        assert p.name.rsplit(".", 1)[-1] not in {k.rsplit(".", 1)[-1] for k in keys}, (
            f"{p.name} is a rallyrl name too: the loader suggests it without the table")
        assert f"did you mean {p.key!r}? {p.name} is the {p.who} name" in error_of(nest(p.name, 1))


def test_the_docs_table_lists_every_peer_name():
    page = (ROOT / "docs" / "config.md").read_text()
    assert "## Coming from TRL / OpenRLHF / veRL" in page
    for p in PEER_OPTIONS:
        assert f"| `{p.name}` | {p.who} | `{p.key}` |" in page


@pytest.mark.parametrize("data, suggestion", [
    ({"model": {"lora_r": 4}}, "model.lora.r"),  # a nested key written flat
    ({"model": {"lora_rr": 4}}, "model.lora.r"),  # ... and misspelled
    ({"model": {"r": 4}}, "model.lora.r"),  # a nested key one level too high
    ({"train": {"lr": 1e-5}}, "ppo.lr"),  # a rallyrl key in the wrong section
    ({"temperature": 0.7}, "generation.temperature"),  # ... or at the top level
    ({"ppo": {"temperatur": 0.7}}, "generation.temperature"),  # a near miss of a key in another section
    ({"ppo": {"lrr": 1e-4}}, "ppo.lr"),  # a near miss in its own section (as before)
])
def test_nested_and_misplaced_keys_suggest_the_full_dotted_key(data, suggestion):
    assert error_of(data).endswith(f"(did you mean {suggestion!r}?)")


def test_a_name_in_two_sections_suggests_both():
    assert error_of({"interval": 3}).endswith("(did you mean 'eval.interval' or 'checkpoint.interval'?)")
