"""`generation.engine`, `generation.vllm.*` and `ppo.engine_correction*`: defaults, and the combinations
that are refused at load time with an error naming the key (docs/engines.md)."""

import pytest

from rallyrl.config import ConfigError, GenerationConfig, engine_logprobs_exact, load_config


def _load(**sections):
    return load_config({"model": {"path": "m"}, **sections})


def test_defaults_are_the_hf_engine_and_no_correction():
    cfg = _load()
    assert cfg.generation.engine == "hf" and cfg.ppo.engine_correction == "none"
    v = cfg.generation.vllm
    assert (v.dtype, v.memory_fraction, v.kv_cache_gib, v.max_model_len, v.enforce_eager, v.probe_tolerance) == \
        ("auto", None, None, None, None, None)


@pytest.mark.parametrize("sections, key", [
    ({"generation": {"engine": "vllm"}, "model": {"path": "m", "arch": "seq2seq"}}, "seq2seq"),
    ({"ppo": {"engine_correction": "tis"}}, "ppo.engine_correction"),
    ({"generation": {"engine": "vllm"}, "rollout": {"logprobs_from": "generate"}}, "critic-free"),
    ({"generation": {"engine": "vllm"}, "rollout": {"logprobs_from": "generate", "samples_per_prompt": 2},
      "ppo": {"estimator": "grpo", "engine_correction": "mask"}}, "logprobs_from: forward"),
    ({"generation": {"engine": "vllm", "temperature": 0.7, "top_p": 0.9}, "ppo": {"engine_correction": "tis"}},
     "top_p"),
    ({"generation": {"vllm": {"memory_fraction": 1.5}}}, "generation.vllm.memory_fraction"),
    ({"generation": {"vllm": {"probe_tolerance": 0}}}, "generation.vllm.probe_tolerance"),
    ({"ppo": {"engine_correction_low": 1.2}}, "ppo.engine_correction_low"),
    ({"ppo": {"engine_correction_high": 1.0}}, "ppo.engine_correction_high"),
    ({"generation": {"vllm": {"dtype": "fp8"}}}, "generation.vllm.dtype"),
    ({"generation": {"engine": "sglang"}}, "generation.engine"),
])
def test_refused_combinations_name_the_key(sections, key):
    sections.setdefault("model", {"path": "m"})
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(sections)


def test_accepted_combinations():
    # truncation at temperature 1: vLLM's raw log-probs are the full-vocabulary ones the trainer computes
    _load(generation={"engine": "vllm", "top_p": 0.9}, ppo={"engine_correction": "tis"})
    # truncation at another temperature is fine when nothing needs the engine's log-probs
    _load(generation={"engine": "vllm", "temperature": 0.7, "top_k": 5})
    _load(generation={"engine": "vllm"}, rollout={"logprobs_from": "generate", "samples_per_prompt": 2},
          ppo={"estimator": "grpo"})


@pytest.mark.parametrize("t, k, p, sample, exact", [
    (1.0, 0, 1.0, True, True), (0.7, 0, 1.0, True, True), (0.7, 5, 1.0, True, False), (0.7, 0, 0.9, True, False),
    (1.0, 5, 0.9, True, True), (0.7, 0, 1.0, False, False), (1.0, 0, 1.0, False, True)])
def test_when_engine_logprobs_are_the_trainers(t, k, p, sample, exact):
    assert engine_logprobs_exact(GenerationConfig(temperature=t, top_k=k, top_p=p), sample) is exact
