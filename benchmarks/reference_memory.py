"""Peak memory of ``model.reference: copy | shared | lora`` on SmolLM2-135M (examples/sentiments).

Each reference trains in its own fresh Python process (1 process, the sentiments config with small
settings, identical for the three); a fourth process only loads the LM once (the baseline: Python,
torch, transformers and one set of weights, every one read, plus one forward). The peak RSS of each
process is the kernel's own ``ru_maxrss`` of that child, read with ``os.wait4`` when it exits: no
polling, nothing missed.

Inside each training process the models and the optimizer the trainer builds are recorded (the
benchmark wraps ``rallyrl.trainer.load_models`` and ``Learner.create``; rallyrl itself is unchanged) to
report the parameter bytes held (policy + reference, each storage counted once: the shared trunk and the
LoRA base are held once), the trainable parameter count, and the AdamW state bytes.

    .venv/bin/python benchmarks/reference_memory.py [--iterations 2] [--set KEY=VALUE ...]
        [--out runs/bench/reference_memory.json]

Prints a markdown table (docs/models.md has the measured one) and writes the JSON.
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


def _overrides(kind: str, run_dir: Path, iterations: int) -> list[str]:
    """The same small run for the three references: 1 process, 16 rollouts in one generation batch, 10
    tokens, 2 PPO epochs of 2 minibatches (the sentiments config's), no evaluation, no checkpoint, no
    final/ (saving is not what is measured)."""
    return [f"model.reference={kind}", f"train.run_dir={run_dir}", f"train.iterations={iterations}",
            "train.overwrite=true", "train.save_final=false", "train.progress=false", "train.num_threads=1",
            "data.eval_prompts=null", "rollout.num_rollouts=16", "rollout.chunk_size=16"]


def _unique_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tensor shared by two modules counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def child(kind: str, out: Path, iterations: int, extra: list[str]) -> None:
    """One measured process: train (or, for ``model-only``, just load the LM) and write what it held."""
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
    from rallyrl import trainer
    from rallyrl.state import Learner

    held: dict[str, Any] = {}
    load_models, create = trainer.load_models, Learner.create

    def recording_load_models(*a, **kw):
        held["models"] = load_models(*a, **kw)
        return held["models"]

    def recording_create(*a, **kw):
        held["learner"] = create(*a, **kw)
        return held["learner"]

    trainer.load_models = recording_load_models
    Learner.create = staticmethod(recording_create)
    run_dir = ROOT / "runs" / "bench" / f"reference_memory_{kind}"
    t0 = time.perf_counter()
    result = rallyrl.train(str(CONFIG), overrides=_overrides(kind, run_dir, iterations) + extra)
    wall = time.perf_counter() - t0
    policy, reference = held["models"].policy, held["models"].reference
    opt = held["learner"].optimizer
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    out.write_text(json.dumps({
        "param_bytes": _unique_bytes([*policy.parameters(), *reference.parameters()]),
        "reference_own_bytes": _unique_bytes(list(reference.parameters())),
        "trainable_params": sum(p.numel() for p in policy.parameters() if p.requires_grad),
        "total_params": sum(p.numel() for p in policy.parameters()),
        "optimizer_state_bytes": _unique_bytes(state),
        "wall_s": wall,
        "iteration_s": [m["time/iteration"] for m in result.metrics],
        "reward_mean": [m["reward/mean"] for m in result.metrics],
    }))


def measure(kind: str, iterations: int, tmp: Path, extra: list[str]) -> dict[str, Any]:
    """Run ``child(kind)`` in a fresh process; its peak RSS from ``os.wait4``'s rusage (Linux: KiB)."""
    out = tmp / f"{kind}.json"
    log = tmp / f"{kind}.log"
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--child-out", str(out),
           "--iterations", str(iterations), *(a for kv in extra for a in ("--set", kv))]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise SystemExit(f"reference_memory: {kind} failed with exit code {rc}; see {log}:\n" + log.read_text()[-3000:])
    return {"kind": kind, "peak_rss_mib": usage.ru_maxrss / 1024, **json.loads(out.read_text())}


def table(rows: list[dict[str, Any]]) -> str:
    base = next(r for r in rows if r["kind"] == "model-only")["peak_rss_mib"]
    mib = 2**20
    lines = ["| `model.reference` | peak RSS (MiB) | vs model only | parameter bytes held (MiB) | of which the reference's own (MiB) | trainable parameters | AdamW state (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['peak_rss_mib']:.0f} | {r['peak_rss_mib'] / base:.2f}x | "
                     f"{r['param_bytes'] / mib:.0f} | {r['reference_own_bytes'] / mib:.0f} | "
                     f"{r['trainable_params']:,} | {r['optimizer_state_bytes'] / mib:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "reference_memory.json")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a further config override for every run, e.g. model.num_layers_unfrozen=4")
    ap.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.child_out, a.iterations, a.set)
        return
    if "model-only" not in a.kinds:
        a.kinds.insert(0, "model-only")  # the baseline of the ratios
    tmp = a.out.parent / "reference_memory_logs"
    tmp.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    rows = []
    for kind in a.kinds:  # one at a time: the processes must not compete for memory or cores
        rows.append(measure(kind, a.iterations, tmp, a.set))
        print(f"{kind}: peak RSS {rows[-1]['peak_rss_mib']:.0f} MiB", file=sys.stderr)
    report = {"rows": rows, "iterations": a.iterations, "overrides": _overrides("KIND", Path("RUN_DIR"), a.iterations) + a.set, "load_1min": [load0, os.getloadavg()[0]],
              "machine": machine(), "versions": versions(("torch", "transformers", "peft", "rallyrl")),
              "git": git_state()}
    a.out.write_text(json.dumps(report, indent=2))
    print(table(rows))
    print(f"\nload average (1 min) {load0:.1f} -> {os.getloadavg()[0]:.1f}; JSON: {a.out}")


if __name__ == "__main__":
    main()
