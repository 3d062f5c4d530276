"""Strict config loading (rallyrl/config/): errors name the dotted key, overrides, the batch plan, and
the generated reference page (docs/config.md) cannot drift from the code."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from rallyrl.config import (
    Config,
    ConfigError,
    RewardFnSpec,
    config_markdown,
    load_config,
    make_batch_plan,
    parse_overrides,
)

ROOT = Path(__file__).resolve().parents[2]


def error_of(source=None, overrides=None) -> str:
    with pytest.raises(ConfigError) as ei:
        load_config(source, overrides)
    return str(ei.value)


# --------------------------------------------------------------------------------------------------
# unknown keys


def test_defaults_load():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg == load_config({}) == load_config(Config())


def test_unknown_key_names_dotted_key_and_suggests():
    msg = error_of({"ppo": {"lrr": 1e-4}})
    assert "'ppo.lrr'" in msg
    assert "did you mean 'ppo.lr'?" in msg


def test_unknown_section_names_it_and_suggests():
    msg = error_of({"ppoo": {"lr": 1e-4}})
    assert "'ppoo'" in msg
    assert "did you mean 'ppo'?" in msg


def test_unknown_section_without_close_match_has_no_suggestion():
    msg = error_of({"zzzz": {}})
    assert "'zzzz'" in msg and "did you mean" not in msg


def test_unknown_key_inside_a_list_of_sections():
    msg = error_of({"reward": {"fns": [{"fn": "a:b"}, {"fnn": "a:c"}]}})
    assert "'reward.fns[1].fnn'" in msg
    assert "did you mean 'reward.fns[1].fn'?" in msg


# --------------------------------------------------------------------------------------------------
# wrong types


@pytest.mark.parametrize(
    "data, key",
    [
        ({"rollout": {"chunk_size": "x"}}, "rollout.chunk_size"),
        ({"train": {"iterations": 1.5}}, "train.iterations"),
        ({"train": {"iterations": True}}, "train.iterations"),  # a bool is not an integer here
        ({"generation": {"do_sample": "yes"}}, "generation.do_sample"),
        ({"generation": {"do_sample": 1}}, "generation.do_sample"),
        ({"ppo": {"lr": "fast"}}, "ppo.lr"),
        ({"model": {"path": 3}}, "model.path"),
        ({"reward": {"batch_size": "x"}}, "reward.batch_size"),
        ({"data": {"prompts": 5}}, "data.prompts"),
        ({"reward": {"kwargs": [1, 2]}}, "reward.kwargs"),
        ({"generation": {"stop_sequences": "\n"}}, "generation.stop_sequences"),
        ({"generation": {"stop_sequences": ["ok", 7]}}, "generation.stop_sequences[1]"),
        ({"ppo": 3}, "ppo"),
    ],
)
def test_wrong_type_names_the_key(data, key):
    msg = error_of(data)
    assert msg.startswith(f"{key}:"), msg
    assert "expected" in msg


def test_int_is_accepted_for_a_float_field():
    cfg = load_config({"ppo": {"lr": 1, "clip_range": 1}})
    assert cfg.ppo.lr == 1.0 and isinstance(cfg.ppo.lr, float)


def test_optional_fields_accept_null():
    cfg = load_config({"ppo": {"max_grad_norm": None, "target_kl": None}, "reward": {"batch_size": None}})
    assert cfg.ppo.max_grad_norm is None and cfg.ppo.target_kl is None and cfg.reward.batch_size is None


@pytest.mark.parametrize(
    "data, key, suggestion",
    [
        ({"reward": {"placement": "mian"}}, "reward.placement", "main"),
        ({"ppo": {"lr_schedule": "cosin"}}, "ppo.lr_schedule", "cosine"),
        ({"model": {"dtype": "bfloat"}}, "model.dtype", "bfloat16"),
    ],
)
def test_literal_value_suggests_the_close_choice(data, key, suggestion):
    msg = error_of(data)
    assert msg.startswith(f"{key}:")
    assert f"did you mean {suggestion!r}?" in msg


def test_literal_value_lists_the_choices():
    msg = error_of({"ppo": {"kl_estimator": "k9"}})
    assert msg.startswith("ppo.kl_estimator:")
    assert all(c in msg for c in ("'k1'", "'k2'", "'k3'"))


# --------------------------------------------------------------------------------------------------
# values that types cannot express


@pytest.mark.parametrize(
    "data, key",
    [
        ({"rollout": {"num_rollouts": 0}}, "rollout.num_rollouts"),
        ({"rollout": {"num_rollouts": -4}}, "rollout.num_rollouts"),
        ({"rollout": {"chunk_size": 0}}, "rollout.chunk_size"),
        ({"generation": {"max_new_tokens": 0}}, "generation.max_new_tokens"),
        ({"generation": {"top_p": 0.0}}, "generation.top_p"),
        ({"generation": {"stop_sequences": [""]}}, "generation.stop_sequences"),
        ({"ppo": {"epochs": 0}}, "ppo.epochs"),
        ({"ppo": {"num_minibatches": 0}}, "ppo.num_minibatches"),
        ({"ppo": {"gamma": 1.5}}, "ppo.gamma"),
        ({"ppo": {"lam": -0.1}}, "ppo.lam"),
        ({"reward": {"batch_size": 0}}, "reward.batch_size"),
    ],
)
def test_out_of_range_values_name_the_key(data, key):
    assert key in error_of(data)


def test_reward_fn_and_fns_both_set_is_an_error():
    msg = error_of({"reward": {"fn": "pkg.mod:f", "fns": [{"fn": "pkg.mod:g"}]}})
    assert "reward.fn" in msg and "reward.fns" in msg


def test_reward_fns_entry_needs_fn():
    assert "reward.fns[0].fn" in error_of({"reward": {"fns": [{"weight": 2.0}]}})


def test_reward_fns_duplicate_names_are_an_error():
    msg = error_of({"reward": {"fns": [{"fn": "a.b:score"}, {"fn": "c.d:score"}]}})
    assert "duplicate" in msg and "score" in msg
    load_config({"reward": {"fns": [{"fn": "a.b:score"}, {"fn": "c.d:score", "name": "other"}]}})


# --------------------------------------------------------------------------------------------------
# files


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope" / "config.yaml"
    msg = error_of(path)
    assert str(path) in msg and "not found" in msg
    assert str(path) in error_of(str(path))


def test_invalid_yaml_names_the_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("ppo: {lr: [\n")
    assert str(path) in error_of(path)


def test_non_mapping_yaml_names_the_path(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    assert str(path) in error_of(path)


def test_empty_file_is_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == Config()


def test_yaml_file_values(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  lr: 3.0e-4\n  max_grad_norm: null\nrollout:\n  chunk_size: 8\n"
                    "data:\n  prompts: [a, b]\n")
    cfg = load_config(path)
    assert cfg.ppo.lr == pytest.approx(3e-4) and cfg.ppo.max_grad_norm is None
    assert cfg.rollout.chunk_size == 8 and cfg.data.prompts == ["a", "b"]


def test_yaml_file_exponent_without_dot_is_a_number(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  lr: 3e-4\n")
    assert load_config(path).ppo.lr == pytest.approx(3e-4)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config({"ppo": {"lr": 3e-4, "target_kl": 6.0}, "reward": {"fns": [{"fn": "a:b", "weight": 2}]},
                       "data": {"prompts": [{"prompt": "x", "label": 1}]}})
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg
    assert load_config(cfg.to_dict()) == cfg


# --------------------------------------------------------------------------------------------------
# --set overrides


@pytest.mark.parametrize(
    "item, key, value",
    [
        ("ppo.lr=3e-4", "ppo.lr", 3e-4),  # YAML 1.2 (as editors read it): a number, not 1.1's text
        ("train.run_dir='1e3'", "train.run_dir", "1e3"),  # ...so a text that looks like one is quoted
        ("ppo.lr=3.0e-4", "ppo.lr", 3e-4),
        ("ppo.lr=0.001", "ppo.lr", 0.001),
        ("train.iterations=3", "train.iterations", 3),
        ("generation.do_sample=false", "generation.do_sample", False),
        ("reward.batch_size=null", "reward.batch_size", None),
        ("data.prompts=[a, b]", "data.prompts", ["a", "b"]),
        ("train.run_dir=runs/exp.1", "train.run_dir", "runs/exp.1"),
        ("reward.fn=my.mod:score", "reward.fn", "my.mod:score"),
        ("model.path=", "model.path", ""),
        ("reward.kwargs={scale: 2}", "reward.kwargs", {"scale": 2}),
    ],
)
def test_parse_overrides_yaml_values(item, key, value):
    [(k, v)] = parse_overrides([item])
    assert k == key
    assert v == value and type(v) is type(value)


def test_overrides_apply_with_types(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  lr: 1.0e-5\n  epochs: 2\n")
    cfg = load_config(path, overrides=[
        "ppo.lr=3e-4", "rollout.num_rollouts=12", "data.prompts=[a, b, c]", "ppo.max_grad_norm=null",
        "train.run_dir=runs/x", 'generation.stop_sequences=["\\n", END]',
    ])
    assert cfg.ppo.lr == pytest.approx(3e-4) and isinstance(cfg.ppo.lr, float)
    assert cfg.ppo.epochs == 2  # untouched file value kept
    assert cfg.rollout.num_rollouts == 12
    assert cfg.data.prompts == ["a", "b", "c"]
    assert cfg.ppo.max_grad_norm is None
    assert cfg.train.run_dir == "runs/x"
    assert cfg.generation.stop_sequences == ["\n", "END"]


def test_later_override_wins():
    assert load_config({}, ["ppo.lr=1e-3", "ppo.lr=2e-3"]).ppo.lr == pytest.approx(2e-3)


def test_overrides_do_not_mutate_the_callers_dict():
    data = {"ppo": {"lr": 1e-5}}
    load_config(data, ["ppo.lr=3e-4"])
    assert data == {"ppo": {"lr": 1e-5}}


def test_override_of_unknown_key_is_strict():
    msg = error_of({}, ["ppo.lrr=3e-4"])
    assert "'ppo.lrr'" in msg and "did you mean 'ppo.lr'?" in msg
    assert "'nosuch'" in error_of({}, ["nosuch.x=1"])


def test_override_with_wrong_type_names_the_key():
    assert error_of({}, ["rollout.chunk_size=x"]).startswith("rollout.chunk_size:")
    assert error_of({}, ["train.iterations=1.5"]).startswith("train.iterations:")
    assert error_of({}, ["reward.placement=mian"]).startswith("reward.placement:")


def test_override_without_equals_is_an_error():
    assert "ppo.lr" in error_of({}, ["ppo.lr"])


def test_override_with_invalid_yaml_names_the_key():
    assert "data.prompts" in error_of({}, ["data.prompts=[a, b"])


def test_override_below_a_scalar_is_an_error():
    msg = error_of({"ppo": {"lr": 1e-5}}, ["ppo.lr.x=1"])
    assert "ppo.lr" in msg


# --------------------------------------------------------------------------------------------------
# derived batch plan


def plan_for(world_size: int, **rollout_ppo):
    rollout = {k: v for k, v in rollout_ppo.items() if k in ("num_rollouts", "chunk_size")}
    ppo = {k: v for k, v in rollout_ppo.items() if k in ("num_minibatches", "epochs")}
    return make_batch_plan(load_config({"rollout": rollout, "ppo": ppo}), world_size)


def test_batch_plan_uneven_split():
    plan = plan_for(2, num_rollouts=7, chunk_size=2, num_minibatches=3, epochs=2)
    assert plan.local_counts == (4, 3)  # the first num_rollouts % world_size ranks get one more
    assert plan.rounds == 2  # ceil(4 / 2): every rank enters the reward step twice
    assert [plan.offset(r) for r in range(2)] == [0, 4]
    assert [plan.round_counts(0, i) for i in range(2)] == [2, 2]
    assert [plan.round_counts(1, i) for i in range(2)] == [2, 1]
    assert plan.optimizer_steps_per_iteration == 6


def test_batch_plan_ranks_with_an_empty_round():
    plan = plan_for(3, num_rollouts=5, chunk_size=1)
    assert plan.local_counts == (2, 2, 1)
    assert plan.rounds == 2
    assert plan.round_counts(2, 1) == 0  # rank 2 still enters round 2, with no samples
    assert sum(plan.local_counts) == 5


def test_batch_plan_single_process():
    plan = plan_for(1, num_rollouts=7, chunk_size=2)
    assert plan.local_counts == (7,) and plan.rounds == 4 and plan.round_counts(0, 3) == 1


def test_batch_plan_fewer_rollouts_than_processes():
    with pytest.raises(ConfigError) as ei:
        plan_for(4, num_rollouts=3, chunk_size=2)
    assert "rollout.num_rollouts" in str(ei.value) and "4" in str(ei.value)


def test_batch_plan_minibatches_larger_than_smallest_shard():
    plan_for(2, num_rollouts=7, chunk_size=2, num_minibatches=3)  # smallest shard is 3: fine
    with pytest.raises(ConfigError) as ei:
        plan_for(2, num_rollouts=7, chunk_size=2, num_minibatches=4)
    msg = str(ei.value)
    assert "ppo.num_minibatches" in msg and "3" in msg


# --------------------------------------------------------------------------------------------------
# every shipped config loads

# YAML files that are not rallyrl configs (accelerate / DeepSpeed launcher configs) are recognised by
# their top-level keys and skipped.
_LAUNCHER_KEYS = {"compute_environment", "distributed_type", "deepspeed_config", "zero_optimization",
                  "train_micro_batch_size_per_gpu"}


def shipped_configs() -> list[Path]:
    found = []
    for folder in ("examples", "benchmarks"):
        for pattern in ("**/*.yaml", "**/*.yml"):
            found += (ROOT / folder).glob(pattern)
    return sorted(set(found))


_SHIPPED = shipped_configs()


@pytest.mark.parametrize(
    "path", _SHIPPED or [None], ids=[str(p.relative_to(ROOT)) for p in _SHIPPED] or ["none-yet"]
)
def test_shipped_config_loads(path):
    if path is None:
        pytest.skip("no YAML configs under examples/ or benchmarks/ yet")
    data = yaml.safe_load(path.read_text())
    if isinstance(data, dict) and _LAUNCHER_KEYS & set(data):
        pytest.skip(f"{path.name} is a launcher (accelerate/DeepSpeed) config")
    cfg = load_config(path)
    make_batch_plan(cfg, 1)


# --------------------------------------------------------------------------------------------------
# docs/config.md is generated from the field docs


def _section_classes() -> list[type]:
    """Every dataclass reachable from Config (sections and list-of-dataclass entries like reward.fns)."""
    seen: list[type] = []

    def visit(cls: type) -> None:
        if cls in seen:
            return
        seen.append(cls)
        for tp in typing.get_type_hints(cls).values():
            for t in (tp, *typing.get_args(tp)):
                if dataclasses.is_dataclass(t):
                    visit(t)

    visit(Config)
    return seen


def test_every_field_has_a_doc():
    classes = _section_classes()
    assert RewardFnSpec in classes
    missing = []
    for cls in classes:
        if cls is Config:
            continue  # its fields are the sections themselves
        for f in dataclasses.fields(cls):
            if not str(f.metadata.get("doc", "")).strip():
                missing.append(f"{cls.__name__}.{f.name}")
    assert not missing, f"fields without a doc: {missing}"


def test_every_key_is_in_the_generated_reference():
    md = config_markdown()
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        for f in dataclasses.fields(cls):
            assert f"`{section.name}.{f.name}`" in md


def test_docs_config_md_matches_the_code():
    path = ROOT / "docs" / "config.md"
    assert path.is_file(), "docs/config.md is missing: python -m rallyrl.config --markdown > docs/config.md"
    assert path.read_text().rstrip("\n") == config_markdown().rstrip("\n"), (
        "docs/config.md is out of date: regenerate it with "
        "`python -m rallyrl.config --markdown > docs/config.md`"
    )
