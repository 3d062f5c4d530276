"""``rallyrl``: the command line (``rallyrl train | check ...``).

A subcommand is any object (usually a module) with ``add_parser(subparsers) -> ArgumentParser`` and
``main(args) -> int``; it is registered by adding it to ``_commands()``. The subcommand is chosen before
anything else happens, so ``rallyrl --help`` and ``rallyrl <subcommand> --help`` need no config.

Every failure ends in one line on stderr and an exit code (``docs/troubleshooting.md``):

- a user error (config, data, model folder, import path, checkpoint choice, a missing or non-UTF-8 file)
  exits 2 as ``rallyrl: error: ...``;
- a runtime failure exits 1 as ``rallyrl: <ErrorType>: ...`` (a ``RewardError`` names the rank);
- Ctrl-C exits 130 without a traceback; the trainer says where it stopped. SIGTERM and SIGUSR1 (a job
  scheduler's pre-emption) let every rank finish the iteration and write a checkpoint, then exit 143
  (``checkpoint.on_signal``; without it SIGTERM stops at once, also 143);
- a second job on a run directory in use exits 2 at once, naming the holder (``run.lock.RunDirLock``).

``RALLYRL_DEBUG=1`` adds the tracebacks. ``rallyrl train CONFIG --nproc N`` checks the whole config for
N processes in this process, then starts N workers (``rallyrl.launch``); the same ``rallyrl.cli train``
also runs as a worker of ``torchrun`` or ``accelerate launch``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, NoReturn

from . import plot
from .config import ConfigError, load_config
from .errors import STOP_SIGNALS, forget_interrupts, interrupt_received, stop_requested

DEBUG_ENV = "RALLYRL_DEBUG"


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors as the same single line as every other user error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"rallyrl: error: {message} (see '{self.prog} --help')\n")


# --------------------------------------------------------------------------------------------------
# train


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="the run's YAML config file (every key: docs/config.md)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="change one config key, e.g. --set ppo.lr=3e-4 (the value is read as YAML); "
                        "repeat it for several keys")


def _train_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train", help="train a model with PPO, GRPO or RLOO (ppo.estimator), as a YAML config describes",
        description="Train a model with PPO, GRPO or RLOO (ppo.estimator), as the YAML config describes. The "
                    "whole config is checked before anything starts; Ctrl-C stops every process and says how to "
                    "resume.")
    _add_config_args(p)
    p.add_argument("--nproc", type=_positive_int, default=1, metavar="N",
                   help="how many processes to start on this machine (default 1)")
    nodes = p.add_argument_group("several machines (run the same command on each; docs/scaling.md)")
    nodes.add_argument("--nnodes", type=_positive_int, default=1, metavar="M",
                       help="how many machines the job spans (default 1); the world size is M * N")
    nodes.add_argument("--node-rank", type=int, default=0, metavar="R",
                       help="this machine's index, 0..M-1; node 0 runs global rank 0, the reward host")
    nodes.add_argument("--master-addr", default=None, metavar="HOST",
                       help="node 0's address, the same on every node (required with --nnodes > 1)")
    nodes.add_argument("--master-port", type=_positive_int, default=None, metavar="P",
                       help="a free port on node 0, the same on every node (required with --nnodes > 1)")
    return p


def _train_main(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .run.lock import holding_run_dir_locks
    from .run.rundir import RunDir

    cfg = load_config(args.config, args.overrides)  # strict: fails before anything is started
    graceful = cfg.checkpoint.on_signal
    if (args.nproc > 1 or args.nnodes > 1) and not _under_launcher():
        from .launch import Nodes, before_workers, launch

        try:
            nodes = Nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # The launcher on node 0 takes the run-dir lock (in preflight) and holds it until its workers are
        # gone; its main rank inherits the lock's descriptor, so it stays held even if the launcher dies.
        with holding_run_dir_locks() as locks:
            # every check a worker makes, for the GLOBAL world size, before any worker exists; a node other
            # than 0 skips the run-dir check: node 0 may already have started writing the shared run_dir
            with before_workers(graceful):  # a signal meanwhile: one line, not a silent death
                preflight(cfg, args.nproc * args.nnodes, quiet=True, run_dir=nodes.node_rank == 0, lock=True)
            worker_args = ["rallyrl.cli", "train", args.config]
            for o in args.overrides:
                worker_args += ["--set", o]
            return launch(worker_args, args.nproc, nodes, lock=locks[0] if locks else None, graceful=graceful)
    from . import dist
    from .errors import Preempted

    with _stop_signals(graceful), holding_run_dir_locks():
        RunDir.lock(Path(cfg.train.run_dir), cfg, create=False)  # a job already there: refused at once
        from .trainer import train  # (after the lock: it imports torch and transformers, seconds)

        try:
            train(cfg)
        except Preempted as e:  # every rank stopped after the same iteration: leave the group together
            dist.shutdown()
            if _under_launcher():
                _exit_now(e.exit_code)
            raise
        except RuntimeError as e:  # a collective that timed out: say where and what to change
            translated = dist.timeout_error(e)
            if translated is None:
                raise
            raise translated from e
    dist.shutdown()  # leave the process group together with the other ranks (see dist.shutdown)
    if _under_launcher():
        _exit_now(0)
    return 0


def _exit_now(code: int) -> NoReturn:
    """Leave a worker process without interpreter teardown. Rank 0 hosts the rendezvous store; its C++
    threads can abort teardown ("terminate called without an active exception", exit 134) after a run
    that succeeded. Everything is written and closed by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def preflight(cfg: Any, nproc: int, quiet: bool = False, run_dir: bool = True, lock: bool = False,
              dry_run: bool = False) -> Any:
    """What ``check`` and the ``--nproc N`` launcher verify before anything starts: the run's inputs for
    ``nproc`` processes (``prepare_inputs``: batch plan, prompt files, reward and metric imports, model
    folder, tokenizer) and the checkpoint that ``train.resume`` names. Returns the ``Inputs``.

    ``quiet``: the launcher's workers repeat the resume choice, so its warnings (a skipped invalid
    checkpoint) are left to them instead of printed twice. ``lock``: take the run directory's lock
    first (held until the caller's ``holding_run_dir_locks`` block ends); a folder that exists is locked
    before the inputs are read, a new one only once they passed. ``dry_run`` (``check``): nothing is
    created."""
    from pathlib import Path

    from .run.rundir import RunDir

    if run_dir and lock:
        RunDir.lock(Path(cfg.train.run_dir), cfg, create=False)  # a job already there: refused at once
    from .inputs import eval_steps, prepare_inputs  # (after the lock: it imports torch and transformers)

    inp = prepare_inputs(cfg, nproc)
    if not run_dir:
        return inp
    # may a run start in train.run_dir (or resume it, with this config)? read-only, like the rest
    RunDir.check_start(Path(cfg.train.run_dir), cfg, eval_steps(cfg) if len(inp.eval_set) else [], lock=lock,
                       dry_run=dry_run)
    if cfg.train.resume not in (None, "auto"):  # `auto` falls back to a fresh start: nothing to fail
        import contextlib
        import io
        import warnings

        from .run.checkpoint import resolve_resume

        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO() if quiet else sys.stdout):
            if quiet:
                warnings.simplefilter("ignore")
            resolve_resume(Path(cfg.train.run_dir), cfg.train.resume)
    return inp


