"""The same `rallyrl.cli train` works as a worker of torchrun and of accelerate launch."""

import socket
import subprocess
import sys

import pytest

from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import ROOT, base_config, env, write_config

pytestmark = pytest.mark.dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check(run_dir, proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(run_dir / "rollouts.jsonl")
    assert {r["rank"] for r in rows} == {0, 1}  # really two processes
    assert sorted(r["index"] for r in rows if r["step"] == 1) == list(range(5))


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_launcher(launcher, tiny_model, tmp_path):
    cfg = base_config(tiny_model, tmp_path / "run", train={"iterations": 1}, rollout={"num_rollouts": 5})
    path = write_config(tmp_path / "c.yaml", cfg)
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(_free_port())]
    cmd += ["-m", "rallyrl.cli", "train", str(path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240)
    _check(tmp_path / "run", proc)
