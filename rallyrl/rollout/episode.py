"""Episodes: the loop that turns prompts into finished episodes by calling a generation engine and,
for multi-turn episodes, an environment.

An episode is a single turn (prompt -> one response) by default: ``run_episodes``, the same code and the
same bits as before environments existed. With an environment (``env.factory``) ``run_env_episodes``
loops turns: generate for the episodes still running, run their environment steps, append the
environment's tokens (the chat template's delta, rollout/env/template.py), until every episode is done or
out of budget. Whatever the environment, the trained tokens of every assistant turn are exactly the ids
the engine sampled (token-in, token-out): the text handed to the environment and the reward function is
the decoding of those same ids, never re-tokenized for training (trlx re-tokenized decoded text, so its
reward model saw a different ending than the tokens that were trained on). Environment tokens are in
the context (``response_mask``) but not actions (``action_mask`` False).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..data import MESSAGES_KEY
from ..seeding import isolated_rng
from .padding import pad
from .engine import GenerationEngine, SamplingSpec
from .env import (ChatRenderer, EnvSetup, EnvTimeout, Step, TemplateDrift, TemplateError, ToolEnv, ToolFailure, as_step,
                  tool_schema)
from .env.protocol import check_messages
from .env.runner import maybe_await


@dataclass
class Episodes:
    """One chunk round's finished episodes on one rank: padded once, here, and used as is downstream.

    Shapes: ``B`` episodes, ``Q`` query length (left-padded), ``T`` response length (right-padded). The
    two masks are those of ``Rollouts`` (rollout/batch.py): ``response_mask`` what the model sees,
    ``action_mask`` what the policy sampled."""

    query_ids: torch.Tensor  # (B, Q) left-padded
    query_mask: torch.Tensor  # (B, Q) bool
    response_ids: torch.Tensor  # (B, T) right-padded; after EOS / stop truncation, EOS kept (an action)
    response_mask: torch.Tensor  # (B, T) bool: attention
    action_mask: torch.Tensor  # (B, T) bool: sampled by the policy (single turn: = response_mask)
    response_lists: list[list[int]]  # the same response tokens, unpadded (what the reward function sees)
    outputs: list[str]  # decode(response) without special tokens
    # rollout.logprobs_from=generate: the policy's (B, T) log-probs and values from the decoding itself
    logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    version: int = 0  # the engine's weight version that sampled them
    truncated: list[bool] = field(default_factory=list)  # per episode: cut by max_new_tokens (see cut_by_length)
    # Multi-turn episodes only (empty / None for single-turn ones, where row i is episode i). Per ROW:
    row_episode: list[int] = field(default_factory=list)  # the episode (index into outputs) the row belongs to
    env_dense: torch.Tensor | None = None  # (B, T) env.turn_rewards=per_turn: each turn's reward on its last action
    # Per EPISODE:
    transcripts: list[dict[str, Any]] = field(default_factory=list)  # messages, turns, truncated, forks
    env_scores: list[float] = field(default_factory=list)  # env.turn_rewards=sum: the environment's rewards, summed

    def __len__(self) -> int:
        """The number of episodes (rows: ``query_ids.shape[0]``; more than episodes after a fork)."""
        return len(self.outputs)


def run_episodes(engine: GenerationEngine, tokenizer: object, query_ids: list[list[int]],
                 spec: SamplingSpec) -> Episodes:
    """Single-turn episodes for one chunk round: one response per prompt. Every rank calls it in every
    chunk round, with or without prompts (``engine.ready()`` may be a collective)."""
    with engine.ready():
        if not query_ids:  # a rank with no sample in this chunk round still enters the reward step
            empty = torch.zeros(0, 0, dtype=torch.long)
            none = torch.zeros(0, 0) if spec.logprobs else None
            return Episodes(empty, empty.bool(), empty, empty.bool(), empty.bool(), [], [], none, none,
                            engine.version)
        sampled = engine.generate(query_ids, spec)
    pad_id = tokenizer.pad_token_id  # type: ignore[attr-defined]
    q, qm = pad(query_ids, pad_id, left=True)  # (B, Q)
    r_ids, rm = pad(sampled.token_ids, pad_id, left=False)  # (B, T)
    outputs = [tokenizer.decode(r, skip_special_tokens=True) for r in sampled.token_ids]  # type: ignore[attr-defined]
    ep = Episodes(q, qm, r_ids, rm, rm.clone(), sampled.token_ids, outputs, version=sampled.version,
                  truncated=[cut_by_length(r, spec, tokenizer) for r in sampled.token_ids])
    if sampled.logprobs is not None:
        T = r_ids.shape[1]  # <= T': the cuts only shorten responses, token t stays at column t
        ep.logprobs = sampled.logprobs[:, :T].cpu() * rm  # (B, T), 0 off the actions
        ep.values = sampled.values[:, :T].cpu() * rm if sampled.values is not None else None
    return ep


# ------------------------------------------------------------------------------------------------
# Multi-turn episodes (an environment: env.factory)


@dataclass
class _Row:
    """One training row of an episode: its query and the response built so far (sampled + environment)."""

    query: list[int]
    ids: list[int] = field(default_factory=list)
    action: list[bool] = field(default_factory=list)  # True: sampled by the policy
    logprobs: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    @property
    def context(self) -> list[int]:
        return self.query + self.ids

    def extend(self, ids: list[int], action: bool, logprobs: list[float] | None = None,
               values: list[float] | None = None) -> None:
        self.ids += ids
        self.action += [action] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.values += values if values is not None else [0.0] * len(ids)


@dataclass
class _Episode:
    """An episode in progress."""

    prompt: int  # the prompt's row (named in errors)
    env: Any
    renderer: ChatRenderer
    messages: list[dict[str, Any]]  # the conversation: prompt, assistant turns, environment messages
    rows: list[_Row]
    turns: list[dict[str, Any]] = field(default_factory=list)  # the transcript's turns
    done: bool = False
    truncated: bool = False
    forks: int = 0
    # (row, column in the row's response, reward) of each turn's environment reward (env.turn_rewards)
    rewards: list[tuple[int, int, float]] = field(default_factory=list)

    @property
    def row(self) -> _Row:
        return self.rows[-1]

    def where(self, turn: int | None = None) -> str:
        return f"prompt {self.prompt}" + (f", turn {turn}" if turn is not None else "") + \
            f" ({type(self.env).__name__})"


class EnvFailure(RuntimeError):
    """An environment call failed in an episode (the message names the prompt, the turn and the cause)."""

    def __init__(self, where: str, error: BaseException) -> None:
        known = isinstance(error, (ToolFailure, EnvTimeout))  # their messages say what failed
        cause = str(error) if known else f"{type(error).__name__}: {error}"
        super().__init__(f"{where}: {cause}")


def run_env_episodes(engine: GenerationEngine, tokenizer: Any, records: list[dict[str, Any]], prompt_rows: list[int],
                     spec: SamplingSpec, setup: EnvSetup) -> Episodes:
    """Multi-turn episodes for one chunk round: each prompt record runs in a fresh environment until it is
    done or out of budget. Every rank calls it in every chunk round, with or without prompts: the engine's
    ``ready()`` (a collective under fsdp) is entered once; the turns inside need none, so ranks whose
    episodes take different numbers of turns never wait for each other. Raises (locally) on an
    environment or template failure; the caller makes it collective (``dist.agree``)."""
    episodes = _start(records, prompt_rows, tokenizer, setup)
    with engine.ready():
        for turn in range(1, setup.max_turns + 1):
            active = [e for e in episodes if not e.done]
            if not active:
                break
            _generate(engine, tokenizer, active, spec, setup.max_tokens, turn)
            stepping = [e for e in active if not e.done]
            for e, step in zip(stepping, _steps(stepping, setup, turn)):
                try:
                    _after_step(e, step, turn, setup)
                except TemplateError as err:
                    raise EnvFailure(e.where(turn), err) from err
    return _episodes(episodes, tokenizer, spec, setup, engine.version)


def _start(records: list[dict[str, Any]], prompt_rows: list[int], tokenizer: Any, setup: EnvSetup) -> list[_Episode]:
    """A fresh environment per record (``env.factory``), its ``reset``, and the first query: the prompt's
    conversation plus what ``reset`` returned, rendered with the generation prompt (and the tools)."""
    with isolated_rng():  # nothing an environment does may move the training RNG streams
        envs = [setup.factory() for _ in records]
        outs = setup.runner.run([_bounded(setup, env.reset, (rec,), f"prompt {i}: reset()")
                                 for env, rec, i in zip(envs, records, prompt_rows)])
    episodes = []
    for env, rec, i, (added, error) in zip(envs, records, prompt_rows, outs):
        if why := transcript_clash(rec, f"prompt {i}"):
            raise ValueError(why)
        if error is not None:
            raise EnvFailure(f"prompt {i} ({type(env).__name__}), reset()", error) from error
        messages = rec["prompt"] if isinstance(rec["prompt"], list) else [{"role": "user", "content": rec["prompt"]}]
        messages = [dict(m) for m in messages] + check_messages(added, f"prompt {i}", "reset()")
        renderer = ChatRenderer(tokenizer, [tool_schema(f) for f in getattr(env, "tools", None) or []])
        query = renderer.ids(messages, True)
        if setup.max_tokens is not None and len(query) >= setup.max_tokens:
            raise ValueError(f"prompt {i}: its conversation renders to {len(query)} tokens (with the environment's "
                             f"tools and reset() messages), leaving no room to answer within {setup.max_tokens} "
                             f"tokens (rollout.max_episode_tokens, the model's positions or generation.vllm.max_model_len)")
        episodes.append(_Episode(i, env, renderer, messages, [_Row(query)]))
    return episodes


def _bounded(setup: EnvSetup, fn: Any, args: tuple, what: str) -> Any:
    """A call into the environment for the runner: ``ToolEnv`` bounds its tools itself; any other
    environment's reset/step is bounded by ``env.tool_timeout_s`` as a whole."""
    if isinstance(getattr(fn, "__self__", None), ToolEnv):
        return lambda: maybe_await(fn, *args)
    return lambda: setup.runner.bounded(what, fn, args)