def _under_launcher() -> bool:
    return "LOCAL_RANK" in os.environ or "RANK" in os.environ


@contextmanager
def _stop_signals(graceful: bool) -> Iterator[None]:
    """Ctrl-C (SIGINT) stops the run at once through the trainer's interrupt path (it says where to
    resume) instead of the process dying on the spot; the handler also records the signal, so one whose
    exception Python dropped still stops the loop (``errors.raise_if_interrupted``).

    SIGTERM and SIGUSR1 (a job scheduler's pre-emption, Slurm's ``--signal``): with ``graceful``
    (``checkpoint.on_signal``) they are only recorded; every rank finishes the iteration, a checkpoint is
    written and the run exits 143 (``RunDir.checkpoint``). Without it SIGTERM stops at once like Ctrl-C
    and SIGUSR1 is left alone."""
    handlers = {signal.SIGINT: interrupt_received, signal.SIGTERM: interrupt_received}
    if graceful:
        handlers.update({s: stop_requested for s in STOP_SIGNALS})
    try:
        previous = {s: signal.signal(s, h) for s, h in handlers.items()}
    except ValueError:  # not the main thread (train() called from a thread): leave signals alone
        yield
        return
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        forget_interrupts()


TRAIN = SimpleNamespace(add_parser=_train_parser, main=_train_main)


