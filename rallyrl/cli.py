"""``rallyrl train | check``: the command line.

``rallyrl train CONFIG --nproc N`` starts N processes through PyTorch's own launcher
(see ``rallyrl.dist.launch_command``); the same command also works when it
is itself started by ``torchrun`` or ``accelerate launch`` (it then runs as one of their workers).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from .config import ConfigError, load_config

def _user_errors() -> tuple[type[BaseException], ...]:
    from .data import DataError
    from .models import ModelLoadError
    from .reward.loading import ImportPathError

    return (ConfigError, DataError, ModelLoadError, ImportPathError)


def _under_launcher() -> bool:
    return "LOCAL_RANK" in os.environ or "RANK" in os.environ


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rallyrl", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="run PPO from a YAML config")
    t.add_argument("config", help="YAML config file")
    t.add_argument("--nproc", type=int, default=1, help="processes on this machine (default 1)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (value parsed as YAML); repeatable")
    c = sub.add_parser("check", help="validate a config and print it resolved")
    c.add_argument("config")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    from .reward import server as reward_server  # light: fastapi/uvicorn are imported by its main()
    reward_server.add_parser(sub)
    args = p.parse_args(argv)
    if args.cmd == "serve-reward":
        return reward_server.main(args)

    try:
        cfg = load_config(args.config, args.overrides)  # strict: fails before anything is started
    except _user_errors() as e:
        print(f"rallyrl: error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "check":
        print(cfg.to_yaml(), end="")
        return 0

    if args.nproc < 1:
        print("rallyrl: error: --nproc must be >= 1", file=sys.stderr)
        return 2
    if args.nproc > 1 and not _under_launcher():
        from .dist import launch_command

        cmd = launch_command(args.nproc, ["rallyrl.cli", "train", args.config])
        for o in args.overrides:
            cmd += ["--set", o]
        env = dict(os.environ)
        # Split the cores between the processes (torchrun would set 1 and print a banner about it).
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
        return subprocess.call(cmd, env=env)

    from .reward.step import RewardError
    from .trainer import train

    try:
        train(cfg)
    except _user_errors() as e:
        print(f"rallyrl: error: {e}", file=sys.stderr)
        return 2
    except RewardError as e:
        print(f"rallyrl: RewardError: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