def _generate(engine: GenerationEngine, tokenizer: Any, active: list[_Episode], spec: SamplingSpec,
              max_tokens: int | None, turn: int) -> None:
    """One engine batch: the next assistant turn of every running episode, from its row's context (token
    in); the sampled ids are kept exactly (token out), cut only where the episode's budget ends."""
    room = [max_tokens - len(e.row.context) if max_tokens is not None else spec.max_new_tokens for e in active]
    n = max(1, min(spec.max_new_tokens, max(room)))
    sampled = engine.generate([e.row.context for e in active], replace(spec, max_new_tokens=n))
    for k, (e, ids) in enumerate(zip(active, sampled.token_ids)):
        keep = ids[: room[k]]
        lp = sampled.logprobs[k, : len(keep)].tolist() if sampled.logprobs is not None else None
        val = sampled.values[k, : len(keep)].float().tolist() if sampled.values is not None else None
        e.row.extend(keep, True, lp, val)
        text = tokenizer.decode(keep, skip_special_tokens=True)
        e.messages.append({"role": "assistant", "content": text})
        # A turn cut by the budget is stepped like one cut by max_new_tokens; its reply then cannot fit.
        e.turns.append({"text": text, "token_ids": keep, "tokens": len(keep), "tool_calls": [], "env_messages": [],
                        "reward": None, "env_tokens": 0})


