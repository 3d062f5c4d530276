"""Which start this is: a fresh start, a start over an earlier run, or a resume (and from which
checkpoint), decided from what the run directory holds and ``train.resume`` / ``train.overwrite``.

``train.resume: auto`` is one command for the first start and every restart, whatever the folder holds:

- a valid checkpoint: resume the newest valid one (newer invalid ones are skipped, said in one line);
- an earlier run of rallyrl's with no checkpoint (killed before its first one): start it over, replacing
  rallyrl's own files only (as ``train.overwrite`` does), said in one line;
- nothing: a fresh start;
- checkpoints that are all invalid: refused, since starting over would delete them; with
  ``train.overwrite=true`` it starts over.

Every refusal names, as ``--set key=value`` items, a command that works in the state it found. The look
taken here is quick (listing, manifests, file sizes; no checksums) and the same on every rank; the main
rank verifies the checksums of the checkpoint it resumes from (``choose``). No torch at import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..config import TrainConfig
from ..errors import CheckpointError
from . import logs
from .lock import RunDirError

__all__ = ["Found", "choose", "decide", "refusal", "starting_over_line", "survey"]

_OWN = "only rallyrl's own files"


@dataclass
class Found:
    """What a run directory holds, from a quick look (``survey``)."""

    path: Path
    checkpoints: list[Path] = field(default_factory=list)  # step_<N> folders, oldest first
    newest_valid: Path | None = None  # by the quick look (sizes, not checksums)
    problems: list[tuple[Path, str]] = field(default_factory=list)  # each newer checkpoint: what is wrong
    last_step: int = 0  # the last iteration metrics.jsonl records
    holds_run: bool = False  # an iteration completed here, or a checkpoint was left

    @property
    def root(self) -> Path:
        return self.path / "checkpoints"

    def why_invalid(self) -> str:
        return "; ".join(message for _, message in self.problems)

    def logged(self) -> str:
        n = self.last_step
        return f"{n} iteration{'' if n == 1 else 's'} logged" if n else "no iteration logged"


def survey(path: Path) -> Found:
    from .checkpoint import checkpoint_dir, list_checkpoints, newest_valid

    found = Found(Path(path), list_checkpoints(checkpoint_dir(path)))
    if found.checkpoints:
        found.newest_valid, found.problems = newest_valid(found.root, checksums=False)
    found.last_step = logs.last_step(found.path / "metrics.jsonl")
    found.holds_run = bool(found.checkpoints) or logs.has_iteration(found.path / "metrics.jsonl")
    return found


def decide(found: Found, train: TrainConfig) -> bool:
    """Whether this start resumes (the main rank then picks the checkpoint: ``choose``), refusing, with a
    command that works, a ``train.resume`` that cannot. A fresh start over an earlier run needs
    ``train.overwrite`` or ``auto`` (else the caller raises ``refusal(found)``)."""
    resume = train.resume
    if resume is None:
        return False
    if resume == "auto":
        if found.checkpoints and found.newest_valid is None and not train.overwrite:
            raise RunDirError(
                f"train.resume=auto: every checkpoint in {found.root} is invalid ({found.why_invalid()}); start "
                f"over with --set train.overwrite=true (it removes {_OWN}, those checkpoints included), or choose "
                f"another train.run_dir")
        return found.newest_valid is not None
    if resume == "latest":
        if found.newest_valid is None:
            what = f"no valid checkpoint in {found.root} ({found.why_invalid()})" if found.checkpoints else \
                f"no checkpoint in {found.root}"
            raise RunDirError(f"train.resume=latest: {what}; {_instead(found)}")
        return True
    from .checkpoint import checkpoint_problem

    problem = checkpoint_problem(Path(resume), checksums=False)
    if problem is not None:
        raise RunDirError(f"{problem}; {_instead(found, named=Path(resume))}")
    return True


def _instead(found: Found, named: Path | None = None) -> str:
    """What to run instead of ``train.resume=latest`` or a checkpoint folder that cannot be resumed."""
    if found.newest_valid is not None and found.newest_valid != named:
        return (f"resume from {found.newest_valid.name}, the newest valid checkpoint there, with --set "
                f"train.resume=auto, or name another checkpoint folder")
    if not found.holds_run:
        return ("start a new run with --set train.resume=auto (it resumes when there is a checkpoint and starts "
                "fresh when there is none)")
    if not found.checkpoints:
        return (f"the run there has no checkpoint to resume: start it over with --set train.resume=auto (it "
                f"replaces {_OWN}), or choose another train.run_dir")
    return (f"start over with --set train.resume=auto --set train.overwrite=true (it removes {_OWN}, those "
            f"checkpoints included), or choose another train.run_dir")


def refusal(found: Found) -> RunDirError:
    """A fresh start (no ``train.resume``) in a folder that holds a run, without ``train.overwrite``."""
    head = f"train.run_dir {found.path} already holds a run"
    if found.newest_valid is not None:
        return RunDirError(f"{head} (newest checkpoint {found.newest_valid.name}); resume it with --set "
                           f"train.resume=auto, start over with --set train.overwrite=true (it removes {_OWN}), "
                           f"or choose another train.run_dir")
    if not found.checkpoints:
        return RunDirError(f"{head} with no checkpoint to resume ({found.logged()}); start it over with --set "
                           f"train.resume=auto or --set train.overwrite=true (either replaces {_OWN}), or choose "
                           f"another train.run_dir")
    return RunDirError(f"{head} whose checkpoints are all invalid ({found.why_invalid()}); start over with --set "
                       f"train.overwrite=true (it removes {_OWN}, those checkpoints included), or choose another "
                       f"train.run_dir")


def starting_over_line(found: Found, train: TrainConfig) -> str | None:
    """The one line a fresh start with ``auto`` says when it starts over an earlier run (None: it does not)."""
    if train.resume != "auto" or not found.holds_run or found.newest_valid is not None:
        return None
    if found.checkpoints:  # all invalid, and train.overwrite=true (else `decide` refused)
        return (f"rallyrl: train.resume=auto: no valid checkpoint in {found.root} ({found.why_invalid()}): "
                f"starting over (train.overwrite=true)")
    return (f"rallyrl: train.resume=auto: {found.path} holds an earlier run with no checkpoint to resume "
            f"({found.logged()}); starting it over: rallyrl's own files there are replaced, any others are kept")


def choose(path: Path, train: TrainConfig) -> tuple[Path | None, str | None]:
    """The main rank's pick, checksums verified: the checkpoint to resume from (None: start over after
    all, for ``auto`` with ``overwrite`` when every checkpoint failed) and the one line to say about it."""
    from .checkpoint import checkpoint_dir, newest_valid, verify_checkpoint

    if train.resume not in ("latest", "auto"):
        named = Path(train.resume)
        try:
            verify_checkpoint(named)
        except CheckpointError as e:  # (a checksum: the quick look of `decide` passed it)
            raise CheckpointError(f"{e}; {_instead(survey(path), named)}") from None
        return named, None
    root = checkpoint_dir(path)
    newest, problems = newest_valid(root)
    why = "; ".join(message for _, message in problems)
    if newest is None:
        if train.resume == "auto" and train.overwrite:
            return None, f"rallyrl: no valid checkpoint in {root} ({why}): starting over (train.overwrite=true)"
        raise CheckpointError(
            f"train.resume={train.resume}: no valid checkpoint in {root} ({why}); start over with --set "
            f"train.resume=auto --set train.overwrite=true (it removes {_OWN}, those checkpoints included), or "
            f"choose another train.run_dir")
    if not problems:
        return newest, None
    several = len(problems) > 1
    return newest, (f"rallyrl: resuming from {newest.name}: the newer checkpoint{'s' if several else ''} "
                    f"{', '.join(p.name for p, _ in problems)} {'are' if several else 'is'} invalid ({why})")
