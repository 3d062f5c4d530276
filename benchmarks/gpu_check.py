"""The checks that need a GPU, in one command (for a lent CUDA machine; also runs on CPU with --small).

1. Short real runs through ``rallyrl.train`` on CUDA (1 process, a tiny GPT-2 built locally): PPO and GRPO,
   float32 and ``train.mixed_precision: bf16`` with ``model.gradient_checkpointing``: they finish, KL at
   step 1 is 0, the weights stay float32.
2. The update's forward + backward of a 12-layer, 768-wide GPT-2 (random weights, the local tokenizer's
   small vocabulary so activations dominate) on ``--batch`` x ``--seq`` tokens, through rallyrl's own
   loader and ``dist.shard`` (where the compute dtype is applied), for float32 / bf16 x activation
   checkpointing off / on, each in its own process: peak device memory (``torch.cuda.max_memory_allocated``)
   and median step time (CUDA events).

    python3 benchmarks/gpu_check.py [--batch 8] [--seq 1024] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def runs(out: Path, device_name: str) -> list[dict]:
    import torch
    from safetensors.torch import load_file

    import rallyrl
    from rallyrl.testing import build_tiny_gpt2
    from rallyrl.run.logs import read_jsonl

    model = build_tiny_gpt2(out / "tiny")
    rows = []
    for est in ("gae", "grpo"):
        for mp in ("no", "bf16"):
            run = out / f"{est}-{mp}"
            cfg = {"model": {"path": str(model), "gradient_checkpointing": mp == "bf16"},
                   "train": {"run_dir": str(run), "iterations": 3, "progress": False, "mixed_precision": mp},
                   "rollout": {"num_rollouts": 16, "chunk_size": 16, "samples_per_prompt": 4 if est == "grpo" else 1},
                   "generation": {"max_new_tokens": 8},
                   "ppo": {"estimator": est, "lr": 3e-3, "epochs": 2, "init_kl_coef": 0.05}}
            result = rallyrl.train(cfg, reward_fn=lambda s, p, o, **k: [float(x.count("e")) for x in o],
                                   prompts=["the cat", "a dog", "good morning", "birds sing"])
            m = read_jsonl(run / "metrics.jsonl")
            dtypes = {str(t.dtype) for t in load_file(run / "final" / "model.safetensors").values()}
            rows.append({"estimator": est, "mixed_precision": mp, "device": device_name,
                         "kl_step1": m[0]["policy/kl"], "reward": [round(x["reward/mean"], 3) for x in m],
                         "final_dtypes": sorted(dtypes), "iterations": len(result.metrics)})
            assert m[0]["policy/kl"] == 0.0 and dtypes == {"torch.float32"}, rows[-1]
    return rows


def step_child(args: argparse.Namespace) -> None:
    import torch

    from rallyrl import dist
    from rallyrl.config import ModelConfig
    from rallyrl.models import load_models

    device = dist.init_accelerator(600, "ddp", args.precision)
    m = load_models(ModelConfig(path=args.model, gradient_checkpointing=args.checkpointing), seed=0,
                    reference=False)
    m.policy.to(device)
    policy = dist.shard(m.policy, forward_methods=("generate",))
    g = torch.Generator().manual_seed(0)
    vocab = len(m.tokenizer)
    q = torch.randint(3, vocab, (args.batch, 16), generator=g).to(device)
    r = torch.randint(3, vocab, (args.batch, args.seq), generator=g).to(device)
    qm, rm = torch.ones_like(q, dtype=torch.bool), torch.ones_like(r, dtype=torch.bool)
    cuda = device.type == "cuda"
    times = []
    for i in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        logits, values = policy(q, qm, r, rm)
        loss = torch.log_softmax(logits.float(), -1).amax(-1).mean() + values.float().mean()
        loss.backward()
        if cuda:
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        policy.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
    print(json.dumps({"precision": args.precision, "checkpointing": args.checkpointing, "peak_mib": peak,
                      "step_s": statistics.median(times[1:]) if len(times) > 1 else float("nan"),
                      "loss": float(loss)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--small", action="store_true", help="tiny sizes (a CPU smoke check of this script)")
    p.add_argument("--out", default="")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="", help=argparse.SUPPRESS)
    p.add_argument("--precision", default="no", help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return step_child(args)
    import torch

    from rallyrl.testing import build_tiny_gpt2

    out = Path(args.out or tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result: dict = {"device": name, "torch": torch.__version__}
    result["runs"] = runs(out, name)
    for r in result["runs"]:
        print("run", json.dumps(r), flush=True)
    layers, width = (2, 64) if args.small else (12, 768)
    big = build_tiny_gpt2(out / "gpt2-12x768", n_layer=layers, n_embd=width, n_positions=max(1100, args.seq + 32))
    steps = []
    for precision in ("no", "bf16"):
        for ckpt in (False, True):
            cmd = [sys.executable, __file__, "--child", "--model", str(big), "--precision", precision, "--batch",
                   str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)] + (["--checkpointing"] if ckpt else [])
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            steps.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print("step", json.dumps(steps[-1]), flush=True)
    result["steps"] = steps
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2))
    print(f"| precision | checkpointing | peak memory (MiB) | step (s) |\n|---|---|---|---|")
    for s in steps:
        print(f"| {s['precision']} | {s['checkpointing']} | {s['peak_mib']:.0f} | {s['step_s']:.4f} |")


if __name__ == "__main__":
    main()