# --------------------------------------------------------------------------------------------------
# check


def _check_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "check", help="check a config without training (a dry run) and print it resolved",
        description="A dry run of 'rallyrl train': reads the config, imports the reward and metric "
                    "functions, checks the model folder (without loading the weights), loads and "
                    "tokenizes the prompts, works out the batch plan for N processes and finds the "
                    "checkpoint train.resume names. It fails with "
                    "exactly the error 'train' would give; on success it prints the resolved config "
                    "and the plan.")
    _add_config_args(p)
    p.add_argument("--nproc", type=_positive_int, default=1, metavar="N",
                   help="check the batch plan for this many processes (default 1)")
    return p


def _check_main(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    from .run.lock import holding_run_dir_locks

    with holding_run_dir_locks():  # a run in progress there is refused, as for a second `train`
        inp = preflight(cfg, args.nproc, lock=True, dry_run=True)
    from .trackers import check as check_trackers

    tracked = check_trackers(cfg, reach=True)  # W&B's mode and login, MLflow's store or server (no run started)
    plan = inp.plan
    longest = inp.train_set.longest()  # every training prompt read and checked once (a dry run may take it)
    lines = [
        f"ok: this config trains on {plan.world_size} process(es)",
        f"batch plan: {plan.num_rollouts} rollouts per iteration, "
        f"{'/'.join(map(str, plan.local_counts))} per rank, {plan.rounds} chunk round(s) of up to "
        f"{plan.chunk_size} per rank; {plan.epochs} epoch(s) x {plan.num_minibatches} minibatch(es) = "
        f"{plan.optimizer_steps_per_iteration} optimizer steps per iteration, "
        f"{plan.optimizer_steps_per_iteration * cfg.train.iterations} in {cfg.train.iterations} iterations",
        f"prompts: {len(inp.train_set)} training (longest {longest} tokens{inp.train_set.long_summary()}), "
        f"{len(inp.eval_set)} eval",
        f"reward: {', '.join(f'{f.name} (weight {f.weight:g})' for f in inp.reward_fns)}, placement "
        f"'{cfg.reward.placement}', called as {', '.join(f'{f.name}: {f.signature}' for f in inp.reward_fns)} "
        f"(reward.signature: {cfg.reward.signature}); eval metric_fn: {'yes' if inp.metric_fn else 'none'}",
        f"model: {cfg.model.path} (config and weight files present; weights not loaded), "
        f"tokenizer vocabulary {len(inp.tokenizer)}",
    ] + ([f"trackers: {'; '.join(tracked)}"] if tracked else [])
    # The resolved config is valid YAML; the report follows as YAML comments, so the output still parses.
    print(cfg.to_yaml(), end="")
    print("\n".join(f"# {line}" for line in lines))
    return 0


CHECK = SimpleNamespace(add_parser=_check_parser, main=_check_main)


def _commands() -> list[Any]:
    """Every subcommand; each has ``add_parser(subparsers)`` and ``main(args)``."""
    from . import schema
    from .reward import server as reward_server  # light: fastapi/uvicorn are imported by its main()

    return [TRAIN, CHECK, plot, reward_server, schema]


# --------------------------------------------------------------------------------------------------
# entry point and the one line per failure


def _version() -> str:
    from . import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="rallyrl",
        description="Reinforcement-learning fine-tuning of Hugging Face language models (PPO, GRPO, RLOO) "
                    "across many processes, with one central reward step.",
        epilog="Run 'rallyrl <command> --help' for a command's options. Set RALLYRL_DEBUG=1 to see "
               "tracebacks with the error messages. Errors and what to do: docs/troubleshooting.md.",
    )
    p.add_argument("--version", action="version", version=f"rallyrl {_version()}")
    sub = p.add_subparsers(dest="command", metavar="<command>", required=True, parser_class=_Parser)
    for cmd in _commands():
        cmd.add_parser(sub).set_defaults(_main=cmd.main)
    return p


