"""Stage 7 of the loop: checkpoints (every ``checkpoint.interval`` iterations, once
``checkpoint.interval_minutes`` have passed since the last one, and on pre-emption) and
``final/`` (the policy, its tokenizer and a model card). Collective: every rank calls each function, and
a failure on any rank stops every rank with the same typed error (``dist.agree``). The files themselves
are ``run.checkpoint``'s (imported when a checkpoint is first written: it needs torch)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import dist
from ..config import CheckpointConfig
from ..errors import CheckpointError, Preempted, requested_stop, writing
from .result import TrainResult

if TYPE_CHECKING:
    from .rundir import RunDir

__all__ = ["checkpoint_stage", "save_checkpoint", "save_final"]


def checkpoint_stage(run_dir: "RunDir", step: int, policy: Any, learner: Any, state: Any, ckpt: CheckpointConfig,
                     stopping: bool = False) -> None:
    """A checkpoint every ``checkpoint.interval`` iterations or once ``checkpoint.interval_minutes`` have
    passed since the last one (or the start), then, with ``checkpoint.on_signal``, the pre-emption check. The ranks agree (one all-reduce of one number) whether any of them received
    SIGTERM or SIGUSR1; if so, every rank writes the checkpoint of this iteration (unless it was just
    written) and raises ``Preempted``: all stop after the same iteration, and ``train.resume: auto``
    continues exactly from there. A signal that arrives while a checkpoint is being written is seen
    here, once the write is complete. ``stopping`` (a callback's "stop", already agreed by every rank):
    the run ends after this iteration, so with checkpoints on this iteration's is written too (the run
    stays resumable)."""
    due = bool(ckpt.interval) and (step % ckpt.interval == 0 or stopping)
    if not due and ckpt.interval_minutes:
        due = _minutes_passed(run_dir, ckpt.interval_minutes)
    path = save_checkpoint(run_dir, step, policy, learner, state, ckpt.keep_last) if due else None
    if not ckpt.on_signal:
        return
    signum = dist.any_stop(requested_stop())
    if signum:
        path = path or save_checkpoint(run_dir, step, policy, learner, state, ckpt.keep_last)
        raise Preempted(signum, step, path)


def _minutes_passed(run_dir: "RunDir", minutes: float) -> bool:
    """Have ``minutes`` passed since the last checkpoint (or the start)? The main rank's clock decides and
    tells the others (one broadcast of one flag): every rank must save after the same iteration."""
    passed = dist.is_main() and time.monotonic() - run_dir.last_checkpoint_at >= 60.0 * minutes
    return bool(dist.broadcast_object(passed))


def save_checkpoint(run_dir: "RunDir", step: int, policy: Any, learner: Any, state: Any, keep_last: int) -> Path:
    """``checkpoints/step_<step>/`` (``run.checkpoint.save_checkpoint``), the folder claimed first."""
    from .checkpoint import save_checkpoint as save

    def claim_folder() -> None:  # the first checkpoint: the folder is listed in the manifest first
        if not (run_dir.path / "checkpoints").exists():
            with writing(run_dir.path / "checkpoints", f"saving checkpoint step_{step}"):
                run_dir.claim("checkpoints", is_dir=True)

    # through agree: a failure on the main rank stops every rank here, not in a later collective
    dist.agree(claim_folder, CheckpointError, main_only=True)
    path = save(run_dir.path, step, policy, learner.optimizer,
                {**state.state_dict(), "scheduler": learner.scheduler_state()}, state.shuffle_gen, keep_last)
    run_dir.last_checkpoint_at = time.monotonic()
    return path


def save_final(run_dir: "RunDir", policy: Any, tokenizer: Any, result: "TrainResult | None" = None) -> None:
    """``final/``: the policy via ``save_pretrained`` plus the tokenizer, loadable with plain
    transformers, and ``README.md``, a Hugging Face model card (``run.card``; with the run's ``result``:
    its iterations and last metrics). Written by the main rank; a failure there stops every rank with
    the cause. A sharded policy is first assembled on the main rank (on CPU, one block at a time: one
    full copy). ``final/`` is rallyrl's folder (the manifest), so ``train.overwrite`` removes the card
    with the weights."""
    full = dist.full_state_dict(policy)  # collective under FSDP; None when every rank holds it all

    def save() -> None:
        with writing(run_dir.path / "final", f"saving {run_dir.path / 'final'}"):
            out = run_dir.claim("final", is_dir=True)
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            policy.save_pretrained(out) if full is None else policy.save_pretrained(out, state_dict=full)
            tokenizer.save_pretrained(out)
            if run_dir.cfg is not None:
                _write_card(run_dir, out, result)

    dist.agree(save, CheckpointError, main_only=True, what=f"saving {run_dir.path / 'final'}")


def _write_card(run_dir: "RunDir", out: Path, result: "TrainResult | None") -> None:
    from .card import model_card

    r = result or TrainResult(run_dir.path)
    assert run_dir.cfg is not None
    (out / "README.md").write_text(model_card(
        run_dir.cfg, r.iterations, r.metrics[-1] if r.metrics else {}, r.eval_before, r.eval_after,
        r.stopped_by, dist.world_size()), encoding="utf-8")
