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
from .data import MESSAGES_KEY, DataError, load_prompts
from .models import ModelLoadError, check_model_folder, load_tokenizer, max_positions
from .reward.loading import load_callable, resolve_reward_fns
from .reward.step import NamedRewardFn

MetricFn = Callable[..., dict[str, Sequence[float]]]


@dataclass(frozen=True)
class PromptSet:
    """Prompt records ({"prompt": str, ...metadata}) with their token ids, read by global index. A
    conversational prompt is already rendered here: ``prompt`` is the chat template's text and the
    ``prompt_messages`` column holds the original messages (``render_prompts``)."""

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
    records: list[dict[str, Any]]  # training prompt records ({"prompt": str, ...metadata}), rendered
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
    train_what = "prompts" if prompts is not None else "data.prompts"
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
    records, chat = render_prompts(records, tokenizer, train_what, _tokenizer_key(cfg))
    eval_records, eval_chat = render_prompts(eval_records, tokenizer, eval_what, _tokenizer_key(cfg))
    return Inputs(
        records=records,
        eval_records=eval_records,
        query_ids=tokenize_prompts(records, tokenizer, max_pos, n_new, "data.prompts", chat),
        eval_query_ids=tokenize_prompts(eval_records, tokenizer, max_pos, n_new, "data.eval_prompts", eval_chat),
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


def _tokenizer_key(cfg: Config) -> str:
    return f"model.tokenizer_path ({cfg.model.tokenizer_path})" if cfg.model.tokenizer_path else \
        f"model.path ({cfg.model.path})"


def render_prompts(records: list[dict[str, Any]], tokenizer: Any, what: str, tokenizer_key: str = "the tokenizer"
                   ) -> tuple[list[dict[str, Any]], list[bool]]:
    """Conversational prompts rendered with the tokenizer's chat template, as TRL and vLLM do
    (``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``): the record's
    ``prompt`` becomes the rendered text (what generation continues, what the reward function sees as
    ``prompts[i]`` and what ``rollouts.jsonl`` shows) and ``prompt_messages`` keeps the messages (None
    for a string prompt among them). A set of string prompts only is returned as it is (the same list).
    Also returns which records were conversations."""
    chat = [isinstance(r["prompt"], list) for r in records]
    if not any(chat):
        return records, chat
    first = chat.index(True)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{what}: prompt {first} is a list of chat messages, but the tokenizer of {tokenizer_key} "
                        f"has no chat template to render it with; use a tokenizer that has one (set "
                        f"model.tokenizer_path, or set tokenizer.chat_template and save_pretrained it), or "
                        f"write the prompts as plain strings")
    out = []
    for i, (r, is_chat) in enumerate(zip(records, chat)):
        if not is_chat:
            # In a set that holds conversations every record has the column (None for a plain prompt),
            # so the reward kwarg is there in every call, whatever prompts a chunk happens to hold.
            if MESSAGES_KEY in r:
                raise DataError(f"{what}: prompt {i} has a '{MESSAGES_KEY}' column, a name rallyrl uses for the "
                                f"messages of conversational prompts (this set has some); rename the column")
            out.append({**r, MESSAGES_KEY: None})
            continue
        try:
            text = tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        except Exception as e:  # a template that raises on these messages (e.g. "roles must alternate")
            raise DataError(f"{what}: prompt {i}: the chat template of {tokenizer_key} failed on its messages: "
                            f"{type(e).__name__}: {e}") from None
        if not isinstance(text, str):
            raise DataError(f"{what}: prompt {i}: the chat template rendered {type(text).__name__}, not text")
        meta = {k: v for k, v in r.items() if k != "prompt"}
        out.append({"prompt": text, **meta, MESSAGES_KEY: r["prompt"]})
    return out, chat


def tokenize_prompts(records: list[dict[str, Any]], tokenizer: Any, max_positions: int | None,
                     max_new_tokens: int, what: str, rendered: Sequence[bool] = ()) -> list[list[int]]:
    """Token ids of each (rendered) prompt. A plain prompt gets the tokenizer's special tokens (BOS, ...);
    a prompt rendered from a chat template (``rendered[i]``) does not: the template already wrote the
    ones it wants, and adding them again would give, e.g., two BOS tokens (TRL tokenizes rendered
    conversations with ``add_special_tokens=False`` for the same reason)."""
    chat = list(rendered) or [False] * len(records)
    ids = [tokenizer(r["prompt"], add_special_tokens=not c)["input_ids"] for r, c in zip(records, chat)]
    for i, q in enumerate(ids):
        if not q:
            raise ConfigError(f"{what}: prompt {i} tokenizes to nothing ({records[i]['prompt']!r})")
        if max_positions is not None and len(q) + max_new_tokens > max_positions:
            raise ConfigError(
                f"{what}: prompt {i} has {len(q)} tokens; with generation.max_new_tokens={max_new_tokens} "
                f"that exceeds the model's {max_positions} positions ({records[i]['prompt'][:60]!r}...)"
            )
    return ids
