"""Peak memory and step time of the update's forward + backward with and without
``model.gradient_checkpointing`` on SmolLM2-135M (examples/sentiments' model) with long responses.

Each setting runs in its own fresh process (off / on interleaved, ``--pairs`` times): it loads the policy
(with its value head, no reference) through rallyrl's loader, then runs ``--steps`` forward + backward
passes of the policy on one micro-batch of ``--batch`` samples with a ``--prompt``-token query and a
``--response``-token response (random token ids, float32). The peak RSS comes from the kernel's own
``ru_maxrss``: after loading (printed by the child) and over the whole child (``os.wait4``); the
difference is what the update's activations and gradients added. Step time is the median over the steps
after the first.

    .venv/bin/python benchmarks/activation_checkpointing.py [--batch 4] [--response 256] [--pairs 2]
        [--out runs/bench/activation_checkpointing.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ENV, ROOT, machine  # noqa: E402


def child(args: argparse.Namespace) -> None:
    import resource

    import torch

    from examples.sentiments.prepare import smollm2_dir
    from rallyrl.config import ModelConfig
    from rallyrl.models import load_models

    torch.manual_seed(0)
    m = load_models(ModelConfig(path=str(smollm2_dir()), gradient_checkpointing=args.checkpointing), seed=0,
                    reference=False)
    loaded_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    g = torch.Generator().manual_seed(0)
    q = torch.randint(100, 20000, (args.batch, args.prompt), generator=g)
    r = torch.randint(100, 20000, (args.batch, args.response), generator=g)
    qm, rm = torch.ones_like(q, dtype=torch.bool), torch.ones_like(r, dtype=torch.bool)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        logits, values = m.policy(q, qm, r, rm)
        loss = torch.log_softmax(logits.float(), -1).amax(-1).mean() + values.mean()
        loss.backward()
        times.append(time.perf_counter() - t0)
        m.policy.zero_grad(set_to_none=False)  # gradients stay allocated, as in training
    print(json.dumps({"loaded_kb": loaded_kb, "step_s": statistics.median(times[1:]), "loss": float(loss)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--response", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/bench/activation_checkpointing.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        return child(args)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(args.pairs):
        for name in ("off", "on"):
            cmd = [sys.executable, __file__, "--child", "--batch", str(args.batch), "--prompt", str(args.prompt),
                   "--response", str(args.response), "--steps", str(args.steps), "--threads", str(args.threads)]
            proc = subprocess.Popen(cmd + (["--checkpointing"] if name == "on" else []), cwd=ROOT, env=ENV,
                                    stdout=subprocess.PIPE, text=True)
            out = proc.stdout.read()
            _, status, usage = os.wait4(proc.pid, 0)
            assert status == 0, out
            rec = json.loads(out.strip().splitlines()[-1]) | {"peak_kb": usage.ru_maxrss}
            rec["update_mib"] = (rec["peak_kb"] - rec["loaded_kb"]) / 1024
            runs[name].append(rec)
            print(name, json.dumps(rec), flush=True)
    med = {k: {f: statistics.median(r[f] for r in v) for f in ("update_mib", "step_s", "peak_kb")}
           for k, v in runs.items()}
    result = {"settings": vars(args) | {"model": "SmolLM2-135M-Instruct", "dtype": "float32"},
              "machine": machine(), "runs": runs, "median": med,
              "memory_ratio": med["on"]["update_mib"] / med["off"]["update_mib"],
              "time_ratio": med["on"]["step_s"] / med["off"]["step_s"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"update memory over the loaded model: off {med['off']['update_mib']:.0f} MiB, on "
          f"{med['on']['update_mib']:.0f} MiB (ratio {result['memory_ratio']:.2f}); step time off "
          f"{med['off']['step_s']:.2f} s, on {med['on']['step_s']:.2f} s (ratio {result['time_ratio']:.2f})")


if __name__ == "__main__":
    main()
