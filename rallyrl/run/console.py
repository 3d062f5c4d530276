"""What the run says while it runs (main rank): the progress bar or one line per iteration, the waiting
notice, the resume and interruption lines, and the run's callbacks (``rallyrl.callbacks``: run on the
main rank, their decisions agreed by all). ``RunLog`` also hands each iteration's metrics, rollouts and
evaluation samples to the run directory's writer (``run.logs.RunWriter``) and fills the ``TrainResult``
that ``train()`` returns."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import dist
from ..callbacks import Callbacks
from ..config import Config, config_warnings
from ..errors import Preempted
from .logs import RunWriter, episode_records
from .result import TrainResult

if TYPE_CHECKING:
    from ..rollout import Rollouts

__all__ = ["RunLog", "TrainResult", "stderr_is_terminal", "wait_notice_after_s"]


def wait_notice_after_s() -> float:
    """Seconds of waiting for the reward before the progress line says so: 5, or ``RALLYRL_WAIT_NOTICE_S``
    (an internal knob, for tests)."""
    try:
        return float(os.environ.get("RALLYRL_WAIT_NOTICE_S", "5"))
    except ValueError:
        return 5.0


def stderr_is_terminal() -> bool:
    """A progress bar redraws itself with carriage returns: only a terminal shows that as one line."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


