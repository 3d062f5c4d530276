"""The config keys of issue 29 (GSPO, CISPO, dual clip, dynamic sampling, overlong shaping, masking
truncated responses): defaults that leave today's configs unchanged, every refusal naming the key, the
GSPO pairing warning, the docs and the schema."""

from __future__ import annotations

import pytest

from rallyrl.config import Config, ConfigError, config_warnings, load_config

GRPO = {"ppo": {"estimator": "grpo"}, "rollout": {"num_rollouts": 8, "samples_per_prompt": 4}}


def _load(*sections: dict, **extra) -> Config:
    data: dict = {}
    for sec in (GRPO, *sections):
        for k, v in sec.items():
            data.setdefault(k, {}).update(v)
    return load_config(data, **extra)


def test_defaults_change_nothing():
    c = Config()
    assert (c.ppo.ratio_level, c.ppo.policy_loss, c.ppo.dual_clip, c.ppo.mask_truncated) == ("token", "ppo", None, False)
    assert (c.ppo.sequence_clip_range, c.ppo.sequence_clip_range_high) == (3e-4, 4e-4)  # the GSPO paper
    assert (c.ppo.cispo_clip_low, c.ppo.cispo_clip_high) == (None, 4.0)  # no lower bound; weight <= 5 (TRL)
    assert (c.rollout.dynamic_sampling, c.rollout.max_sampling_rounds) == (False, 10)
    assert c.reward.overlong_buffer is None
    assert c.ppo.clip_range == 0.2 and c.ppo.clip_range_high is None  # the token ratio's keys keep their meaning


def test_each_option_loads():
    c = _load({"ppo": {"ratio_level": "sequence", "loss_aggregation": "seq_mean_token_mean", "dual_clip": 3}})
    assert c.ppo.dual_clip == 3.0 and config_warnings(c) == []
    c = _load({"ppo": {"policy_loss": "cispo", "cispo_clip_low": 0.5, "cispo_clip_high": 0.2}})
    assert (c.ppo.cispo_clip_low, c.ppo.cispo_clip_high) == (0.5, 0.2)
    c = _load({"rollout": {"dynamic_sampling": True, "max_sampling_rounds": 3}, "ppo": {"mask_truncated": True}})
    assert c.rollout.dynamic_sampling and c.ppo.mask_truncated
    c = _load({"reward": {"overlong_buffer": {"length": 8}}, "generation": {"max_new_tokens": 8}})
    assert (c.reward.overlong_buffer.length, c.reward.overlong_buffer.penalty) == (8, 1.0)
    # gae takes the loss variants too
    c = load_config({"ppo": {"ratio_level": "sequence", "dual_clip": 2.0, "mask_truncated": True}})
    assert c.ppo.estimator == "gae"
    assert load_config({"ppo": {"policy_loss": "cispo"}}).ppo.policy_loss == "cispo"


@pytest.mark.parametrize("sections, message", [
    ({"ppo": {"dual_clip": 1.0}}, r"ppo.dual_clip must be > 1"),
    ({"ppo": {"dual_clip": 0.5}}, r"ppo.dual_clip must be > 1"),
    ({"ppo": {"sequence_clip_range": 0}}, r"ppo.sequence_clip_range must be > 0"),
    ({"ppo": {"sequence_clip_range_high": -1e-4}}, r"ppo.sequence_clip_range_high must be > 0"),
    ({"ppo": {"cispo_clip_low": 0}}, r"ppo.cispo_clip_low must be > 0"),
    ({"ppo": {"cispo_clip_high": 0}}, r"ppo.cispo_clip_high must be > 0"),
    ({"ppo": {"policy_loss": "cispo", "ratio_level": "sequence"}}, r"ppo.ratio_level='sequence' does not apply "
                                                                   r"to ppo.policy_loss=cispo"),
    ({"ppo": {"policy_loss": "cispo", "dual_clip": 3}}, r"ppo.dual_clip=3.0 does not apply to ppo.policy_loss=cispo"),
    ({"ppo": {"policy_loss": "cispo", "clip_range_high": 0.28}}, r"ppo.clip_range_high=0.28 does not apply"),
    ({"ppo": {"ratio_level": "sequence", "clip_range_high": 0.28}}, r"set ppo.sequence_clip_range_high"),
    ({"ppo": {"policy_loss": "grpo"}}, r"ppo.policy_loss: expected one of \['ppo', 'cispo'\]"),
    ({"ppo": {"ratio_level": "seq"}}, r"ppo.ratio_level: expected one of \['token', 'sequence'\]"),
    ({"rollout": {"dynamic_sampling": True, "max_sampling_rounds": 0}}, r"rollout.max_sampling_rounds must be >= 1"),
    ({"reward": {"overlong_buffer": {}}}, r"reward.overlong_buffer.length must be >= 1, got 0: required when "
                                          r"reward.overlong_buffer is set"),
    ({"reward": {"overlong_buffer": {"length": 33}}}, r"reward.overlong_buffer.length must be in \[1, "),
    ({"reward": {"overlong_buffer": {"length": 4, "penalty": 0}}}, r"reward.overlong_buffer.penalty must be > 0"),
    ({"reward": {"overlong_buffer": {"length": 4, "size": 2}}}, r"reward.overlong_buffer.size"),
    ({"reward": {"overlong_buffer": {"length": 4}, "fns": [{"fn": "m:a", "name": "overlong"}]}},
     r"rename the reward function"),
])
def test_refusals_name_the_key(sections, message):
    with pytest.raises(ConfigError, match=message):
        _load(sections)


@pytest.mark.parametrize("data", [
    {"rollout": {"dynamic_sampling": True}},  # gae: no groups
    {"rollout": {"dynamic_sampling": True, "samples_per_prompt": 1}, "ppo": {"estimator": "gae"}},
])
def test_dynamic_sampling_is_refused_without_groups(data):
    with pytest.raises(ConfigError, match=r"rollout.dynamic_sampling keeps groups whose rewards differ: it needs "
                                          r"ppo.estimator grpo or rloo and rollout.samples_per_prompt >= 2"):
        load_config(data)


def test_gspo_with_a_token_mean_warns_about_the_pairing():
    (w,) = config_warnings(_load({"ppo": {"ratio_level": "sequence"}}))
    assert "ppo.loss_aggregation=token_mean" in w and "seq_mean_token_mean" in w


def test_docs_and_schema_show_the_keys():
    from rallyrl.config import config_markdown
    from rallyrl.schema import config_schema

    md = config_markdown()
    for key in ("ppo.ratio_level", "ppo.sequence_clip_range", "ppo.policy_loss", "ppo.cispo_clip_high",
                "ppo.dual_clip", "ppo.mask_truncated", "rollout.dynamic_sampling", "rollout.max_sampling_rounds",
                "reward.overlong_buffer", "reward.overlong_buffer.length", "reward.overlong_buffer.penalty"):
        assert f"`{key}`" in md, key
    props = config_schema()["properties"]
    assert props["ppo"]["properties"]["policy_loss"]["enum"] == ["ppo", "cispo"]
    assert props["ppo"]["properties"]["sequence_clip_range"]["default"] == 3e-4
    ob = props["reward"]["properties"]["overlong_buffer"]["anyOf"][0]
    assert ob["required"] == ["length"] and ob["properties"]["penalty"]["default"] == 1.0
