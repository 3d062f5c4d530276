"""Value checks that types cannot express: each field's declared range, then the checks across fields.

Ranges are not written here: each lives in its field's metadata (``fields._f(..., gt=0)``), where the
JSON schema reads it too. What is here is what no single field can say (``reward.url`` with
``reward.fn``, G dividing the global batch, ...), and the warnings about legal but doubtful settings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .algorithm import engine_logprobs_exact
from .fields import ConfigError, bounds, in_range, range_text
from .reward import RewardConfig, reward_fn_name
from .root import Config


def validate(cfg: Config) -> None:
    """Value checks that types cannot express. Raises ConfigError naming the key."""
    _check_ranges(cfg, "")
    if any(s == "" for s in cfg.generation.stop_sequences):
        raise ConfigError("generation.stop_sequences must not contain an empty string")
    if cfg.eval.samples_per_prompt > 1 and not cfg.eval.do_sample:
        raise ConfigError(f"eval.samples_per_prompt={cfg.eval.samples_per_prompt} needs eval.do_sample: true "
                          f"(greedy decoding would give the same completion {cfg.eval.samples_per_prompt} times)")
    _check_estimator(cfg)
    _check_engine(cfg)
    _check_objective(cfg)
    _check_model(cfg)
    _check_env(cfg)
    _check_reward(cfg.reward)


def _check_ranges(node: Any, prefix: str) -> None:
    """Every field's declared range (``gt``/``ge``/``lt``/``le`` in its metadata) and unsupported choices,
    sections and the entries of lists of sections (``reward.fns[i]``) included; null (an unset optional) is
    not checked."""
    for f in dataclasses.fields(node):
        key, v = f"{prefix}.{f.name}" if prefix else f.name, getattr(node, f.name)
        if dataclasses.is_dataclass(v):
            _check_ranges(v, key)
        elif isinstance(v, list):
            for i, item in enumerate(v):
                if dataclasses.is_dataclass(item):
                    _check_ranges(item, f"{key}[{i}]")
        elif (b := bounds(f)) and v is not None and not in_range(v, b):
            why = f.metadata.get("why")
            raise ConfigError(f"{key} must be {range_text(b)}, got {v}" + (f": {why}" if why else ""))
        elif isinstance(v, str) and v in f.metadata.get("unsupported", {}):
            raise ConfigError(f"{key}={v} is not supported: {f.metadata['unsupported'][v]}")


def _check_engine(cfg: Config) -> None:
    """``generation.engine`` with ``ppo.engine_correction`` and ``rollout.logprobs_from`` (docs/engines.md)."""
    g, p = cfg.generation, cfg.ppo
    if g.engine == "hf":
        if p.engine_correction != "none":
            raise ConfigError(f"ppo.engine_correction={p.engine_correction!r} corrects for a separate engine "
                              f"(generation.engine: vllm); the hf engine samples with the trained weights themselves")
        return
    if cfg.model.arch != "causal":
        raise ConfigError("generation.engine: vllm serves causal LMs only (model.arch: causal); a seq2seq policy "
                          "generates with generation.engine: hf")
    generate = cfg.rollout.logprobs_from == "generate"
    if generate and not p.critic_free:
        raise ConfigError("rollout.logprobs_from: generate with generation.engine: vllm needs a critic-free "
                          "ppo.estimator (grpo or rloo): vLLM does not run the value head")
    if generate and p.engine_correction != "none":
        raise ConfigError("ppo.engine_correction needs rollout.logprobs_from: forward (with generate the engine's "
                          "log-probs ARE the old log-probs: PPO's ratio already runs against them)")
    if not engine_logprobs_exact(g, g.do_sample) and (generate or p.engine_correction != "none"):
        raise ConfigError(
            f"generation.engine: vllm cannot return full-vocabulary log-probs at temperature {g.temperature} with "
            f"top_k={g.top_k} / top_p={g.top_p} (its processed log-probs are renormalised over the kept tokens, "
            f"TRL #6789), which rollout.logprobs_from: generate and ppo.engine_correction need: set "
            f"generation.temperature: 1, or top_k: 0 and top_p: 1 (docs/engines.md)")


def _check_estimator(cfg: Config) -> None:
    """The critic-free family and groups (docs/algorithms.md)."""
    ppo, G, n = cfg.ppo, cfg.rollout.samples_per_prompt, cfg.rollout.num_rollouts
    if n % G:
        raise ConfigError(f"rollout.num_rollouts={n} must be a multiple of rollout.samples_per_prompt={G} "
                          f"(each iteration samples {G} completions of num_rollouts / {G} prompts)")
    if ppo.critic_free and G < 2:
        raise ConfigError(f"ppo.estimator={ppo.estimator} needs rollout.samples_per_prompt >= 2 (its baseline is "
                          f"the other completions of the same prompt), got {G}")
    if ppo.drop_zero_std_groups and not ppo.critic_free:
        raise ConfigError("ppo.drop_zero_std_groups is for ppo.estimator grpo or rloo (groups of completions)")


def _check_objective(cfg: Config) -> None:
    """The policy-loss variants and DAPO's sampling and shaping, across fields (docs/algorithms.md)."""
    ppo, ro = cfg.ppo, cfg.rollout
    if ppo.policy_loss == "cispo":
        for key, unset in (("ratio_level", ppo.ratio_level == "token"), ("dual_clip", ppo.dual_clip is None),
                           ("clip_range_high", ppo.clip_range_high is None)):
            if not unset:
                raise ConfigError(f"ppo.{key}={getattr(ppo, key)!r} does not apply to ppo.policy_loss=cispo (CISPO "
                                  f"clips a per-token importance weight with ppo.cispo_clip_low/high, not the loss)")
    if ppo.ratio_level == "sequence" and ppo.clip_range_high is not None:
        raise ConfigError("ppo.clip_range_high is the token ratio's; with ppo.ratio_level=sequence set "
                          "ppo.sequence_clip_range_high")
    if ro.dynamic_sampling and (not ppo.critic_free or ro.samples_per_prompt < 2):
        raise ConfigError(f"rollout.dynamic_sampling keeps groups whose rewards differ: it needs ppo.estimator grpo "
                          f"or rloo and rollout.samples_per_prompt >= 2 (got ppo.estimator={ppo.estimator}, "
                          f"rollout.samples_per_prompt={ro.samples_per_prompt})")
    ob, n = cfg.reward.overlong_buffer, cfg.generation.max_new_tokens
    if ob is not None:
        if ob.length > n:
            raise ConfigError(f"reward.overlong_buffer.length must be in [1, generation.max_new_tokens={n}], "
                              f"got {ob.length}")
        r = cfg.reward
        names = [reward_fn_name(f) for f in r.fns] + ([r.fn.rsplit(":", 1)[-1]] if r.fn else [])
        if "overlong" in names:
            raise ConfigError("reward.overlong_buffer logs its penalty as the reward component 'overlong': rename the "
                              "reward function of that name (reward.fns[i].name)")