def _user_errors() -> tuple[type[BaseException], ...]:
    """Error types that mean "the input needs fixing": exit 2. An error type can only have been raised
    once its module is imported, so the heavy ones (``rallyrl.models`` pulls in transformers and torch:
    seconds) are taken from ``sys.modules`` instead of imported: ``--help`` and the errors that come
    before any model work (a config error, a run directory in use) stay instant."""
    from .errors import CheckpointError, RunDirWriteError

    errors: tuple[type[BaseException], ...] = (ConfigError, CheckpointError, RunDirWriteError, FileNotFoundError,
                                               NotADirectoryError, IsADirectoryError, PermissionError)
    for module, name in (("rallyrl.data", "DataError"), ("rallyrl.models", "ModelLoadError"),
                         ("rallyrl.reward.loading", "ImportPathError")):
        mod = sys.modules.get(module)
        if mod is not None and hasattr(mod, name):
            errors += (getattr(mod, name),)
    return errors


_FIXES = {
    "CheckpointError": "resume from the newest valid checkpoint with --set train.resume=auto, or start over with "
                       "--set train.resume=auto --set train.overwrite=true (it removes only rallyrl's own files)",
    "FileNotFoundError": "check the path; relative paths are read from the working directory",
    "PermissionError": "choose a path you can write to, or change its permissions",
}


def describe(e: BaseException, user_errors: tuple[type[BaseException], ...]) -> tuple[int, str]:
    """The exit code and the one message for an exception (user errors: exit 2; others: exit 1)."""
    if isinstance(e, user_errors):
        text = str(e).strip() or type(e).__name__
        if isinstance(e, OSError) and e.filename is not None:
            text = f"{e.strerror or type(e).__name__}: {e.filename}"
        fix = None if "--set " in text else _FIXES.get(type(e).__name__)  # (a message naming its own command)
        if type(e).__name__ == "CheckpointError" and text.startswith("saving"):
            fix = "check that train.run_dir is writable and has space; the last complete checkpoint is intact"
        if fix and fix not in text:
            text += f" ({fix})"
        return 2, f"rallyrl: error: {text}"
    # A runtime failure: its first line (what failed, where, why). Tracebacks carried in the message
    # (a RewardError holds the reward function's; gloo appends C++ frames) are for RALLYRL_DEBUG=1.
    lines = str(e).strip().splitlines()
    return 1, f"rallyrl: {type(e).__name__}: {lines[0] if lines else '(no message)'}"


def _report(code: int, line: str, e: BaseException) -> None:
    """Print the line, or, in a worker of ``rallyrl train --nproc N``, hand it to the launcher, which
    prints the first failure of all ranks once."""
    if os.environ.get(DEBUG_ENV) == "1":
        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
        extra = getattr(e, "traceback_text", None)  # RewardError: the reward function's own traceback
        if extra:
            print(f"original traceback:\n{extra}", file=sys.stderr, end="")
    from .launch import REPORT_DIR_ENV, write_report

    if os.environ.get(REPORT_DIR_ENV) and _under_launcher():
        try:
            write_report(os.environ[REPORT_DIR_ENV], int(os.environ.get("RANK", "0")), code, line)
            return
        except OSError:
            pass  # the launcher's folder is gone: say it here instead
    print(line, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error (already printed as one line)
        return int(e.code or 0)
    try:
        return int(args._main(args))
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM or a pre-emption: the trainer has said where it stopped
        return int(getattr(e, "exit_code", 128 + signal.SIGINT))
    except Exception as e:
        code, line = describe(e, _user_errors())
        _report(code, line, e)
        return code


if __name__ == "__main__":
    sys.exit(main())
