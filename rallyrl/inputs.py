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
from .data import load_prompts
from .models import ModelLoadError, check_model_folder, load_tokenizer, max_positions
from .reward.loading import load_callable, resolve_reward_fns
from .reward.step import NamedRewardFn

MetricFn = Callable[..., dict[str, Sequence[float]]]


@dataclass(frozen=True)
class PromptSet:
    """Prompt records ({"prompt": str, ...metadata}) with their token ids, read by global index."""

    records: list[dict[str, Any]]
    query_ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.records)

    def texts(self, idx: Sequence[int]) -> list[str]:
        return [self.records[i]["prompt"] for i in idx]

    def metadata(self, idx: Sequence[int]) -> list[dict[str, Any]]:
        """Every column but the prompt (what reaches the reward function as per-sample kwargs)."""
        return [{k: v for k, v in self.records[i].items() if k != "prompt"} for i in idx]

    def token_ids(self, idx: Sequence[int]) -> list[list[int]]:
        return [self.query_ids[i] for i in idx]


@dataclass
class Inputs:
    records: list[dict[str, Any]]  # training prompt records ({"prompt": str, ...metadata})
    eval_records: list[dict[str, Any]]  # evaluation records ([] = no evaluation)
    query_ids: list[list[int]]  # tokenized training prompts, aligned with records
    eval_query_ids: list[list[int]]
    reward_fns: list[NamedRewardFn]
    metric_fn: MetricFn | None
    tokenizer: Any  # PreTrainedTokenizerBase (pad token set, left padding)
    plan: BatchPlan

    @property
    def train_set(self) -> PromptSet:
        return PromptSet(self.records, self.query_ids)

    @property
    def eval_set(self) -> PromptSet:
        return PromptSet(self.eval_records, self.eval_query_ids)


def prepare_inputs(
    cfg: Config,
    world_size: int,
    reward_fn: Any = None,
    metric_fn: MetricFn | None = None,
    prompts: Sequence[Any] | str | None = None,
    eval_prompts: Sequence[Any] | str | None = None,
) -> Inputs:
    """Everything checkable without weights, in the order a user fixes things: config arithmetic, data,
    reward/metric imports, then the model folder and tokenizer. Raises the user-facing error types
    (``ConfigError``, ``DataError``, ``ImportPathError``, ``ModelLoadError``)."""
    plan = make_batch_plan(cfg, world_size)
    if prompts is not None:
        records = load_prompts(prompts, "prompts")
    elif cfg.data.prompts is not None:
        records = load_prompts(cfg.data.prompts, "data.prompts")
    else:
        raise ConfigError("data.prompts is required (or pass prompts= to train())")
    eval_src, eval_what = ((eval_prompts, "eval_prompts") if eval_prompts is not None
                           else (cfg.data.eval_prompts, "data.eval_prompts"))
    eval_records = load_prompts(eval_src, eval_what) if eval_src is not None else []
    reward_fns = resolve_reward_fns(cfg.reward, reward_fn)
    if cfg.reward.overlap and cfg.reward.server != "local":
        from .reward.client import RemoteReward

        in_process = [nf.name for nf in reward_fns if not isinstance(nf.fn, RemoteReward)]
        if in_process:
            raise ConfigError(f"reward.overlap needs remote reward functions (reward.url, reward.server: local or a "
                              f"RemoteReward); {in_process} would run in this process, beside generation, where "
                              f"they could move the training RNG streams")
    if metric_fn is None and cfg.eval.metric_fn:
        metric_fn = load_callable(cfg.eval.metric_fn, "eval.metric_fn")
    if cfg.model.prepare:
        prepare_model_folder(cfg.model.prepare, cfg.model.path)
    check_model_folder(cfg.model)
    tokenizer = load_tokenizer(cfg.model)
    from transformers import AutoConfig

    max_pos = max_positions(AutoConfig.from_pretrained(cfg.model.path))
    n_new = cfg.generation.max_new_tokens
    return Inputs(
        records=records,
        eval_records=eval_records,
        query_ids=tokenize_prompts(records, tokenizer, max_pos, n_new, "data.prompts"),
        eval_query_ids=tokenize_prompts(eval_records, tokenizer, max_pos, n_new, "data.eval_prompts"),
        reward_fns=reward_fns,
        metric_fn=metric_fn,
        tokenizer=tokenizer,
        plan=plan,
    )


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


def tokenize_prompts(records: list[dict[str, Any]], tokenizer: Any, max_positions: int | None,
                     max_new_tokens: int, what: str) -> list[list[int]]:
    ids = [tokenizer(r["prompt"], add_special_tokens=True)["input_ids"] for r in records]
    for i, q in enumerate(ids):
        if not q:
            raise ConfigError(f"{what}: prompt {i} tokenizes to nothing ({records[i]['prompt']!r})")
        if max_positions is not None and len(q) + max_new_tokens > max_positions:
            raise ConfigError(
                f"{what}: prompt {i} has {len(q)} tokens; with generation.max_new_tokens={max_new_tokens} "
                f"that exceeds the model's {max_positions} positions ({records[i]['prompt'][:60]!r}...)"
            )
    return ids