def _steps(active: list[_Episode], setup: EnvSetup, turn: int) -> list[Step]:
    """Every running episode's ``step`` for this turn, run concurrently (runner.py); a failure raises."""
    with isolated_rng():
        outs = setup.runner.run([_bounded(setup, e.env.step, (dict(e.messages[-1]),), f"{e.where(turn)}: step()")
                                 for e in active])
    steps = []
    for e, (out, error) in zip(active, outs):
        if error is not None:
            raise EnvFailure(e.where(turn), error) from error
        steps.append(as_step(out, e.where(turn)))
    return steps


def _after_step(e: _Episode, step: Step, turn: int, setup: EnvSetup) -> None:
    """Record the environment's reply and, unless the episode ends, append its tokens (the template's
    delta) to the row, or start a new row (a fork) where the template is not prefix-preserving."""
    record = e.turns[-1]
    record.update(tool_calls=[c.to_dict() for c in step.tool_calls], env_messages=step.messages, reward=step.reward)
    if step.reward is not None:
        e.rewards.append((len(e.rows) - 1, len(e.row.ids) - 1, float(step.reward)))  # the turn's last action token
    conversation = list(e.messages)
    e.messages += step.messages
    if step.done:
        e.done = True
        return
    if turn == setup.max_turns:
        e.done = e.truncated = True  # the environment would go on: cut by env.max_turns
        return
    try:
        delta = e.renderer.delta(conversation, step.messages, record["token_ids"], turn)
    except TemplateDrift as drift:
        if setup.on_template_drift == "fail":
            raise
        if _fits(setup, drift.rerendered, []):
            e.rows.append(_Row(list(drift.rerendered)))
            e.forks += 1
            record["fork"] = True
        else:
            e.done = e.truncated = True
        return
    if not _fits(setup, e.row.context, delta):
        e.done = e.truncated = True  # the reply does not fit with room for another turn: not shown, episode ends
        return
    e.row.extend(delta, False)
    record["env_tokens"] = len(delta)


def _fits(setup: EnvSetup, context: list[int], delta: list[int]) -> bool:
    """Whether ``delta`` can follow ``context`` with room for at least one more sampled token."""
    return setup.max_tokens is None or len(context) + len(delta) < setup.max_tokens


