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
from .data import MESSAGES_KEY, DataError, ListTable, PromptTable, check_messages, open_prompts
from .models import ModelLoadError, check_model_folder, load_tokenizer, max_positions
from .reward.loading import load_callable, resolve_reward_fns
from .reward.signature import check_columns, check_run
from .reward.step import NamedRewardFn

MetricFn = Callable[..., dict[str, Sequence[float]]]


class PromptSet:
    """Prompts read by global index from a ``PromptTable``: ``texts`` / ``metadata`` / ``token_ids`` of
    rows. A conversational prompt is rendered here: ``prompt`` is the chat template's text and the
    ``prompt_messages`` column holds the original messages (``render_prompts``).

    ``PromptSet.of(table, ...)`` renders and tokenizes lazily: ``prepare(idx)`` (called with an
    iteration's drawn prompts, on every rank) renders, tokenizes and checks those rows and keeps only
    them, so a long run over a big data set never accumulates them all. ``prepare_all()`` does every row
    once and keeps them (inline lists and the eval set: small, checked up front). ``PromptSet(records,
    query_ids)`` wraps rows rendered and tokenized already."""

    def __init__(self, records: list[dict[str, Any]] | None = None, query_ids: list[list[int]] | None = None,
                 ) -> None:
        records, query_ids = records or [], query_ids or []
        self.table: PromptTable = ListTable(records, "prompts")
        self._cache: dict[int, tuple[dict[str, Any], list[int]]] = dict(enumerate(zip(records, query_ids)))
        self._pinned = True
        self._tokenizer: Any = None

    @classmethod
    def of(cls, table: PromptTable, tokenizer: Any, max_positions: int | None, max_new_tokens: int,
           what: str, tokenizer_key: str = "the tokenizer") -> PromptSet:
        self = cls()
        self.table, self._pinned = table, False
        self._tokenizer, self._max_pos, self._n_new = tokenizer, max_positions, max_new_tokens
        self._what, self._tok_key = what, tokenizer_key
        if table.chat:  # checked now, for the whole set: a template-less tokenizer fails on the first row
            _require_template(tokenizer, table.first_chat, what, tokenizer_key)
        return self

    def __len__(self) -> int:
        return len(self.table)

    def prepare(self, idx: Sequence[int]) -> None:
        """Render, tokenize and check the rows ``idx`` (an iteration's draw) and keep only them. The
        drawn rows are the same on every rank, so a bad row raises the same ``ConfigError`` / ``DataError``,
        naming it, on every rank at the same point, with no collective."""
        if self._pinned:
            return
        want = list(dict.fromkeys(int(i) for i in idx))
        missing = [i for i in want if i not in self._cache]
        loaded = dict(zip(missing, self._load(missing)))
        self._cache = {i: self._cache[i] if i in self._cache else loaded[i] for i in want}

    def prepare_all(self, block: int = 4096) -> None:
        """Every row, kept for the run (a small set: inline prompts, the eval set)."""
        if self._pinned:
            return
        n = len(self)
        for lo in range(0, n, block):
            rows = list(range(lo, min(n, lo + block)))
            self._cache.update(zip(rows, self._load(rows)))
        self._pinned = True

    def longest(self, block: int = 4096) -> int:
        """The most tokens of any prompt, reading every row once without keeping them (``rallyrl check``:
        this also runs every check that a run makes when a row is drawn)."""
        if self._pinned:
            return max((len(q) for _, q in self._cache.values()), default=0)
        n = len(self)
        return max((len(q) for lo in range(0, n, block)
                    for _, q in self._load(list(range(lo, min(n, lo + block))))), default=0)

    def _rows(self, idx: Sequence[int]) -> list[tuple[dict[str, Any], list[int]]]:
        missing = [i for i in dict.fromkeys(idx) if i not in self._cache]
        if missing:  # a row not prepared (a caller outside the loop): read it, without evicting the others
            self._cache.update(zip(missing, self._load(missing)))
        return [self._cache[i] for i in idx]

    def _load(self, idx: list[int]) -> list[tuple[dict[str, Any], list[int]]]:
        if not idx:
            return []
        raw = self.table.rows(idx)
        if self.table.chat and not self.table.eager:  # Arrow rows: checked as they are drawn
            for i, r in zip(idx, raw):
                if isinstance(r["prompt"], list):
                    check_messages(r["prompt"], f"prompt {i}", self._what)
        records, chat = render_prompts(raw, self._tokenizer, self._what, self._tok_key, index=idx,
                                       set_chat=self.table.chat)
        ids = tokenize_prompts(records, self._tokenizer, self._max_pos, self._n_new, self._what, chat, index=idx)
        return list(zip(records, ids))

    def texts(self, idx: Sequence[int]) -> list[str]:
        return [r["prompt"] for r, _ in self._rows(idx)]

    def metadata(self, idx: Sequence[int]) -> list[dict[str, Any]]:
        """Every column but the prompt (what reaches the reward function as per-sample kwargs)."""
        return [{k: v for k, v in r.items() if k != "prompt"} for r, _ in self._rows(idx)]

    def token_ids(self, idx: Sequence[int]) -> list[list[int]]:
        return [q for _, q in self._rows(idx)]


