"""What changed between two configs (resume compares the run's recorded config with the new one), and the
config as flat dotted keys (what trackers log as the run's parameters)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from .root import Config


# Keys whose change never alters what is trained: how long the run goes, what is logged, how often it is
# saved, resources and control flags. Everything else (optimizer, PPO, rollout, generation, seed, model,
# reward, data, eval) needs `train.allow_config_change`; so does any key not listed here, new ones included.
FREE_TO_CHANGE = frozenset({
    "train.iterations", "train.run_dir", "train.log_rollouts", "train.tensorboard", "train.progress",
    "train.save_final", "train.num_threads", "train.overwrite", "train.resume", "train.allow_config_change",
    "train.report_to", "train.project", "train.run_name",
    "checkpoint.interval", "checkpoint.interval_minutes", "checkpoint.keep_last", "checkpoint.on_signal", "train.lock_run_dir", "dist.timeout_s",
    "reward.overlap",  # the same rewards, only scored beside generation: same results (tested)
    # limits on how tools run, not on what they return (the same results for tools that finish in time)
    "env.tool_timeout_s", "env.max_concurrent_tools",
})

_ABSENT = "<absent>"


@dataclass(frozen=True)
class Change:
    key: str  # dotted key, e.g. "ppo.lr"
    old: Any  # the recorded value (``"<absent>"`` if the old config lacks the key)
    new: Any
    needs_permission: bool  # True: it alters training (see FREE_TO_CHANGE)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> ``{dotted key: leaf}``; lists (prompts, reward.fns, stop sequences) are leaves."""
    if not isinstance(d, dict) or (prefix and not d):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        # free-form mappings (reward kwargs) compare as one value: their keys are the user's, not ours
        out.update({key: v} if k == "kwargs" else _flatten(v, key))
    return out


def flat_config(cfg: Config) -> dict[str, Any]:
    """The config as ``{"section.key": value}`` (what trackers log as the run's parameters)."""
    return _flatten(cfg.to_dict())


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """Every dotted key whose value differs between two config dicts (``Config.to_dict()`` or a loaded
    ``config.yaml``), in the order of ``new`` then keys only ``old`` has. Ints and equal floats compare
    equal (``1`` == ``1.0``), so a YAML round trip is no change; a key only ``new`` has, at its default,
    is no change either (a run recorded by an older rallyrl resumes after an upgrade)."""
    a, b = _flatten(old), _flatten(new)
    defaults = _flatten(Config().to_dict())
    out = []
    for key in [*b, *(k for k in a if k not in b)]:
        va, vb = a.get(key, _ABSENT), b.get(key, _ABSENT)
        # A key the recorded config lacks (written by an older rallyrl) at its default is no change: a
        # new option's default keeps the behaviour the run had, so an upgrade does not block a resume.
        if va != vb and not (va == _ABSENT and key in defaults and defaults[key] == vb):
            out.append(Change(key, va, vb, key not in FREE_TO_CHANGE))
    return out


def _short(v: Any, width: int = 60) -> str:
    s = "null" if v is None else (v if v == _ABSENT else yaml.safe_dump(v, default_flow_style=True, width=10**6)
                                  .strip().removesuffix("...").strip())
    return s if len(s) <= width else s[: width - 3] + "..."


def format_changes(changes: list[Change], indent: str = "  ") -> str:
    """One ``key: old -> new`` line per change (long values shortened)."""
    return "\n".join(f"{indent}{c.key}: {_short(c.old)} -> {_short(c.new)}" for c in changes)

