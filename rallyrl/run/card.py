"""``final/README.md``: a Hugging Face model card, so ``final/`` can be pushed to a model hub as it is.

YAML front matter (``base_model``, ``library_name: rallyrl``, ``tags``, ``pipeline_tag``), then what was
trained and how: the algorithm, the iterations run, the last iteration's reward and KL, the latest
evaluation against the one before training, how to load it, and the training config.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from ..config import Config

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_MAX_LIST = 20  # a longer list in the config (inline prompts) is shown as its length


ALGORITHMS = {"gae": "PPO", "grpo": "GRPO", "rloo": "RLOO"}  # ppo.estimator -> the name a card and tags use


def algorithm(cfg: Config) -> str:
    """The algorithm's name (Dr. GRPO: ``grpo`` without std scaling, sequence-sum loss; docs/algorithms.md)."""
    p = cfg.ppo
    if p.estimator == "grpo" and p.group_scale == "none" and p.loss_aggregation == "seq_mean_token_sum":
        return "Dr. GRPO"
    return ALGORITHMS[p.estimator]


def _settings(cfg: Config) -> str:
    """The algorithm's main settings, in one line."""
    p, G = cfg.ppo, cfg.rollout.samples_per_prompt
    clip = f"{p.clip_range:g}" if p.clip_range_high is None else f"[{p.clip_range:g}, {p.clip_range_high:g}]"
    base = (f"value head + GAE (gamma {p.gamma:g}, lambda {p.lam:g})" if p.estimator == "gae" else
            f"{G} completions per prompt, {'group-normalised' if p.estimator == 'grpo' else 'leave-one-out'} "
            f"baseline, no value head")
    if not p.uses_reference:
        kl = "no KL penalty (no reference model)"
    else:
        kl = (f"adaptive (target {p.target_kl:g}, initial beta {p.init_kl_coef:g})" if p.target_kl is not None
              else f"beta {p.init_kl_coef:g}")
        kl = f"KL to the starting policy ({p.kl_estimator}, in the {p.kl_in}): {kl}"
    return (f"{base}; clip range {clip}; {p.epochs} epoch(s) x {p.num_minibatches} minibatch(es) per iteration, "
            f"lr {p.lr:g} {p.lr_schedule}, loss {p.loss_aggregation}; {kl}")


def base_model(cfg: Config) -> tuple[str, bool]:
    """The model the run started from, and whether that is a hub id (else the local folder as written):
    ``model.path`` itself when it is not a local folder, else the ``_name_or_path`` its ``config.json``
    records when that is a hub id."""
    path = cfg.model.path
    if not Path(path).exists() and _HUB_ID.match(path):
        return path, True
    try:
        recorded = json.loads((Path(path) / "config.json").read_text(encoding="utf-8")).get("_name_or_path", "")
    except (OSError, ValueError, AttributeError):
        recorded = ""
    if isinstance(recorded, str) and _HUB_ID.match(recorded) and not Path(recorded).exists():
        return recorded, True
    return path, False


def _shortened(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _shortened(v) for k, v in d.items()}
    if isinstance(d, list) and len(d) > _MAX_LIST:
        return f"<{len(d)} items: see config.yaml in the run directory>"
    return d


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def model_card(cfg: Config, iterations: int, last: dict[str, float], eval_before: dict[str, float],
               eval_after: dict[str, float], stopped_by: str | None = None, world_size: int = 1) -> str:
    """The card's text. ``iterations``: the last completed iteration; ``last``: its metrics."""
    base, on_hub = base_model(cfg)
    algo = algorithm(cfg)
    seq2seq = cfg.model.arch == "seq2seq"
    task = "text2text-generation" if seq2seq else "text-generation"
    front = {"base_model": base, "library_name": "rallyrl", "pipeline_tag": task,
             "tags": ["rallyrl", "reinforcement-learning", algo.lower().replace(". ", "-"), task]}
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
             f"# {Path(cfg.train.run_dir).resolve().name}", ""]
    source = f"[{base}](https://huggingface.co/{base})" if on_hub else f"`{base}` (a local folder)"
    lines += [f"This model was fine-tuned from {source} with rallyrl "
              f"using {algo}: reinforcement learning against reward function(s) (docs/algorithms.md of rallyrl).", ""]
    if not on_hub:
        lines += ["`base_model` above is the local folder the run started from; set it to the base model's hub id "
                  "before pushing, if it has one.", ""]
    rewards = [cfg.reward.fn] if cfg.reward.fn else [s.fn for s in cfg.reward.fns] or \
        ([cfg.reward.url] if isinstance(cfg.reward.url, str) else list(cfg.reward.url or [])) or ["passed in Python"]
    done = f"{iterations} of {cfg.train.iterations}"
    if stopped_by:
        done += f" (stopped early by the callback {stopped_by})"
    lines += ["## Training", "",
              f"- algorithm: {algo} ({_settings(cfg)})",
              f"- iterations: {done}, {cfg.rollout.num_rollouts} rollouts each, on {world_size} process(es)",
              f"- reward: {', '.join(f'`{r}`' for r in rewards)}",
              f"- generation: up to {cfg.generation.max_new_tokens} new tokens, temperature "
              f"{cfg.generation.temperature:g}", ""]
    shown = {k: v for k, v in last.items() if k.startswith("reward/") or k in ("policy/kl", "policy/kl_coef")}
    if shown:
        lines += [f"### Last iteration ({iterations})", "", "| metric | value |", "|---|---|"]
        lines += [f"| `{k}` | {_fmt(v)} |" for k, v in sorted(shown.items())] + [""]
    if eval_after or eval_before:
        keys = sorted(set(eval_after) | set(eval_before))
        lines += ["### Evaluation", "", "| metric | before training | latest |", "|---|---|---|"]
        lines += [f"| `{k}` | {_fmt(eval_before.get(k, '-'))} | {_fmt(eval_after.get(k, '-'))} |" for k in keys] + [""]
    auto = "AutoModelForSeq2SeqLM" if seq2seq else "AutoModelForCausalLM"
    lines += ["## Use", "", "```python", f"from transformers import {auto}, AutoTokenizer", "",
              f'model = {auto}.from_pretrained("path/to/final")',
              'tokenizer = AutoTokenizer.from_pretrained("path/to/final")', "```", ""]
    if not cfg.ppo.critic_free:  # GRPO and RLOO train no value head: nothing to leave out
        lines += ["The value head used in training is not part of this folder.", ""]
    lines += ["## Config", "", "```yaml", yaml.safe_dump(_shortened(cfg.to_dict()), sort_keys=False).strip(), "```", ""]
    return "\n".join(lines)
