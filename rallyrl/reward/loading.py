"""Resolve reward functions from import paths (``pkg.mod:attr`` or ``path/to/file.py:attr``).

Resolution rule (the same in every process, with 1 or N processes, and under ``rallyrl``, ``python -m
rallyrl.cli``, ``torchrun`` or ``accelerate launch``): ``pkg.mod:attr`` is imported the way ``python -m``
imports, with the current working directory searched first, then the installed packages;
``path/to/file.py:attr`` is a file path, relative to the current working directory, and the file's folder
is put on ``sys.path`` so it can import its neighbours. (Before, the ``rallyrl`` console script did not
search the working directory, so ``examples.randomwalks.task:reward_fn`` failed in one process from the
repo root and worked with ``--nproc 2``, whose workers run ``python -m``.)
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import RewardConfig
    from .samples import NamedRewardFn


class ImportPathError(ValueError):
    """An import path does not name a callable."""


class RewardFactoryError(ImportPathError):
    """A reward factory (``reward.fn`` with ``reward.kwargs``) rejected its arguments: a config error,
    reported by the CLI like one (no traceback, exit code 2)."""


def load_object(spec: str, what: str = "reward.fn") -> Any:
    if ":" not in spec:
        raise ImportPathError(f"{what}: {spec!r} must look like 'package.module:attr' or 'path/to/file.py:attr'")
    mod_part, attr = spec.rsplit(":", 1)
    if mod_part.endswith(".py"):
        path = Path(mod_part)
        if not path.is_file():
            raise ImportPathError(f"{what}: file not found: {path}")
        name = f"rallyrl_user_{abs(hash(str(path.resolve())))}"
        if name in sys.modules:
            module = sys.modules[name]
        else:
            mspec = importlib.util.spec_from_file_location(name, path)
            assert mspec and mspec.loader
            module = importlib.util.module_from_spec(mspec)
            sys.modules[name] = module
            # The file's folder goes on sys.path so it can import its neighbours.
            sys.path.insert(0, str(path.resolve().parent))
            try:
                mspec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[name]
                raise ImportPathError(f"{what}: importing {path} failed: {type(e).__name__}: {e}") from e
    else:
        _search_working_directory()
        try:
            module = importlib.import_module(mod_part)
        except Exception as e:
            raise ImportPathError(f"{what}: cannot import module {mod_part!r}: {type(e).__name__}: {e}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImportPathError(f"{what}: {mod_part!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _search_working_directory() -> None:
    """Put the working directory on ``sys.path`` (first, as ``python -m`` does) if it is not there yet."""
    cwd = os.getcwd()
    if not any(os.path.abspath(p or os.curdir) == cwd for p in sys.path):
        sys.path.insert(0, cwd)
        importlib.invalidate_caches()


def load_callable(spec: str, what: str = "reward.fn", kwargs: dict[str, Any] | None = None) -> Callable:
    obj = load_object(spec, what)
    if not callable(obj):
        raise ImportPathError(f"{what}: {spec!r} is of type {type(obj).__name__}, not callable")
    if kwargs:
        try:
            obj = obj(**kwargs)
        except Exception as e:
            raise RewardFactoryError(f"{what}: {spec}(**kwargs) failed: {type(e).__name__}: {e}") from e
        if not callable(obj):
            raise ImportPathError(f"{what}: {spec!r}(**kwargs) returned a {type(obj).__name__}, not a callable")
    return obj


def resolve_reward_fns(cfg: "RewardConfig", reward_fn: Any = None) -> list["NamedRewardFn"]:
    """The run's reward functions: ``reward_fn`` (a callable, a ``NamedRewardFn`` or a list of them,
    from the Python API) wins over ``reward.fns`` / ``reward.fn`` in the config. Each comes with its
    signature (``reward.signature``, or read from its parameters: ``signature.py``), so a function that
    cannot be called fails here, before any model loads."""
    import dataclasses

    from .signature import detect_signature

    return [dataclasses.replace(nf, signature=nf.signature or detect_signature(nf.fn, nf.name, cfg.signature))
            for nf in _reward_fns(cfg, reward_fn)]


def _reward_fns(cfg: "RewardConfig", reward_fn: Any) -> list["NamedRewardFn"]:
    from ..config import ConfigError, reward_fn_name
    from .samples import NamedRewardFn

    if reward_fn is not None:
        if cfg.server == "local":
            raise ConfigError("reward.server: local serves reward.fn (an import path) in its own process; a "
                              "reward_fn passed to train() cannot be sent there: set reward.fn instead")
        fns = reward_fn if isinstance(reward_fn, (list, tuple)) else [reward_fn]
        out = []
        for i, f in enumerate(fns):
            if isinstance(f, NamedRewardFn):
                out.append(f)
            elif callable(f):
                out.append(NamedRewardFn(getattr(f, "__name__", f"fn{i}"), f))
            else:
                raise ConfigError(f"reward_fn[{i}] is a {type(f).__name__}, not callable")
        return out
    if cfg.url is not None:
        if cfg.fn or cfg.fns:  # also checked when the config is loaded; a RewardConfig may be built by hand
            raise ConfigError(f"set either reward.url or reward.{'fn' if cfg.fn else 'fns'}, not both")
        from .client import RemoteReward

        try:
            remote = RemoteReward(cfg.url, timeout_s=cfg.timeout_s if cfg.timeout_s is not None else 60.0,
                                  retries=cfg.retries, protocol=cfg.protocol)
        except ValueError as e:
            raise ConfigError(f"reward.url: {e}") from None
        return [NamedRewardFn("remote", remote)]
    if cfg.fns:
        return [NamedRewardFn(reward_fn_name(s), load_callable(s.fn, f"reward.fns[{i}].fn", s.kwargs), s.weight)
                for i, s in enumerate(cfg.fns)]
    if cfg.fn:
        # With reward.server: local this imports (and, with kwargs, builds) the function here too, so a
        # bad path or factory argument fails before anything starts; the server process is what calls it
        # (a lazy reward model such as hf_classifier loads no weights here).
        return [NamedRewardFn(cfg.fn.rsplit(":", 1)[-1], load_callable(cfg.fn, "reward.fn", cfg.kwargs))]
    raise ConfigError("no reward function: set reward.fn (or reward.fns) or pass reward_fn=")