class RunLog:
    """Progress bar, the per-iteration line, the run-dir writers (main rank; no-ops elsewhere) and the
    run's callbacks (``rallyrl.callbacks``: run on the main rank, their decisions agreed by all).

    Progress: a bar only when ``train.progress`` is on and stderr is a terminal; in a log (CI, ``nohup``,
    a job scheduler) each iteration is one plain line, never a bar's redraws glued to it."""

    def __init__(self, writer: RunWriter | None, cfg: Config, start: int, result: TrainResult,
                 callbacks: Sequence[Any] | None = None) -> None:
        self.writer, self.total, self.result = writer, cfg.train.iterations, result
        self.result.iterations = start
        self.callbacks = Callbacks(callbacks)
        self.log_rollouts = cfg.train.log_rollouts
        self.bar = None
        if cfg.train.progress and dist.is_main() and stderr_is_terminal():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, initial=start, desc="ppo", unit="it", file=sys.stderr,
                            dynamic_ncols=True, leave=False)

    def start(self, plan: Any, cfg: Config, resumed_from: Path | None, iteration: int,
              was_world_size: int | None = None) -> None:
        self.say(f"rallyrl: {plan.world_size} process(es), {plan.num_rollouts} rollouts/iteration "
                 f"({'/'.join(map(str, plan.local_counts))} per rank, {plan.rounds} chunk round(s)), "
                 f"{cfg.train.iterations} iterations, reward placement '{cfg.reward.placement}'"
                 + (f", estimator {cfg.ppo.estimator} with {cfg.rollout.samples_per_prompt} completions per prompt"
                    if cfg.rollout.samples_per_prompt > 1 or cfg.ppo.critic_free else ""))
        for warning in config_warnings(cfg):
            self.say(f"rallyrl: warning: {warning}")
        if resumed_from is not None:
            self.say(f"resumed from {resumed_from} at iteration {iteration}")
        if resumed_from is not None and was_world_size is not None and was_world_size != plan.world_size:
            n = plan.world_size
            self.say(f"rallyrl: the run continues from step {iteration} on {n} process{'' if n == 1 else 'es'} (was "
                     f"{was_world_size}); weights, optimizer, LR schedule, KL controller, reward moments and the "
                     f"prompt position carried over, the per-rank random streams (generation sampling, "
                     f"minibatch order) were re-derived from train.seed, the rank and the iteration, so it is "
                     f"not bit-identical to an uninterrupted run (recorded in config_history.jsonl)")
        try:
            self.callbacks.start({"run_dir": self.result.run_dir, "config": cfg, "world_size": plan.world_size,
                                  "iterations": cfg.train.iterations, "start_iteration": iteration,
                                  "resumed_from": resumed_from, "num_rollouts": plan.num_rollouts})
        except BaseException:
            self.close()  # before the trainer's try: the trackers end here, as failed
            raise

    def interrupted(self, completed: int, newest: Path | None, stop: BaseException | None = None) -> None:
        """Ctrl-C: close the bar first so the line stands on its own, then say how to continue. A
        pre-emption stop (``Preempted``) names the checkpoint it wrote."""
        self.close()
        if isinstance(stop, Preempted):
            self.say(f"rallyrl: stopped by {signal.Signals(stop.signum).name} after iteration {stop.iteration}; "
                     f"checkpoint {stop.checkpoint} written; continue with --set train.resume=auto (or latest)")
        elif newest is None:
            self.say(f"rallyrl: interrupted at iteration {completed + 1}; no checkpoint yet (checkpoint.interval, "
                     f"checkpoint.interval_minutes): --set train.resume=auto starts the run over")
        else:
            self.say(f"rallyrl: interrupted at iteration {completed + 1}; newest checkpoint {newest.name}; "
                     f"resume with --set train.resume=latest")

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """While the block runs for longer than ``wait_notice_after_s()`` (5 s), the progress output says
        so: ``"<what>, 42 s"`` (e.g. "waiting for the reward on rank 0, 42 s"). With a progress bar it is
        the bar's postfix, updated in place every second and cleared afterwards; without one, a line at
        5 s, 10 s, 20 s, 40 s, ... (doubling: a long wait is visible, a log is not flooded). Main rank
        only; a helper thread does the telling, the block itself is untouched."""
        if not dist.is_main():
            yield
            return
        after, t0, done = wait_notice_after_s(), time.monotonic(), threading.Event()
        shown = False

        def tell() -> None:
            nonlocal shown
            next_line = after
            while not done.wait(min(1.0, after) if shown else after):
                waited = time.monotonic() - t0
                bar = self.bar
                if bar is not None:
                    bar.set_postfix_str(f"{what}, {waited:.0f} s")
                    shown = True
                elif waited >= next_line:
                    self.say(f"rallyrl: {what}, {waited:.0f} s")
                    shown, next_line = True, next_line * 2

        helper = threading.Thread(target=tell, name="rallyrl-wait-notice", daemon=True)
        helper.start()
        try:
            yield
        finally:
            done.set()
            helper.join()
            if shown and self.bar is not None:
                self.bar.set_postfix_str("")

    def say(self, msg: str) -> None:
        if not dist.is_main():
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def eval(self, step: int, metrics: dict[str, float], samples: list[dict[str, Any]]) -> dict[str, float]:
        if self.writer:
            self.writer.log_eval_samples(step, samples)
        self.say("eval @ %d: %s" % (step, ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k.startswith("eval/"))))
        if step > 0:
            self.result.eval_after = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        self.callbacks.eval(step, metrics)
        return metrics

    def eval_before(self, metrics: dict[str, float]) -> None:
        """The evaluation of the initial policy: a ``step: 0`` row, so every eval curve starts there."""
        self.result.eval_before = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        if self.writer:
            self.writer.log_metrics(0, metrics)

    def rollouts(self, ro: "Rollouts", advantages: list[float], step: int, rank: int) -> None:
        """One row per sample: its group and its (sequence) advantage (``gae``: the first response
        token's), and its KL to the reference (null without a reference). Nothing with
        ``train.log_rollouts: false``."""
        if not self.log_rollouts:
            return
        totals: list[float | None] = ro.total_rewards().tolist()
        if ro.scorable is not None:  # null: the sample has no reward (every reward function returned None)
            totals = [t if ok else None for t, ok in zip(totals, ro.scorable.tolist())]
        kls = ((ro.logprobs - ro.ref_logprobs).mul(ro.response_mask).sum(1).tolist() if ro.ref_logprobs is not None
               else [None] * len(ro))
        recs = [{"step": step, "rank": rank, "index": i, "group": ro.group[k], "prompt": p, "output": o,
                 "reward": totals[k], "advantage": advantages[k], "kl": kls[k]}
                for k, (i, p, o) in enumerate(zip(ro.global_index, ro.prompts, ro.outputs))]
        if ro.episodes:
            recs = episode_records(recs, ro.episodes)
        gathered = dist.gather_objects(recs, dst=0)
        if self.writer and gathered:
            self.writer.log_rollouts([r for part in gathered for r in part])

    def iteration(self, step: int, m: dict[str, float]) -> bool:
        """Log iteration ``step`` and run the callbacks; True (on every rank) when one asked to stop."""
        self.result.iterations = step
        if self.writer:
            self.writer.log_metrics(step, m)
            self.result.metrics.append(m)
        self._line(step, m)
        if not self.callbacks.iteration(step, m):
            return False
        self.result.stopped_by = self.callbacks.stopped_by
        self.say(f"rallyrl: {self.callbacks.stopped_by} asked to stop: the run ends after iteration {step} of "
                 f"{self.total} (a checkpoint if checkpoint.interval is set, then final/)")
        return True

    def _line(self, step: int, m: dict[str, float]) -> None:
        if not dist.is_main():
            return
        kl = f" | kl {m['policy/kl']:.4f}" if "policy/kl" in m else ""  # no reference: no KL
        line = (f"iter {step}/{self.total} | reward {m['reward/mean']:.4f}{kl} | "
                f"loss {m['policy/total_loss']:.4f} | clipfrac {m['policy/clipfrac']:.3f} | {m['time/iteration']:.2f}s")
        extra = [f"{k}={v:.4f}" for k, v in m.items() if k.startswith("eval/")]
        if extra:
            line += " | " + " ".join(extra)
        if self.bar is not None:
            self.bar.update(1)
        self.say(line)

    def close(self) -> None:
        # The bar is closed before anything else is printed, so an error line stands on its own.
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.writer:
            self.writer.close()
            self.writer = None
