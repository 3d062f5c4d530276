"""Weights & Biases (``train.report_to: [wandb]``; the ``wandb`` extra)."""

from __future__ import annotations

import configparser
import netrc
import os
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..config import Config, ConfigError
from .common import TrackerState, exit_status, param_values, project_name, run_name, scalars

_NO_LOGIN_MODES = ("offline", "disabled", "dryrun")


def check(cfg: Config) -> str:
    """What can be known before a run starts, without importing wandb (seconds): the mode and, online,
    whether a login is there, where wandb itself looks (``WANDB_API_KEY``, ``WANDB_IDENTITY_TOKEN_FILE``,
    the netrc entry ``wandb login`` writes). Online without one, ``wandb.init`` would fail only after the
    model loaded (tens of seconds): a ``ConfigError`` naming the fixes instead."""
    mode = os.environ.get("WANDB_MODE") or _setting("mode") or "online"
    if os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        mode = "disabled"
    if mode in _NO_LOGIN_MODES:
        return f"wandb: {mode} (no login needed; `wandb sync` uploads an offline run later)"
    base = os.environ.get("WANDB_BASE_URL") or _setting("base_url") or "https://api.wandb.ai"
    source = _login(base)
    if source is None:
        raise ConfigError(
            f"train.report_to: wandb logs online (WANDB_MODE={mode}) but finds no W&B login for {base}: run "
            f"`wandb login`, set WANDB_API_KEY, or log offline with WANDB_MODE=offline (`wandb sync` uploads the "
            f"run later)")
    return f"wandb: {mode} to {base}, login from {source}"


def _setting(key: str) -> str | None:
    """``key`` from wandb's settings files: the workspace's (``wandb/settings`` under ``WANDB_DIR`` or the
    working directory), else the global one (``WANDB_CONFIG_DIR/settings``, ``~/.config/wandb/settings``)."""
    root = Path(os.environ.get("WANDB_DIR") or ".")
    config_dir = Path(os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb")
    for path in (root / "wandb" / "settings", root / ".wandb" / "settings", config_dir / "settings"):
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
        except configparser.Error:
            continue
        if parser.get("default", key, fallback=None):
            return parser.get("default", key)
    return None


def _login(base_url: str) -> str | None:
    """Where a W&B credential for ``base_url`` comes from, or None."""
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if os.environ.get(var):
            return var
    path = os.environ.get("NETRC") or str(Path.home() / ".netrc")
    try:
        entry = netrc.netrc(path).authenticators(urlsplit(base_url).netloc or base_url)
    except (OSError, netrc.NetrcParseError):
        return None
    return path if entry and entry[2] else None


class Wandb:
    """``wandb.init(project, name, id, resume="allow", config)``; ``WANDB_MODE=offline`` etc. apply."""

    def __init__(self, cfg: Config, state: TrackerState) -> None:
        self.cfg, self.state = cfg, state
        self.run: Any = None

    def start(self, config: dict[str, Any]) -> None:
        import wandb

        # The id is chosen and kept before wandb.init: a run killed at any point resumes the same run.
        run_id = self.state.get("wandb").get("id") or os.environ.get("WANDB_RUN_ID") or secrets.token_hex(4)
        self.state.set("wandb", {"id": run_id})
        # WANDB_DIR and WANDB_MODE are read per run: wandb keeps the first run's in a process-wide
        # singleton, so a second train() in one process (a sweep, a test) would otherwise ignore changes.
        mode = os.environ.get("WANDB_MODE")
        self.run = wandb.init(project=project_name(self.cfg, "WANDB_PROJECT"), name=run_name(self.cfg, "WANDB_NAME"),
                              id=run_id, resume="allow", config=param_values(config), dir=os.environ.get("WANDB_DIR"),
                              mode=mode if mode in ("online", "offline", "disabled", "shared") else None)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        # wandb refuses steps below the run's current one: after a resume, the iterations between the
        # checkpoint and the kill are already there (with the same values: resume is bit-exact).
        if step >= (getattr(self.run, "step", 0) or 0):
            self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if exit_status() == "finished" else 1)
            self.run = None
