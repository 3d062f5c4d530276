"""The run directory's lifecycle in one object (``RunDir``): may a run start here, is it a resume, from
which checkpoint, what may be removed, what the logs keep after a resume.

rallyrl records every file and folder it creates in ``rallyrl-run.json`` (the manifest) and only ever
removes or replaces what is listed there: ``train.overwrite=true`` removes exactly rallyrl's own
outputs, and a file of the user's under one of rallyrl's output names is never replaced (the run
refuses, naming it). No torch at import: the CLI checks a run directory before it loads anything heavy.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from .. import dist, trackers
from ..config import Change, Config, TrainConfig, config_changes, format_changes
from ..errors import CheckpointError, TrackerError, writing
from . import logs, resume
from .lock import RunDirError, lock_run_dir
from .logs import RunWriter

__all__ = ["MANIFEST", "OUTPUTS", "RunDir"]

MANIFEST = "rallyrl-run.json"
# Everything rallyrl may write at the top of a run directory; folders marked True hold only rallyrl's files.
OUTPUTS = {"config.yaml": False, "config_history.jsonl": False, "metrics.jsonl": False, "rollouts.jsonl": False,
           "eval": False, "checkpoints": True, "final": True, "tensorboard": True, trackers.STATE_FILE: False}


class RunDir:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.resuming = False  # decided by check_start
        self.changes: list[Change] = []  # config changes against the recorded run (a resume)
        # The manifest, read from disk once and then kept here: only this object (on the main rank) writes
        # it, and every change is written through at once (see ``record``).
        self._manifest_cache: dict[str, list[str]] | None = None
        self.cfg: Config | None = None  # the run's config, once check_start has accepted it
        self.found: resume.Found | None = None  # what check_start found here
        self.last_checkpoint_at = time.monotonic()  # checkpoint.interval_minutes counts from here (main rank)

    # --- what is there ---------------------------------------------------------------------------
    def _manifest(self) -> dict[str, list[str]]:
        if self._manifest_cache is None:
            self._manifest_cache = self._read_manifest()
        return self._manifest_cache

    def _read_manifest(self) -> dict[str, list[str]]:
        f = self.path / MANIFEST
        if not f.is_file():
            return {"files": [], "dirs": []}
        try:
            m = json.loads(f.read_text(encoding="utf-8"))
            return {"files": list(m.get("files", [])), "dirs": list(m.get("dirs", []))}
        except (json.JSONDecodeError, AttributeError, TypeError):
            raise RunDirError(f"{f} is corrupt; delete it only if nothing else in {self.path} is rallyrl's") from None

    def _owned(self, rel: str) -> bool:
        m = self._manifest()
        parts = Path(rel).parts
        return rel in m["files"] or any(parts[: len(Path(d).parts)] == Path(d).parts for d in m["dirs"])

    def newest_checkpoint(self) -> Path | None:
        from .checkpoint import checkpoint_dir, list_checkpoints

        steps = list_checkpoints(checkpoint_dir(self.path))
        return steps[-1] if steps else None

    # --- may a run start here? (every rank, before anything heavy) -------------------------------
    @staticmethod
    def check_start(path: Path, cfg: Config, eval_steps: list[int], lock: bool = False,
                    dry_run: bool = False) -> "RunDir":
        """The run directory, once it is decided whether this is a fresh start or a resume, with what
        would mix two runs, replace a user's file or silently change a resumed run refused (with the fix).
        Read-only: every rank (and the launcher, before any worker) may call it.

        ``lock``: first take the run directory's lock (``RunDirLock``; on the main rank only, and unless
        ``train.lock_run_dir`` is false), held until the enclosing ``holding_run_dir_locks`` block ends:
        a second job is refused before anything is read or written. ``dry_run`` (``rallyrl check``):
        the lock is taken only if the folder exists, and nothing is created."""
        if lock:
            RunDir.lock(Path(path), cfg, create=not dry_run)
        run_dir = RunDir(path)
        run_dir._check_start(cfg, eval_steps)
        run_dir.cfg = cfg  # for final/README.md
        return run_dir

    @staticmethod
    def lock(path: Path, cfg: Config, create: bool = True) -> None:
        """Take ``path``'s lock now (``run.lock.lock_run_dir``: main rank, unless ``train.lock_run_dir``
        is false), held until the enclosing ``holding_run_dir_locks`` block ends."""
        lock_run_dir(Path(path), cfg.train.lock_run_dir, create=create)

    def _check_start(self, cfg: Config, eval_steps: list[int]) -> None:
        """Fresh start or resume (``run.resume``: every refusal names a command that works here), then
        what a fresh start would replace."""
        train = cfg.train
        # a missing tracker package names its extra, a W&B run without a login says so, before anything
        # starts (the main rank only logs: only its environment matters)
        if dist.expected_rank() == 0:
            trackers.check(cfg)
        else:
            trackers.check_installed(cfg)
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(f"train.run_dir {self.path} is a file, not a folder")
        self.found = resume.survey(self.path)
        self.resuming = resume.decide(self.found, train)
        if self.resuming:
            self._check_config_change(cfg)
            return
        if self.found.holds_run and not (train.overwrite or train.resume == "auto"):
            raise resume.refusal(self.found)
        for rel in self._planned(eval_steps):
            p = self.path / rel
            if not p.exists() or self._owned(rel):
                continue
            if p.is_dir() and not any(p.iterdir()):
                continue  # an empty folder loses nothing
            raise RunDirError(
                f"train.run_dir {self.path} holds {p}, which rallyrl did not write and would replace; move it "
                f"or choose another train.run_dir")

    def recorded_config(self) -> dict[str, Any] | None:
        """The config the run has trained with so far: ``config.yaml`` as first written, plus every change
        a resume recorded in ``config_history.jsonl``. None if the folder has no ``config.yaml``."""
        path = self.path / "config.yaml"
        if not path.is_file():
            return None
        cfg = yaml.safe_load(path.read_text(encoding="utf-8-sig")) or {}
        history = self.path / "config_history.jsonl"
        for row in logs.read_jsonl(history) if history.is_file() else []:
            for c in row["changes"]:
                *parents, leaf = c["key"].split(".")
                node = cfg
                for k in parents:
                    node = node.setdefault(k, {})
                node[leaf] = c["new"]
        return cfg

    def _check_config_change(self, cfg: Config) -> None:
        """Honest resume: a change to anything that alters training is refused, listed, unless allowed."""
        recorded = self.recorded_config()
        if recorded is None:
            return
        self.changes = config_changes(recorded, cfg.to_dict())
        needs = [c for c in self.changes if c.needs_permission]
        if needs and not cfg.train.allow_config_change:
            raise RunDirError(
                f"train.resume: the config differs from the one {self.path} was trained with, in settings "
                f"that alter training:\n{format_changes(needs)}\nresume with the recorded values, or allow "
                f"the change with --set train.allow_config_change=true (it then takes effect from the "
                f"resumed iteration on, and is recorded in config_history.jsonl)")

    def _planned(self, eval_steps: list[int]) -> list[str]:
        return [n for n in OUTPUTS if n != "eval"] + [f"eval/step_{s}.jsonl" for s in eval_steps]

    # --- start writing (collective) --------------------------------------------------------------
    def open(self, cfg: Config, resumed_from: Path | None, iteration: int,
             was_world_size: int | None = None) -> RunWriter | None:
        """Main rank: a fresh start removes rallyrl's own earlier outputs and writes ``config.yaml``; a
        resume leaves ``config.yaml`` as first written and appends what changed, and at which iteration,
        to ``config_history.jsonl`` (a resume on another number of processes than ``was_world_size``, the
        checkpoint's, is recorded there too: from that iteration on the run is not bit-identical to an
        uninterrupted one). Then the trackers start (a failure there, e.g. a tracker server that cannot be
        reached, stops every rank with a ``TrackerError``). Returns the writer there (None elsewhere).
        Every rank waits here."""
        writer = None
        if dist.is_main():
            line = resume.starting_over_line(self.found, cfg.train) if self.found and not resumed_from else None
            if line:
                print(line, file=sys.stderr, flush=True)
            with writing(self.path, "starting the run"):
                writer = self._open(cfg, resumed_from, iteration, was_world_size)
        dist.barrier()
        self.last_checkpoint_at = time.monotonic()

        def start_trackers() -> None:
            if writer is not None:
                try:
                    writer.start(cfg)
                except BaseException:
                    writer.close()
                    raise

        dist.agree(start_trackers, TrackerError, main_only=True, what="starting the trackers (train.report_to)")
        return writer

    def _open(self, cfg: Config, resumed_from: Path | None, iteration: int, was_world_size: int | None) -> RunWriter:
        self.path.mkdir(parents=True, exist_ok=True)
        if resumed_from is None:
            self.clear_own()
            self.write_file("config.yaml", cfg.to_yaml())
        else:
            self._adopt(cfg, resumed_from, iteration, was_world_size)
        return RunWriter(self, cfg, resuming=resumed_from is not None)

    def _adopt(self, cfg: Config, resumed_from: Path, iteration: int, was_world_size: int | None) -> None:
        """A resume: the outputs here are this run's; what changed since is appended to the history."""
        # Resuming says this folder holds the run: its outputs are rallyrl's (a run written before the
        # manifest existed, or a checkpoint copied elsewhere, is adopted here).
        for name, is_dir in OUTPUTS.items():
            if (self.path / name).exists():
                self.record(name, is_dir or (self.path / name).is_dir())
        changes = self.changes
        if not (self.path / "config.yaml").exists():
            self.write_file("config.yaml", cfg.to_yaml())
            changes = []  # the config just written is the one in use
        resized = was_world_size is not None and was_world_size != dist.world_size()
        if changes or resized:
            row: dict[str, Any] = {"iteration": iteration, "checkpoint": str(resumed_from),
                                   "changes": [{"key": c.key, "old": c.old, "new": c.new} for c in changes]}
            if resized:
                # Not a config key (recorded_config replays only "changes"): the process count is a
                # launch setting, but the record must say where exactness ended.
                row["world_size"] = {"old": was_world_size, "new": dist.world_size()}
                row["bit_identical"] = False
            logs.append_jsonl(self.claim("config_history.jsonl"), row)

    def clear_own(self) -> None:
        """Remove exactly what the manifest lists (rallyrl's outputs), nothing else."""
        m = self._manifest()
        for rel in m["files"]:
            (self.path / rel).unlink(missing_ok=True)
        for rel in m["dirs"]:
            shutil.rmtree(self.path / rel, ignore_errors=True)
        eval_dir = self.path / "eval"
        if eval_dir.is_dir() and not any(eval_dir.iterdir()):
            eval_dir.rmdir()
        (self.path / MANIFEST).unlink(missing_ok=True)
        self._manifest_cache = {"files": [], "dirs": []}

    # --- recording what rallyrl writes (main rank) -----------------------------------------------
    def record(self, rel: str, is_dir: bool = False) -> None:
        """List ``rel`` as rallyrl's. The manifest on disk is rewritten (atomically: a temporary file, then
        ``os.replace``) before the caller creates ``rel``, so a crash at any point leaves a manifest that
        lists everything rallyrl wrote; nothing is written when ``rel`` is already listed."""
        m = self._manifest()
        key = "dirs" if is_dir else "files"
        if rel not in m[key]:
            updated = {**m, key: [*m[key], rel]}
            tmp = self.path / (MANIFEST + ".tmp")
            tmp.write_text(json.dumps(updated, indent=1), encoding="utf-8")
            os.replace(tmp, self.path / MANIFEST)
            self._manifest_cache = updated  # only once it is on disk: a failed write changes nothing here

    def claim(self, rel: str, is_dir: bool = False) -> Path:
        """The path of an output about to be written; refuses a file or folder rallyrl did not write."""
        p = self.path / rel
        if p.exists() and not self._owned(rel) and not (p.is_dir() and not any(p.iterdir())):
            raise RunDirError(f"{p} exists and was not written by rallyrl; refusing to replace it")
        if is_dir and not p.exists():
            p.mkdir(parents=True)
        self.record(rel, is_dir)
        return p

    def write_file(self, rel: str, text: str) -> None:
        self.claim(rel).write_text(text, encoding="utf-8")

    # --- resume ----------------------------------------------------------------------------------
    def resume_point(self, train: TrainConfig) -> Path | None:
        """The checkpoint to resume from (chosen on the main rank, so every rank loads the same one), or
        None for a fresh start."""
        if not self.resuming:
            return None

        def pick() -> str | None:  # the main rank's choice, checksums verified, said in one line
            path, line = resume.choose(self.path, train)
            if line:
                print(line, file=sys.stderr, flush=True)
            return None if path is None else str(path)

        chosen = dist.agree(pick, CheckpointError, main_only=True)
        self.resuming = chosen is not None  # None: `auto` with `overwrite` found no valid checkpoint after all
        return None if chosen is None else Path(chosen)

    def truncate_logs(self, last_step: int) -> None:
        """A killed run may have logged iterations after its last checkpoint: drop them, so the logs
        continue without duplicate or missing steps."""
        if dist.is_main():
            for name in ("metrics.jsonl", "rollouts.jsonl"):
                if (self.path / name).is_file():
                    logs.truncate_jsonl(self.path / name, last_step)
        dist.barrier()
