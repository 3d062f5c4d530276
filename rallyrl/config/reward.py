"""`reward:` (with each `reward.fns` entry): which function scores the samples, where and how."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .fields import _f


@dataclass
class RewardFnSpec:
    fn: str = _f("", "Import path of a reward function: `pkg.mod:attr` or `path/to/file.py:attr`.")
    weight: float = _f(1.0, "Weight of this function in the summed score.")
    name: str = _f("", "Metric name (`reward/<name>`); default: the attribute name.")
    kwargs: dict[str, Any] = _f({}, "If set, `fn` is a factory: `fn(**kwargs)` builds the reward function.")


@dataclass
class OverlongBufferConfig:
    length: int = _f(
        0, "Required: the soft zone, in tokens, at the end of `generation.max_new_tokens` (1 .. max_new_tokens).",
        ge=1, why="required when reward.overlong_buffer is set",
    )
    penalty: float = _f(1.0, "The penalty at `generation.max_new_tokens` tokens (DAPO's 1.0).", gt=0)


@dataclass
class RewardConfig:
    fn: str | None = _f(
        None, "Import path of the reward function (`pkg.mod:attr` or `file.py:attr`); or pass `reward_fn=`."
    )
    kwargs: dict[str, Any] = _f({}, "If set, `reward.fn` is a factory called as `fn(**kwargs)`.")
    fns: list[RewardFnSpec] = _f([], "Several weighted reward functions (instead of `reward.fn`).")
    placement: Literal["main", "local", "collective"] = _f(
        "main",
        "Where the reward runs: `main` = gather to rank 0, one batched call, scatter back; `local` = each "
        "rank scores its own; `collective` = every rank calls it on the full batch (sharded reward models).",
    )
    batch_size: int | None = _f(
        None, "Micro-batch size of reward calls (null = one call with every sample of the chunk round).",
        gt=0,
    )
    url: str | list[str] | None = _f(
        None,
        "URL of a reward server (`rallyrl serve-reward`, or OpenRLHF's), or a list of URLs (each batch split "
        "over them): the reward function is then `rallyrl.RemoteReward` (instead of `reward.fn`/`reward.fns`).",
    )
    timeout_s: float | None = _f(
        None,
        "Seconds a reward call may take. With `reward.url`: per HTTP attempt, then retried (null = 60). "
        "In-process: a longer call stops the run on every rank with a RewardError naming this key (null = no bound).",
        gt=0,
    )
    retries: int = _f(3, "With `reward.url`: extra attempts (exponential backoff with jitter) before the run "
                         "stops with a RewardError naming the URL and the last failure.", ge=0)
    protocol: Literal["rallyrl", "openrlhf"] = _f(
        "rallyrl", "With `reward.url`: `rallyrl` (POST /score) or `openrlhf` (POST /get_reward)."
    )
    overlap: bool = _f(
        False,
        "With `reward.url` (or `reward.server: local`) and `placement: main`: score each chunk round in the "
        "background while the ranks generate and score the next one; rewards are collected once per "
        "iteration, before reward shaping (same results as without).",
    )
    server: Literal["none", "local"] = _f(
        "none",
        "`local`: rank 0 starts `rallyrl serve-reward` for `reward.fn` (+ `reward.kwargs`) as its own child "
        "process on 127.0.0.1 (a free port), waits until it answers, sends every reward call there and stops "
        "it when the run ends, also on failure or Ctrl-C. `none`: rallyrl starts no server.",
    )
    signature: Literal["auto", "trlx", "trl"] = _f(
        "auto",
        "How the reward functions are called: `trlx` = `fn(samples, prompts, outputs, **kwargs)` (kwargs: "
        "`output_token_ids`, `tokenizer`, every data column); `trl` = as TRL's GRPOTrainer, by keyword: "
        "`fn(prompts=, completions=, completion_ids=, **columns)`; `auto` = read from each function's "
        "parameter names at start (docs/reward.md, \"Coming from TRL\").",
    )
    server_args: list[str] = _f(
        [], "With `reward.server: local`: more `rallyrl serve-reward` options, e.g. `[--max-wait-ms, '20']` "
            "(--max-batch, --max-wait-ms, --no-batching, --max-body-mb; the function, host and port are "
            "set by rallyrl).",
    )
    overlong_buffer: OverlongBufferConfig | None = _f(
        None,
        "DAPO's soft overlong punishment: `{length: L, penalty: p}` adds `-p * clamp(n - (max_new_tokens - L), 0, "
        "L) / L` to the score of a response of `n` sampled tokens (0 up to `max_new_tokens - L`, then linear down "
        "to `-p` at `generation.max_new_tokens`), logged as the reward component `reward/overlong`; null = off. "
        "See docs/algorithms.md.",
    )




def reward_fn_name(spec: RewardFnSpec) -> str:
    if spec.name:
        return spec.name
    return spec.fn.rsplit(":", 1)[-1] if ":" in spec.fn else spec.fn

