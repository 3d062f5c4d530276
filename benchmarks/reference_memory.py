"""Peak memory of ``model.reference: copy | shared | lora`` on SmolLM2-135M (examples/sentiments).

Each reference trains in its own fresh Python process (1 process, the sentiments config with small
settings, identical for the three); a fourth process only loads the LM once (the baseline: Python,
torch, transformers and one set of weights, every one read, plus one forward). The peak RSS of each
process is the kernel's own ``ru_maxrss`` of that child, read with ``os.wait4`` when it exits: no
polling, nothing missed.

Inside each training process the models and the optimizer the trainer builds are recorded (the
benchmark wraps ``rallyrl.trainer.load_models`` and ``Learner.create``; rallyrl itself is unchanged) to
report the parameter bytes held (policy + reference, each storage counted once: the shared trunk and the
LoRA base are held once; under fsdp this rank's shards, as ``memory/params_bytes``), the trainable
parameter count, and the AdamW state bytes.

``--sharding fsdp --nproc 2``: each reference trains on 2 processes (torchrun, gloo on CPU) with
``model.sharding: fsdp``; every rank records its own bytes and its own peak RSS (``getrusage``
``ru_maxrss`` of that rank's process, read when its training ended) and the table shows rank 0's and
the largest rank's. The ``model-only`` baseline stays one process loading the whole LM.

    .venv/bin/python benchmarks/reference_memory.py [--iterations 2] [--set KEY=VALUE ...]
        [--sharding ddp|fsdp] [--nproc N] [--out runs/bench/reference_memory.json]

Prints a markdown table (docs/models.md has the 1-process one, docs/scaling.md the fsdp one) and writes
the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ENV, ROOT, git_state, machine, versions  # noqa: E402

CONFIG = ROOT / "examples" / "sentiments" / "config.yaml"
KINDS = ("model-only", "copy", "shared", "lora")


def _overrides(kind: str, run_dir: Path, iterations: int, sharding: str = "ddp") -> list[str]:
    """The same small run for the three references: 16 rollouts in one generation batch (per rank: 16
    on 1 process, 8 on 2), 10 tokens, 2 PPO epochs of 2 minibatches (the sentiments config's), no
    evaluation, no checkpoint, no final/ (saving is not what is measured)."""
    return [f"model.reference={kind}", f"model.sharding={sharding}", f"train.run_dir={run_dir}",
            f"train.iterations={iterations}", "train.overwrite=true", "train.save_final=false",
            "train.progress=false", "train.num_threads=1", "data.eval_prompts=null", "rollout.num_rollouts=16",
            "rollout.chunk_size=16"]


def _unique_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tensor shared by two modules counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _proc_status_mib(key: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak resident so far) of this process, in MiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {key}")


def child(kind: str, out: Path, iterations: int, extra: list[str], sharding: str = "ddp") -> None:
    """One measured process (or rank): train (or, for ``model-only``, just load the LM) and write what
    it held; under torchrun each rank writes ``<out>.rank<R>.json``."""
    import resource

    import torch

    torch.set_num_threads(1)
    if kind == "model-only":
        from transformers import AutoModelForCausalLM

        from rallyrl.config import load_config
        from rallyrl.inputs import prepare_model_folder

        cfg = load_config(str(CONFIG), extra)
        if cfg.model.prepare:  # the sentiments config converts SmolLM2 on first use
            prepare_model_folder(cfg.model.prepare, cfg.model.path)
        lm = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=getattr(torch, cfg.model.dtype)).eval()
        params = list(lm.parameters())
        # The weights may be memory-mapped from the safetensors file: read every one (and run a forward)
        # so that all of them are resident, as in training, instead of only the pages touched so far.
        with torch.no_grad():
            sum(float(p.sum()) for p in params)
            lm(input_ids=torch.ones(16, 16, dtype=torch.long))
        out.write_text(json.dumps({"param_bytes": _unique_bytes(params), "trainable_params": 0,
                                   "optimizer_state_bytes": 0, "reference_own_bytes": 0}))
        return

    import rallyrl
    from rallyrl import dist, trainer
    from rallyrl.learn.state import Learner

    held: dict[str, Any] = {}
    load_models, create = trainer.load_models, Learner.create

    def recording_load_models(*a, **kw):
        held["models"] = load_models(*a, **kw)
        return held["models"]

    def recording_create(*a, **kw):
        held["learner"] = create(*a, **kw)
        # Built (loaded, references made, sharded, optimizer created), before the first iteration: the
        # peak so far is the start-up's, the current RSS what the process keeps of it.
        held["rss_built"] = _proc_status_mib("VmRSS")
        held["peak_rss_built"] = _proc_status_mib("VmHWM")
        return held["learner"]

    trainer.load_models = recording_load_models
    Learner.create = staticmethod(recording_create)
    run_dir = ROOT / "runs" / "bench" / f"reference_memory_{kind}_{sharding}"
    t0 = time.perf_counter()
    result = rallyrl.train(str(CONFIG), overrides=_overrides(kind, run_dir, iterations, sharding) + extra)
    wall = time.perf_counter() - t0
    policy, reference = held["models"].policy, held["models"].reference
    opt = held["learner"].optimizer
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    # Sharded parameters are DTensors: count this rank's local shards (as memory/params_bytes does).
    nbytes = dist.local_nbytes if sharding == "fsdp" else _unique_bytes
    rank = int(os.environ.get("RANK", "0"))
    record = {
        "rank": rank,
        "param_bytes": nbytes([*policy.parameters(), *reference.parameters()]),
        "reference_own_bytes": nbytes(list(reference.parameters())),
        "trainable_params": sum(p.numel() for p in policy.parameters() if p.requires_grad),
        "optimizer_state_bytes": nbytes(state),
        "peak_rss_mib_self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
        "peak_rss_mib_at_start": held["peak_rss_built"],  # before the first iteration (start-up's peak)
        "rss_mib_at_start": held["rss_built"],
        "rss_mib_end": _proc_status_mib("VmRSS"),
        "wall_s": wall,
        "iteration_s": [m["time/iteration"] for m in result.metrics],
        "reward_mean": [m["reward/mean"] for m in result.metrics],
    }
    if sharding != "fsdp":  # (a sharded policy's numel() is its local shard's)
        record["total_params"] = sum(p.numel() for p in policy.parameters())
    target = out if "RANK" not in os.environ else out.with_name(f"{out.stem}.rank{rank}.json")
    target.write_text(json.dumps(record))


def measure(kind: str, iterations: int, tmp: Path, extra: list[str], sharding: str = "ddp",
            nproc: int = 1) -> dict[str, Any]:
    """Run ``child(kind)`` in a fresh process; its peak RSS from ``os.wait4``'s rusage (Linux: KiB). With
    ``nproc`` > 1 (never for ``model-only``) the child runs as ``nproc`` torchrun ranks, each recording
    its own peak RSS; the row holds every rank's record (``ranks``), rank 0's values at the top level
    and ``peak_rss_mib`` = the largest rank's."""
    nproc = 1 if kind == "model-only" else nproc
    out = tmp / f"{kind}_{sharding}.json"
    log = tmp / f"{kind}_{sharding}.log"
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    script = [str(Path(__file__).resolve()), "--child", kind, "--child-out", str(out), "--iterations",
              str(iterations), "--sharding", sharding, *(a for kv in extra for a in ("--set", kv))]
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
              if nproc > 1 else [sys.executable])
    with open(log, "w") as fh:
        proc = subprocess.Popen(launch + script, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise SystemExit(f"reference_memory: {kind} failed with exit code {rc}; see {log}:\n" + log.read_text()[-3000:])
    if nproc == 1:
        return {"kind": kind, "sharding": sharding, "nproc": 1, "peak_rss_mib": usage.ru_maxrss / 1024,
                **json.loads(out.read_text())}
    ranks = [json.loads(out.with_name(f"{out.stem}.rank{r}.json").read_text()) for r in range(nproc)]
    return {"kind": kind, "sharding": sharding, "nproc": nproc, **ranks[0],
            "peak_rss_mib": max(r["peak_rss_mib_self"] for r in ranks), "ranks": ranks}


def table(rows: list[dict[str, Any]]) -> str:
    if any(r.get("nproc", 1) > 1 for r in rows):
        return sharded_table(rows)
    base = next(r for r in rows if r["kind"] == "model-only")["peak_rss_mib"]
    mib = 2**20
    lines = ["| `model.reference` | peak RSS (MiB) | vs model only | parameter bytes held (MiB) | of which the reference's own (MiB) | trainable parameters | AdamW state (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['peak_rss_mib']:.0f} | {r['peak_rss_mib'] / base:.2f}x | "
                     f"{r['param_bytes'] / mib:.0f} | {r['reference_own_bytes'] / mib:.0f} | "
                     f"{r['trainable_params']:,} | {r['optimizer_state_bytes'] / mib:.0f} |")
    return "\n".join(lines)


def sharded_table(rows: list[dict[str, Any]]) -> str:
    """Per-rank bytes (rank 0's; the ranks differ by at most one shard's rounding) and peak RSS (rank 0's
    and the largest rank's), each also as a ratio to the ``copy`` row of the same run."""
    mib = 2**20
    copy = next(r for r in rows if r["kind"] == "copy")
    held = lambda r: r["param_bytes"] + r["optimizer_state_bytes"]  # noqa: E731
    lines = [f"| `model.reference` ({copy['sharding']}, {copy['nproc']} processes) | parameters per rank (MiB) | of which the "
             "reference's own (MiB) | AdamW state per rank (MiB) | parameters + AdamW vs copy | peak RSS rank 0 / "
             "largest rank (MiB) | largest peak RSS vs copy | rank 0: peak before iteration 1 / RSS at the end (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["kind"] == "model-only":
            lines.append(f"| model only (1 process, whole LM) | {r['param_bytes'] / mib:.0f} | | | | "
                         f"{r['peak_rss_mib']:.0f} | {r['peak_rss_mib'] / copy['peak_rss_mib']:.2f}x | |")
            continue
        rss0 = r["ranks"][0]["peak_rss_mib_self"]
        lines.append(f"| {r['kind']} | {r['param_bytes'] / mib:.1f} | {r['reference_own_bytes'] / mib:.1f} | "
                     f"{r['optimizer_state_bytes'] / mib:.1f} | {held(r) / held(copy):.2f}x | {rss0:.0f} / "
                     f"{r['peak_rss_mib']:.0f} | {r['peak_rss_mib'] / copy['peak_rss_mib']:.2f}x | "
                     f"{r['peak_rss_mib_at_start']:.0f} / {r['rss_mib_end']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "reference_memory.json")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a further config override for every run, e.g. model.num_layers_unfrozen=4")
    ap.add_argument("--sharding", choices=("ddp", "fsdp"), default="ddp", help="model.sharding of every run")
    ap.add_argument("--nproc", type=int, default=1, help="processes per training run (torchrun; fsdp needs 2+)")
    ap.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.child_out, a.iterations, a.set, a.sharding)
        return
    if a.sharding == "fsdp" and a.nproc < 2:
        ap.error("--sharding fsdp needs --nproc 2 or more (one process has nothing to shard: it runs as ddp)")
    if a.nproc > 1 and "copy" not in a.kinds:
        ap.error("--nproc > 1 reports ratios to the copy reference: keep copy in --kinds")
    if "model-only" not in a.kinds:
        a.kinds.insert(0, "model-only")  # the baseline of the ratios
    tmp = ROOT / "runs" / "bench" / "reference_memory_logs"  # child logs and records: not results
    tmp.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    rows = []
    for kind in a.kinds:  # one at a time: the processes must not compete for memory or cores
        rows.append(measure(kind, a.iterations, tmp, a.set, a.sharding, a.nproc))
        print(f"{kind}: peak RSS {rows[-1]['peak_rss_mib']:.0f} MiB", file=sys.stderr)
    report = {"rows": rows, "iterations": a.iterations, "sharding": a.sharding, "nproc": a.nproc,
              "overrides": _overrides("KIND", Path("RUN_DIR"), a.iterations, a.sharding) + a.set, "load_1min": [load0, os.getloadavg()[0]],
              "machine": machine(), "versions": versions(("torch", "transformers", "peft", "rallyrl")),
              "git": git_state()}
    a.out.write_text(json.dumps(report, indent=2))
    print(table(rows))
    print(f"\nload average (1 min) {load0:.1f} -> {os.getloadavg()[0]:.1f}; JSON: {a.out}")


if __name__ == "__main__":
    main()
