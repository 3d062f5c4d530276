"""A run's inputs, resolved and checked before any process group starts or any weights load.

``prepare_inputs`` is the single place that turns a ``Config`` (plus the Python-API overrides of
``rallyrl.train``) into what the loop consumes: prompt records, reward and metric functions, the
tokenizer, tokenized prompts and the batch plan for a world size. ``train()`` calls it in every worker,
and ``rallyrl check`` / the ``--nproc N`` launcher call it in the launching process, so a dry run fails
with exactly the error a real run would give, and before any worker exists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .config import BatchPlan, Config, ConfigError, make_batch_plan
from .config.validate import env_refusal
from .data import PromptLimit, PromptSet, PromptSource, open_prompts
# PromptSet, render_prompts and tokenize_prompts lived here before rallyrl/data/ held them: importable as before
from .data import render_prompts, tokenize_prompts  # noqa: F401
from .models import ModelLoadError, check_model_folder, load_tokenizer, max_positions
from .reward.loading import load_callable, resolve_reward_fns
from .reward.signature import check_columns, check_run
from .reward.step import NamedRewardFn
from .rollout.episode import TRANSCRIPT_KWARGS, transcript_clash

MetricFn = Callable[..., dict[str, Sequence[float]]]


@dataclass
class Inputs:
    train_set: PromptSet  # training prompts (rows read, rendered and tokenized as iterations draw them)
    eval_set: PromptSet  # evaluation prompts, every row checked up front (empty = no evaluation)
    reward_fns: list[NamedRewardFn]
    metric_fn: MetricFn | None
    tokenizer: Any  # PreTrainedTokenizerBase (pad token set, left padding)
    plan: BatchPlan
    env: Any = None  # multi-turn episodes: a zero-argument factory of one environment (env.factory); None = single turn
    max_positions: int | None = None  # the model's positions (the default budget of a multi-turn episode)


def _check_overlap(cfg: Config, reward_fns: list[Any]) -> None:
    """``reward.overlap`` scores beside generation: only remote reward functions may run there."""
    if cfg.reward.overlap and cfg.reward.server != "local":
        from .reward.client import RemoteReward

        in_process = [nf.name for nf in reward_fns if not isinstance(nf.fn, RemoteReward)]
        if in_process:
            raise ConfigError(f"reward.overlap needs remote reward functions (reward.url, reward.server: local or a "
                              f"RemoteReward); {in_process} would run in this process, beside generation, where "
                              f"they could move the training RNG streams")


def _check_columns(cfg: Config, reward_fns: list[Any], metric_fn: MetricFn | None,
                   sets: list[tuple[str, list[str], bool]], episodes: bool = False) -> None:
    """The reward and metric functions against the data's columns ``sets`` (train, then eval). With
    multi-turn ``episodes`` the functions also get the transcript (``TRANSCRIPT_KWARGS``: ``turn_texts``,
    ``messages``, ...) as keyword arguments, so those fill parameters like columns, and a column of the
    same name is refused."""
    if episodes:
        for where, columns, _ in sets:
            if why := transcript_clash(columns, where):
                raise ConfigError(why)
        sets = [(where, columns + list(TRANSCRIPT_KWARGS), chat) for where, columns, chat in sets]
    # The functions against the data's columns: a collision or a missing argument fails now, not at the
    # first reward call after the models have loaded.
    check_run(reward_fns, sets, metric_fn, sets[1] if len(sets) > 1 else None)
    if cfg.reward.server == "local":  # the HTTP client between the run and the server is a trlx function
        for where, columns, chat in sets:
            check_columns(None, "remote (reward.server: local)", "trlx", columns, where, chat)


def prepare_inputs(
    cfg: Config,
    world_size: int,
    reward_fn: Any = None,
    metric_fn: MetricFn | None = None,
    prompts: PromptSource | None = None,
    eval_prompts: PromptSource | None = None,
    env: Any = None,
) -> Inputs:
    """Everything checkable without weights, in the order a user fixes things: config arithmetic, data,
    reward/metric imports, then the model folder and tokenizer. ``prompts`` / ``eval_prompts`` (the Python
    API's) take what ``data.prompts`` takes, or a ``datasets.Dataset`` / ``DatasetDict``. Raises the
    user-facing error types (``ConfigError``, ``DataError``, ``ImportPathError``, ``ModelLoadError``)."""
    plan = make_batch_plan(cfg, world_size)
    d = cfg.data
    if prompts is not None:
        train_src, train_what = prompts, "prompts"
    elif d.prompts is not None:
        train_src, train_what = d.prompts, "data.prompts"
    else:
        raise ConfigError("data.prompts is required (or pass prompts= to train())")
    table = open_prompts(_listed(train_src), train_what, d.prompt_column, d.split, d.subset)
    eval_src, eval_what = ((eval_prompts, "eval_prompts") if eval_prompts is not None
                           else (d.eval_prompts, "data.eval_prompts"))
    eval_table = (open_prompts(_listed(eval_src), eval_what, d.prompt_column, d.eval_split, d.subset)
                  if eval_src is not None else None)
    reward_fns = resolve_reward_fns(cfg.reward, reward_fn)
    _check_overlap(cfg, reward_fns)
    if metric_fn is None and cfg.eval.metric_fn:
        metric_fn = load_callable(cfg.eval.metric_fn, "eval.metric_fn")
    sets = [(train_what, table.columns(), table.chat)]
    if eval_table is not None:
        sets.append((eval_what, eval_table.columns(), eval_table.chat))
    _check_columns(cfg, reward_fns, metric_fn, sets, episodes=env is not None or cfg.env.factory is not None)
    if cfg.model.prepare:
        prepare_model_folder(cfg.model.prepare, cfg.model.path)
    check_model_folder(cfg.model)
    tokenizer = load_tokenizer(cfg.model)
    from transformers import AutoConfig

    max_pos = max_positions(AutoConfig.from_pretrained(cfg.model.path))
    n_new = cfg.generation.max_new_tokens
    limit = PromptLimit.of(d.max_prompt_tokens, d.long_prompts, max_pos, n_new)
    limit.check_room()
    # Error messages say data.prompts / data.eval_prompts for what the tokenizer finds (as they always have).
    train_set = PromptSet.of(table, tokenizer, max_pos, n_new, "data.prompts", _tokenizer_key(cfg), limit)
    if table.eager:  # an inline list: small, every row checked (and kept) now
        train_set.prepare_all()
    else:  # data.long_prompts: error: every row's length, at start (an index cached beside the data)
        train_set.check_lengths()
    eval_set = PromptSet()
    if eval_table is not None:  # the eval set is read whole at every evaluation: checked up front
        eval_set = PromptSet.of(eval_table, tokenizer, max_pos, n_new, "data.eval_prompts", _tokenizer_key(cfg),
                                limit)
        eval_set.prepare_all(drop_long=True)
    return Inputs(train_set=train_set, eval_set=eval_set, reward_fns=reward_fns, metric_fn=metric_fn,
                  tokenizer=tokenizer, plan=plan, env=_env_factory(cfg, env, tokenizer), max_positions=max_pos)


def _env_factory(cfg: Config, env: Any, tokenizer: Any) -> Any:
    """The environment factory of multi-turn episodes (``env=`` of ``train`` wins over ``env.factory``),
    checked against the model and tokenizer; None for single-turn episodes."""
    from .rollout.env import TemplateError, env_factory
    from .rollout.env.template import ChatRenderer

    source = env if env is not None else cfg.env.factory
    if source is None:
        if cfg.rollout.max_episode_tokens is not None:
            raise ConfigError("rollout.max_episode_tokens is the budget of multi-turn episodes: set env.factory (or "
                              "pass env= to train()), or remove it (a single turn is bounded by generation.max_new_tokens)")
        return None
    what = "env" if env is not None else "env.factory"
    if why := env_refusal(cfg):  # env.factory was refused at load time already (config/validate.py)
        raise ConfigError(why)
    if cfg.model.arch != "causal":
        raise ConfigError(f"{what}: multi-turn episodes need model.arch: causal (the environment's messages are "
                          f"rendered into the one sequence a causal LM reads)")
    try:
        ChatRenderer(tokenizer)
        return env_factory(source, cfg.env.kwargs, what)
    except (TemplateError, TypeError) as e:
        raise ConfigError(f"{what}: {e}") from None


def _listed(source: Any) -> Any:
    """``train(prompts=...)`` may pass any sequence (a tuple, ...): a list to the loader."""
    return source if isinstance(source, (str, list)) or not isinstance(source, Sequence) else list(source)


def eval_steps(cfg: Config) -> list[int]:
    """The steps at which a run evaluates (0 = before the first iteration)."""
    n, k = cfg.train.iterations, cfg.eval.interval
    return sorted({0, n} | ({s for s in range(k, n + 1, k)} if k else set()))


def prepare_model_folder(spec: str, path: str) -> None:
    """Run the ``model.prepare`` hook; its failure is a ``ModelLoadError`` naming the hook."""
    fn = load_callable(spec, "model.prepare")
    if not path:
        raise ConfigError("model.path is required: model.prepare is called with it")
    try:
        fn(path)
    except Exception as e:
        raise ModelLoadError(f"model.prepare: {spec}({path!r}) failed: {type(e).__name__}: {e}") from e


def _tokenizer_key(cfg: Config) -> str:
    return f"model.tokenizer_path ({cfg.model.tokenizer_path})" if cfg.model.tokenizer_path else \
        f"model.path ({cfg.model.path})"