def _episodes(episodes: list[_Episode], tokenizer: Any, spec: SamplingSpec, setup: EnvSetup, version: int) -> Episodes:
    """The finished episodes as training rows (padded once) with their transcripts."""
    rows = [(k, r) for k, e in enumerate(episodes) for r in e.rows]
    pad_id = tokenizer.pad_token_id
    q, qm = pad([r.query for _, r in rows], pad_id, left=True)  # (B, Q)
    r_ids, rm = pad([r.ids for _, r in rows], pad_id, left=False)  # (B, T)
    am, _ = pad([[int(a) for a in r.action] for _, r in rows], 0, left=False)
    T = r_ids.shape[1]
    ep = Episodes(q, qm, r_ids, rm, am.bool() & rm, [[t for r in e.rows for t in r.ids] for e in episodes],
                  ["\n".join(t["text"] for t in e.turns) for e in episodes], version=version)
    ep.row_episode = [k for k, _ in rows]
    ep.transcripts = [_transcript(e) for e in episodes]
    if spec.logprobs:
        ep.logprobs = torch.tensor([r.logprobs + [0.0] * (T - len(r.ids)) for _, r in rows]).reshape(len(rows), T)
        ep.values = torch.tensor([r.values + [0.0] * (T - len(r.ids)) for _, r in rows]).reshape(len(rows), T)
    starts = [i for i, (k, _) in enumerate(rows) if i == 0 or rows[i - 1][0] != k]  # each episode's first row
    if setup.turn_rewards == "per_turn":
        ep.env_dense = torch.zeros(len(rows), T)  # (B, T)
        for k, e in enumerate(episodes):
            for row, col, reward in e.rewards:
                ep.env_dense[starts[k] + row, col] += reward
    else:
        ep.env_scores = [sum(r for _, _, r in e.rewards) for e in episodes]
    return ep


def _transcript(e: _Episode) -> dict[str, Any]:
    return {"messages": e.messages, "turns": e.turns, "truncated": e.truncated, "forks": e.forks,
            "env_rewards": [t["reward"] for t in e.turns]}


# The transcript as the reward function's keyword arguments (per-sample lists, like metadata columns).
TRANSCRIPT_KWARGS = ("messages", "turn_texts", "turn_token_ids", "tool_calls", "env_rewards", "truncated")


def transcript_clash(columns: Any, where: str) -> str | None:
    """The error for a data column named like a transcript keyword (the reward function would get it
    twice), or None; ``where`` names the data. Checked at start (inputs.py) and again for callers that had
    no data to check there."""
    clash = sorted(set(columns) & set(TRANSCRIPT_KWARGS))
    if not clash:
        return None
    return (f"{where}: data column {clash[0]!r} has the name of an argument multi-turn episodes give the reward "
            f"function for the transcript ({', '.join(TRANSCRIPT_KWARGS)}); rename the column")


def env_records(texts: list[str], metadata: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The prompt records an environment's ``reset`` gets: ``{"prompt": the messages (a conversation) or
    the text, ...metadata columns}``, as the user wrote the row."""
    out = []
    for text, md in zip(texts, metadata):
        rec = {k: v for k, v in md.items() if k != MESSAGES_KEY}
        out.append({"prompt": md.get(MESSAGES_KEY) or text, **rec})
    return out


def reward_metadata(metadata: list[dict[str, Any]], transcripts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each episode's metadata plus its transcript under ``TRANSCRIPT_KWARGS`` (the reward function's and
    ``metric_fn``'s keyword arguments); a prompt column of the same name is an error, never overwritten."""
    if not transcripts:
        return metadata
    out = []
    for md, t in zip(metadata, transcripts):
        if why := transcript_clash(md, "the prompts"):
            raise ValueError(why)
        out.append({**md, "messages": t["messages"], "turn_texts": [x["text"] for x in t["turns"]],
                    "turn_token_ids": [x["token_ids"] for x in t["turns"]],
                    "tool_calls": [x["tool_calls"] for x in t["turns"]], "env_rewards": t["env_rewards"],
                    "truncated": t["truncated"]})
    return out
def cut_by_length(ids: list[int], spec: SamplingSpec, tokenizer: Any) -> bool:
    """Whether a response ended because ``spec.max_new_tokens`` ran out rather than by choice: it has
    that many tokens, its last is not a stop token, and its text holds no stop sequence (an engine cuts
    a response after the token completing a stop sequence, so one found here was completed by the last
    token). TRL's ``is_truncated`` tests the last token against EOS and pad only."""
    if len(ids) < spec.max_new_tokens or ids[-1] in spec.stop_token_ids:
        return False
    if spec.stop_sequences:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        return not any(s in text for s in spec.stop_sequences)
    return True
