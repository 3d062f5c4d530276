"""``train.mixed_precision: bf16`` against float32 on SmolLM2-135M (examples/sentiments' model), 1 process.

Each setting runs in its own fresh process, through rallyrl's own code (``dist.init_accelerator`` +
``dist.shard``, which is where the compute dtype is applied; the HF engine with the decoding's own
log-probs; ``rollout.score_tokens``):

1. generation of ``--batch`` samples of up to ``--new`` tokens from the sentiments prompts (seeded), with
   the log-probs the decoding computed (``rollout.logprobs_from: generate``), then the scoring forward
   of the policy and the reference over the same tokens: how far the decoding's log-probs are from the
   forward's (per token and per sequence), and the first-iteration KL (policy vs reference, exactly what
   the trainer logs as ``policy/kl`` at step 1);
2. ``--steps`` update forward + backward passes on those samples (the PPO loss with advantage 1 on every
   token, ratio 1): step time (median after the first) and peak RSS over the loaded models.

The float32 process also scores the bf16 process's samples (written to a file) so the bf16 log-probs can
be compared with float32 ones on the same tokens.

    .venv/bin/python benchmarks/mixed_precision.py [--batch 8] [--new 32] [--steps 3]
        [--out runs/bench/mixed_precision.json]
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
    from rallyrl import dist, ops
    from rallyrl.config import GenerationConfig, ModelConfig
    from rallyrl.data import load_prompts
    from rallyrl.models import load_models
    from rallyrl.rollout import Episodes, HFEngine, SamplingSpec, run_episodes, score_tokens

    torch.set_num_threads(args.threads)
    device = dist.init_accelerator(600, "ddp", args.precision)
    torch.manual_seed(0)
    m = load_models(ModelConfig(path=str(smollm2_dir())), seed=0)
    policy = dist.shard(m.policy, forward_methods=("run",))
    reference = dist.shard(m.reference, forward_methods=("logprobs",))
    loaded_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tok = m.tokenizer
    prompts = [r["prompt"] for r in load_prompts(str(ROOT / "examples" / "sentiments" / "prompts.jsonl"))][: args.batch]
    gen_cfg = GenerationConfig(max_new_tokens=args.new, temperature=1.0)
    torch.manual_seed(1)
    out: dict = {"precision": args.precision, "loaded_kb": loaded_kb}
    spec = SamplingSpec.of(gen_cfg, True, tok, logprobs=True)
    g = run_episodes(HFEngine(policy, tok, device), tok, [tok(p)["input_ids"] for p in prompts], spec)
    fwd = score_tokens(policy, reference, g, 1.0, device, from_generation=False)
    rm = g.response_mask
    d_tok = (g.logprobs - fwd.logprobs).abs()[rm]
    d_seq = (g.logprobs - fwd.logprobs).mul(rm).sum(1).abs()
    out |= {"gen_vs_forward_max_token": float(d_tok.max()), "gen_vs_forward_mean_token": float(d_tok.mean()),
            "gen_vs_forward_max_seq": float(d_seq.max()),
            "first_kl": float((fwd.logprobs - fwd.ref_logprobs).mul(rm).sum(1).mean()),
            "response_tokens": int(rm.sum())}
    if args.samples_out:
        torch.save({k: getattr(g, k) for k in ("query_ids", "query_mask", "response_ids", "response_mask")} |
                   {"logprobs": fwd.logprobs}, args.samples_out)
    if args.samples_in:  # score another precision's samples with this one
        other = torch.load(args.samples_in)
        n = other["response_ids"].shape[0]
        og = Episodes(other["query_ids"], other["query_mask"], other["response_ids"], other["response_mask"],
                      other["response_mask"], [[] for _ in range(n)], ["" for _ in range(n)])
        mine = score_tokens(policy, reference, og, 1.0, device)
        orm = other["response_mask"]
        diff = (mine.logprobs - other["logprobs"]).abs()[orm]
        out |= {"vs_other_precision_max_token": float(diff.max()), "vs_other_precision_mean_token": float(diff.mean())}
    times = []
    q, qm, r = g.query_ids, g.query_mask, g.response_ids
    for _ in range(args.steps):
        t0 = time.perf_counter()
        logits, values = policy(q, qm, r, rm)
        lp = ops.logprobs_from_logits(logits.float(), r)
        loss, _ = ops.policy_loss(lp, lp.detach(), torch.ones_like(lp), rm, 0.2)
        (loss + values.float().mul(rm).mean()).backward()
        times.append(time.perf_counter() - t0)
        policy.zero_grad(set_to_none=False)
    out["step_s"] = statistics.median(times[1:]) if len(times) > 1 else times[0]
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/bench/mixed_precision.json")
    p.add_argument("--only", choices=("bf16", "no"), help="run one setting, keeping the other from --out")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--precision", default="no", help=argparse.SUPPRESS)
    p.add_argument("--samples-out", default="", help=argparse.SUPPRESS)
    p.add_argument("--samples-in", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    tmp = Path(args.out).parent
    tmp.mkdir(parents=True, exist_ok=True)
    samples = tmp / "mixed_precision_bf16_samples.pt"
    res = json.loads(Path(args.out).read_text())["runs"] if args.only and Path(args.out).exists() else {}
    for precision, extra in (("bf16", ["--samples-out", str(samples)]), ("no", ["--samples-in", str(samples)])):
        if args.only and precision != args.only:
            continue
        cmd = [sys.executable, __file__, "--child", "--precision", precision, "--batch", str(args.batch), "--new",
               str(args.new), "--steps", str(args.steps), "--threads", str(args.threads), *extra]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
        text = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        assert status == 0, text
        rec = json.loads(text.strip().splitlines()[-1]) | {"peak_kb": usage.ru_maxrss}
        rec["update_mib"] = (rec["peak_kb"] - rec["loaded_kb"]) / 1024
        res[precision] = rec
        print(precision, json.dumps(rec), flush=True)
        Path(args.out).write_text(json.dumps({"settings": vars(args), "machine": machine(), "runs": res}, indent=2))
    if len(res) == 2:
        result = {"settings": vars(args), "machine": machine(), "runs": res,
                  "time_ratio_bf16": res["bf16"]["step_s"] / res["no"]["step_s"],
                  "update_memory_ratio_bf16": res["bf16"]["update_mib"] / res["no"]["update_mib"]}
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(json.dumps({k: v for k, v in result.items() if k.endswith("_bf16")}))


if __name__ == "__main__":
    main()