def _check_model(cfg: Config) -> None:
    if cfg.model.arch == "seq2seq" and cfg.model.reference != "copy":
        # checked here, not after loading a model: `rallyrl check` and the launcher's preflight see it
        raise ConfigError(f"model.reference={cfg.model.reference!r} is implemented for model.arch=causal only; "
                          f"use model.reference=copy with model.arch=seq2seq")
    tm = cfg.model.lora.target_modules
    if (isinstance(tm, str) and tm != "all-linear") or (isinstance(tm, list) and (not tm or "" in tm)):
        raise ConfigError(f"model.lora.target_modules must be 'all-linear' or a non-empty list of module names, "
                          f"got {tm!r}")


def env_refusal(cfg: Config) -> str | None:
    """Why this config cannot run multi-turn episodes, or None: the options that read a sample's length or
    keep or drop whole rows are defined for single-turn samples (one row a sample, its length the sampled
    response), not for episodes split over turns and forked rows. Either engine samples the turns (token
    ids in and out); a separate engine's log-probs are kept per row (``Rollouts.engine_logprobs``)."""
    single = [k for k, on in (("rollout.dynamic_sampling", cfg.rollout.dynamic_sampling),
                              ("reward.overlong_buffer", cfg.reward.overlong_buffer is not None),
                              ("ppo.mask_truncated", cfg.ppo.mask_truncated)) if on]
    if single:
        return (f"{', '.join(single)} work on single-turn samples only, not on multi-turn episodes (env.factory / "
                f"train(env=...)): an episode spans several turns and, after a fork, several rows; turn it off "
                f"(a long episode is bounded by rollout.max_episode_tokens and ends as episode/truncated)")
    return None


def _check_env(cfg: Config) -> None:
    """Multi-turn episodes (docs/environments.md)."""
    if cfg.env.factory is not None and (why := env_refusal(cfg)):
        raise ConfigError(why)
    if cfg.env.on_template_drift == "fork" and cfg.model.sharding == "fsdp" and cfg.ppo.micro_batch_size:
        raise ConfigError("env.on_template_drift: fork with model.sharding: fsdp needs ppo.micro_batch_size: null: a "
                          "fork adds a training row on one rank only, and under fsdp every rank must run the same "
                          "number of micro-batches")


def _check_reward(r: RewardConfig) -> None:
    if r.fn and r.fns:
        raise ConfigError("set either reward.fn or reward.fns, not both")
    if r.url is not None:
        _check_reward_url(r)
    _check_reward_server(r)
    if r.overlap and ((r.url is None and r.server != "local") or r.placement != "main"):
        raise ConfigError("reward.overlap needs reward.url (or reward.server: local) and reward.placement main: "
                          "only a remote reward can run beside generation without touching the training RNG streams")
    for i, spec in enumerate(r.fns):
        if not spec.fn:
            raise ConfigError(f"reward.fns[{i}].fn is required")
    names = [reward_fn_name(s) for s in r.fns]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"reward.fns: duplicate names {sorted(dup)}; set reward.fns[i].name")