@dataclass
class Inputs:
    train_set: PromptSet  # training prompts (rows read, rendered and tokenized as iterations draw them)
    eval_set: PromptSet  # evaluation prompts, every row checked up front (empty = no evaluation)
    reward_fns: list[NamedRewardFn]
    metric_fn: MetricFn | None
    tokenizer: Any  # PreTrainedTokenizerBase (pad token set, left padding)
    plan: BatchPlan


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
    if cfg.reward.overlap and cfg.reward.server != "local":
        from .reward.client import RemoteReward

        in_process = [nf.name for nf in reward_fns if not isinstance(nf.fn, RemoteReward)]
        if in_process:
            raise ConfigError(f"reward.overlap needs remote reward functions (reward.url, reward.server: local or a "
                              f"RemoteReward); {in_process} would run in this process, beside generation, where "
                              f"they could move the training RNG streams")
    if metric_fn is None and cfg.eval.metric_fn:
        metric_fn = load_callable(cfg.eval.metric_fn, "eval.metric_fn")
    # The functions against the data's columns: a collision or a missing argument fails now, not at the
    # first reward call after the models have loaded.
    sets = [(train_what, table.columns(), table.chat)]
    if eval_table is not None:
        sets.append((eval_what, eval_table.columns(), eval_table.chat))
    check_run(reward_fns, sets, metric_fn, sets[1] if eval_table is not None else None)
    if cfg.reward.server == "local":  # the HTTP client between the run and the server is a trlx function
        for where, columns, chat in sets:
            check_columns(None, "remote (reward.server: local)", "trlx", columns, where, chat)
    if cfg.model.prepare:
        prepare_model_folder(cfg.model.prepare, cfg.model.path)
    check_model_folder(cfg.model)
    tokenizer = load_tokenizer(cfg.model)
    from transformers import AutoConfig

    max_pos = max_positions(AutoConfig.from_pretrained(cfg.model.path))
    n_new = cfg.generation.max_new_tokens
    # Error messages say data.prompts / data.eval_prompts for what the tokenizer finds (as they always have).
    train_set = PromptSet.of(table, tokenizer, max_pos, n_new, "data.prompts", _tokenizer_key(cfg))
    if table.eager:  # an inline list: small, every row checked (and kept) now
        train_set.prepare_all()
    eval_set = PromptSet()
    if eval_table is not None:  # the eval set is read whole at every evaluation: checked up front
        eval_set = PromptSet.of(eval_table, tokenizer, max_pos, n_new, "data.eval_prompts", _tokenizer_key(cfg))
        eval_set.prepare_all()
    return Inputs(train_set=train_set, eval_set=eval_set, reward_fns=reward_fns, metric_fn=metric_fn,
                  tokenizer=tokenizer, plan=plan)


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


def _require_template(tokenizer: Any, first: int, what: str, tokenizer_key: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{what}: prompt {first} is a list of chat messages, but the tokenizer of {tokenizer_key} "
                        f"has no chat template to render it with; use a tokenizer that has one (set "
                        f"model.tokenizer_path, or set tokenizer.chat_template and save_pretrained it), or "
                        f"write the prompts as plain strings")


def render_prompts(records: list[dict[str, Any]], tokenizer: Any, what: str, tokenizer_key: str = "the tokenizer",
                   index: Sequence[int] | None = None, set_chat: bool | None = None
                   ) -> tuple[list[dict[str, Any]], list[bool]]:
    """Conversational prompts rendered with the tokenizer's chat template, as TRL and vLLM do
    (``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``): the record's
    ``prompt`` becomes the rendered text (what generation continues, what the reward function sees as
    ``prompts[i]`` and what ``rollouts.jsonl`` shows) and ``prompt_messages`` keeps the messages (None
    for a string prompt among them). A set of string prompts only is returned as it is (the same list).
    Also returns which records were conversations. ``index``: the records' global row numbers (for
    messages; default 0..n-1); ``set_chat``: whether the whole set holds conversations, when ``records``
    are only some of its rows (default: whether these do)."""
    index = list(range(len(records))) if index is None else list(index)
    chat = [isinstance(r["prompt"], list) for r in records]
    if not (any(chat) if set_chat is None else set_chat):
        return records, chat
    if any(chat):
        _require_template(tokenizer, index[chat.index(True)], what, tokenizer_key)
    out = []
    for i, r, is_chat in zip(index, records, chat):
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
                     max_new_tokens: int, what: str, rendered: Sequence[bool] = (),
                     index: Sequence[int] | None = None) -> list[list[int]]:
    """Token ids of each (rendered) prompt. A plain prompt gets the tokenizer's special tokens (BOS, ...);
    a prompt rendered from a chat template (``rendered[i]``) does not: the template already wrote the
    ones it wants, and adding them again would give, e.g., two BOS tokens (TRL tokenizes rendered
    conversations with ``add_special_tokens=False`` for the same reason). ``index``: the records' global
    row numbers, named in errors (default 0..n-1)."""
    chat = list(rendered) or [False] * len(records)
    index = list(range(len(records))) if index is None else list(index)
    # one batched call per kind (a fast tokenizer encodes a batch in Rust): the same ids as one by one
    ids: list[list[int]] = [[] for _ in records]
    for special in (True, False):
        pos = [j for j, c in enumerate(chat) if c != special]
        if pos:
            enc = tokenizer([records[j]["prompt"] for j in pos], add_special_tokens=special)["input_ids"]
            for j, q in zip(pos, enc):
                ids[j] = q
    for j, q in enumerate(ids):
        i = index[j]
        if not q:
            raise ConfigError(f"{what}: prompt {i} tokenizes to nothing ({records[j]['prompt']!r})")
        if max_positions is not None and len(q) + max_new_tokens > max_positions:
            raise ConfigError(
                f"{what}: prompt {i} has {len(q)} tokens; with generation.max_new_tokens={max_new_tokens} "
                f"that exceeds the model's {max_positions} positions ({records[j]['prompt'][:60]!r}...)"
            )
    return ids