def _check_reward_url(r: RewardConfig) -> None:
    if r.fn or r.fns:
        raise ConfigError(f"set either reward.url or reward.{'fn' if r.fn else 'fns'}, not both "
                          f"(reward.url makes the reward function a RemoteReward)")
    if r.kwargs:
        raise ConfigError("reward.kwargs is for reward.fn; with reward.url use reward.timeout_s, "
                          "reward.retries and reward.protocol")
    if r.signature != "auto":
        raise ConfigError(f"reward.signature: {r.signature} is for reward functions that run in this process; with "
                          f"reward.url the server calls its own function (rallyrl serve-reward --signature)")
    if r.placement == "collective":
        raise ConfigError("reward.url works with reward.placement main or local, not collective "
                          "(every rank would send the whole batch to the server)")
    urls = [r.url] if isinstance(r.url, str) else r.url
    if not urls:
        raise ConfigError("reward.url: the list of URLs is empty")
    for i, u in enumerate(urls):
        where = "reward.url" if isinstance(r.url, str) else f"reward.url[{i}]"
        if not (u.startswith("http://") or u.startswith("https://")) or len(u.split("//", 1)[1]) == 0:
            raise ConfigError(f"{where}: {u!r} must look like http://host:port")


# `rallyrl serve-reward` options that `reward.server_args` may pass (option -> takes a value); the
# function (`--fn`/`--kwargs` from reward.fn/reward.kwargs), `--host` and `--port` are rallyrl's.
SERVER_ARGS = {"--max-batch": True, "--max-wait-ms": True, "--no-batching": False, "--max-body-mb": True}


def _check_reward_server(r: RewardConfig) -> None:
    if r.server != "local":
        if r.server_args:
            raise ConfigError("reward.server_args is for reward.server: local (the server rallyrl starts)")
        return
    if r.url is not None:
        raise ConfigError("reward.server: local starts the server and picks its URL: remove reward.url (or set "
                          "reward.server: none to use a server you started)")
    if r.fns:
        raise ConfigError("reward.server: local serves one function: set reward.fn (+ reward.kwargs), not reward.fns")
    if not r.fn:
        raise ConfigError("reward.server: local needs reward.fn: the import path of the function the server serves")
    if r.placement != "main":
        raise ConfigError(f"reward.server: local needs reward.placement main, not {r.placement!r}: the server "
                          f"listens on 127.0.0.1 of rank 0's machine, which only rank 0 is sure to reach")
    _check_server_args(r.server_args)


def _check_server_args(args: list[str]) -> None:
    i = 0
    while i < len(args):
        opt = args[i]
        name = opt.split("=", 1)[0]
        if name in ("--fn", "--kwargs", "--model", "--label", "--device", "--host", "--port"):
            raise ConfigError(f"reward.server_args: {name} is set by rallyrl (the function comes from reward.fn "
                              f"and reward.kwargs; the server binds 127.0.0.1 on a free port)")
        if name not in SERVER_ARGS:
            raise ConfigError(f"reward.server_args: unknown option {opt!r}; allowed: {', '.join(SERVER_ARGS)}")
        if SERVER_ARGS[name] and "=" not in opt:
            if i + 1 >= len(args):
                raise ConfigError(f"reward.server_args: {name} needs a value")
            i += 1
        i += 1


def config_warnings(cfg: Config) -> list[str]:
    """Legal settings that are probably mistakes (printed once at the start of a run)."""
    out = []
    if cfg.ppo.kl_in == "loss" and cfg.ppo.kl_estimator == "k1" and cfg.ppo.uses_reference:
        out.append("ppo.kl_in=loss with ppo.kl_estimator=k1: the gradient of k1 in the loss is zero in "
                   "expectation (it does not pull the policy towards the reference); use k3 (GRPO) or k2")
    if cfg.ppo.ratio_level == "sequence" and cfg.ppo.loss_aggregation != "seq_mean_token_mean":
        out.append(f"ppo.ratio_level=sequence with ppo.loss_aggregation={cfg.ppo.loss_aggregation}: each sequence's "
                   f"loss then counts in proportion to its length; the GSPO paper's objective (one term per "
                   f"sequence) is ppo.loss_aggregation=seq_mean_token_mean (TRL warns the same)")
    if cfg.ppo.critic_free and cfg.model.value_head != "linear":
        out.append(f"model.value_head={cfg.model.value_head} is ignored: ppo.estimator={cfg.ppo.estimator} "
                   f"trains no value head")
    return out
