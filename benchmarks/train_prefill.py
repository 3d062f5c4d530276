"""The forward passes over rollouts with ``model.prefill_once`` on and off, on the ``grpo_vs_trl``
arithmetic row's work: SmolLM2-135M-Instruct, 8 arithmetic problems (the example's chat prompts, 86-98
tokens) x G = 8 = 64 rows with responses of at most 10 tokens, one torch thread.

- **sharing**: how many distinct prompts the update's micro-batches hold. The update shuffles the 64
  rows into 2 minibatches of 32 (``ppo.num_minibatches: 2``, one micro-batch each in the row; also shown
  for micro-batches of 8 and 4); over ``--shuffles`` permutations drawn as the update draws them
  (``torch.randperm``), the mean distinct prompts per micro-batch and the token positions the model runs
  (padded, after the update's column trim): off, rows x (query + response width); on, distinct x (query
  width - 1) + rows x response width.
- **timing**: the scoring pass (the policy's no-grad forward over the 64 rows, as ``score_tokens`` runs
  it) and one minibatch's forward + backward (32 rows, the log-prob loss of the update, no optimizer step:
  it is the same either way), off and on alternating ``--pairs`` times on the same module after a warm-up
  of each; ratio = median of the per-pair ratios off / on (> 1: on is faster).

- **drift** (``--drift N``): how far the last bits move. ``examples/arithmetic/grpo.yaml`` (the same
  model, prompts and G, 1 process, no evaluation) trains ``N`` iterations with ``model.prefill_once`` on
  and off from the same seed; compared: the final weights (largest difference, and the L2 norm of the
  difference against that of the training's own change from the initial weights), every logged metric
  per iteration, which sampled outputs are identical, and the per-token log-probs of the last
  iteration's samples under the two final policies (and one forward on vs off).

    .venv/bin/python benchmarks/train_prefill.py [--pairs 5] [--shuffles 2000] [--out runs/bench/train_prefill.json]
    .venv/bin/python benchmarks/train_prefill.py --drift 3 [--reuse] [--out runs/bench/train_prefill_drift.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ENV, machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROBLEMS, G, MINIBATCHES, MAX_NEW = 8, 8, 2, 10


def sharing(query_len: list[int], resp_len: list[int], groups: list[int], micro: int, shuffles: int) -> dict:
    """Distinct prompts and token positions per micro-batch over ``shuffles`` update permutations."""
    import torch

    gen = torch.Generator().manual_seed(0)
    B = len(groups)
    distinct, off, on = [], 0, 0
    for _ in range(shuffles):
        for mb in torch.tensor_split(torch.randperm(B, generator=gen), MINIBATCHES):
            for a in range(0, len(mb), micro):
                rows = mb[a : a + micro].tolist()
                Q, T = max(query_len[i] for i in rows), max(resp_len[i] for i in rows)
                D = len({groups[i] for i in rows})
                distinct.append(D)
                off += len(rows) * (Q + T)
                on += (D * (Q - 1) + len(rows) * T) if D < len(rows) else len(rows) * (Q + T)
    return {"micro_batch_rows": micro, "mean_distinct_prompts": statistics.fmean(distinct),
            "rows_per_distinct_prompt": micro / statistics.fmean(distinct),
            "positions_on_over_off": on / off}


def drift(iterations: int, work: Path, reuse: bool = False) -> dict:
    """Train the arithmetic example on and off (see the module docstring) and compare the two runs
    (``reuse``: compare the runs already in ``work`` when both finished ``iterations`` iterations)."""
    import subprocess

    import torch
    from safetensors.torch import load_file

    from examples.sentiments.prepare import smollm2_dir

    runs = {}
    for on in (True, False):
        run_dir = work / f"prefill_once_{str(on).lower()}"
        if reuse and _finished(run_dir, iterations):
            runs[on] = run_dir
            continue
        sets = [f"model.path={smollm2_dir()}", f"train.run_dir={run_dir}", f"train.iterations={iterations}",
                "train.overwrite=true", "train.progress=false", "eval.interval=0", "data.eval_prompts=null",
                f"model.prefill_once={str(on).lower()}"]
        cmd = [sys.executable, "-m", "rallyrl.cli", "train", str(ROOT / "examples" / "arithmetic" / "grpo.yaml")]
        t0 = time.perf_counter()
        subprocess.run(cmd + [x for kv in sets for x in ("--set", kv)], cwd=ROOT, check=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
        print(f"drift: prefill_once={on} trained {iterations} iterations in {time.perf_counter() - t0:.0f} s", flush=True)
        runs[on] = run_dir

    def jsonl(path: Path) -> list[dict]:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]

    init = {k: v.float() for k, v in load_file(smollm2_dir() / "model.safetensors").items()}
    a, b = (load_file(runs[on] / "final" / "model.safetensors") for on in (True, False))
    keys = sorted(set(a) & set(init))
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in keys)
    moved = max((b[k].float() - init[k]).abs().max().item() for k in keys)
    l2 = sum((a[k].float() - b[k].float()).square().sum().item() for k in keys) ** 0.5
    l2_moved = sum((b[k].float() - init[k]).square().sum().item() for k in keys) ** 0.5
    ma, mb = jsonl(runs[True] / "metrics.jsonl"), jsonl(runs[False] / "metrics.jsonl")
    metrics = [{k: {"on": x[k], "off": y[k], "abs_diff": abs(x[k] - y[k])} for k in x
                if not k.startswith(("time/", "memory/")) and isinstance(x[k], (int, float)) and k in y}
               for x, y in zip(ma, mb)]
    ra, rb = jsonl(runs[True] / "rollouts.jsonl"), jsonl(runs[False] / "rollouts.jsonl")
    same = {}
    for x, y in zip(ra, rb):
        same.setdefault(x["step"], []).append(x["output"] == y["output"])
    out = {"iterations": iterations, "weights_max_abs_diff": diff, "weights_max_abs_change_off": moved,
           "weights_l2_diff": l2, "weights_l2_change_off": l2_moved, "weights_l2_ratio": l2 / l2_moved,
           "identical_outputs_per_step": {str(k): f"{sum(v)}/{len(v)}" for k, v in same.items()},
           "loss_max_abs_diff": max(m["policy/loss"]["abs_diff"] for m in metrics),
           "logprobs": logprob_drift(runs, [x for x in ra if x["step"] == iterations]),
           "metrics_per_step": metrics}
    print(f"drift: weights max |on-off| {diff:.3g} (training moved them up to {moved:.3g}); "
          f"L2 {l2:.3g} vs {l2_moved:.3g} ({l2 / l2_moved:.2g}); identical outputs {out['identical_outputs_per_step']}",
          flush=True)
    return out


def _finished(run_dir: Path, iterations: int) -> bool:
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()] \
        if (run_dir / "metrics.jsonl").exists() else []
    return (run_dir / "final" / "model.safetensors").exists() and max(steps, default=0) == iterations


def logprob_drift(runs: dict[bool, Path], samples: list[dict]) -> dict:
    """Per-token log-probs of the last iteration's samples (prompt and output re-tokenized; the same
    tokens for every forward compared): ``final_on_vs_off`` scores them with each run's final policy (the
    full forward for both): how far N iterations with the option on moved the policy's log-probs;
    ``one_forward`` scores them with the off run's final policy, ``response_outputs`` with prefill_once
    on vs off: one forward's rounding."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rallyrl.models.causal import response_outputs
    from rallyrl.rollout import pad

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(runs[False] / "final")
    q, qm = pad([tok(x["prompt"], add_special_tokens=False)["input_ids"] for x in samples], tok.pad_token_id, True)
    r, rm = pad([tok(x["output"], add_special_tokens=False)["input_ids"] or [tok.eos_token_id] for x in samples],
                tok.pad_token_id, False)

    @torch.no_grad()
    def logprobs(run: Path, on: bool) -> torch.Tensor:
        lm = AutoModelForCausalLM.from_pretrained(run / "final", dtype=torch.float32).eval()
        logits, _ = response_outputs(lm, q, qm, r, rm, False, on)
        return torch.log_softmax(logits.float(), -1).gather(-1, r.unsqueeze(-1)).squeeze(-1)[rm]

    off_full = logprobs(runs[False], False)
    res = {"samples": len(samples), "tokens": int(rm.sum()),
           "final_on_vs_off_max_abs_diff": (logprobs(runs[True], False) - off_full).abs().max().item(),
           "one_forward_max_abs_diff": (logprobs(runs[False], True) - off_full).abs().max().item()}
    print(f"drift: log-probs {res}", flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--shuffles", type=int, default=2000)
    p.add_argument("--out", default="runs/bench/train_prefill.json")
    p.add_argument("--drift", type=int, default=0, metavar="N", help="only the drift runs, N iterations each")
    p.add_argument("--reuse", action="store_true", help="--drift: compare the finished runs already in the work dir")
    args = p.parse_args()
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    if args.drift:
        res = {"settings": vars(args), "machine": machine(), "load_1min_before": os.getloadavg()[0],
               "drift": drift(args.drift, ROOT / "runs" / "bench" / "train_prefill_drift", args.reuse)}
        res["load_1min_after"] = os.getloadavg()[0]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
        return
    import torch

    from examples.sentiments.prepare import smollm2_dir
    from rallyrl import ops
    from rallyrl.config import ModelConfig
    from rallyrl.models import load_models
    from rallyrl.rollout import pad

    torch.set_num_threads(1)
    m = load_models(ModelConfig(path=str(smollm2_dir())), seed=0, value_head=False, reference=False)
    tok, policy = m.tokenizer, m.policy
    rows = [json.loads(x) for x in (ROOT / "examples" / "arithmetic" / "prompts.jsonl").read_text().splitlines()]
    # rendered as rallyrl renders conversational prompts (rallyrl/inputs.py): the template's text, then
    # tokenized without special tokens (the template wrote them)
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows[:PROBLEMS]]
    prompts = tok(texts, add_special_tokens=False)["input_ids"]
    queries = [q for q in prompts for _ in range(G)]  # a group's members are consecutive, as in a chunk
    groups = [i // G for i in range(len(queries))]
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(2, MAX_NEW + 1, (len(queries),), generator=g).tolist()
    responses = [torch.randint(100, len(tok), (n,), generator=g).tolist() for n in lens]
    q, qm = pad(queries, tok.pad_token_id, left=True)  # (64, Q)
    r, rm = pad(responses, tok.pad_token_id, left=False)  # (64, T)
    qlen = [len(x) for x in queries]
    share = [sharing(qlen, lens, groups, micro, args.shuffles) for micro in (32, 8, 4)]
    for s in share:
        print(f"micro-batches of {s['micro_batch_rows']}: {s['mean_distinct_prompts']:.2f} distinct prompts, "
              f"{s['rows_per_distinct_prompt']:.2f} rows each; positions on/off {s['positions_on_over_off']:.3f}",
              flush=True)
    mb = torch.randperm(len(queries), generator=torch.Generator().manual_seed(2))[: len(queries) // MINIBATCHES]
    mq, mqm, mr, mrm = q[mb], qm[mb], r[mb], rm[mb]
    cut = mqm.any(0).nonzero()[0, 0]  # the update's trim: columns of padding in every row
    mq, mqm = mq[:, cut:], mqm[:, cut:]

    def scoring() -> None:
        with torch.no_grad():
            logits, _ = policy(q, qm, r, rm)
            ops.logprobs_from_logits(logits.float(), r)

    def update() -> None:
        policy.zero_grad(set_to_none=True)
        logits, _ = policy(mq, mqm, mr, mrm)
        lp = ops.logprobs_from_logits(logits.float(), mr)
        (-(lp * mrm).sum() / mrm.sum()).backward()

    results = {}
    for name, fn in (("scoring", scoring), ("update_forward_backward", update)):
        times: dict[bool, list[float]] = {False: [], True: []}
        for on in (False, True):  # warm-up
            policy.prefill_once = on
            fn()
        for pair in range(args.pairs):
            for on in ((False, True) if pair % 2 == 0 else (True, False)):
                policy.prefill_once = on
                t0 = time.perf_counter()
                fn()
                times[on].append(time.perf_counter() - t0)
            print(f"{name} pair {pair}: off {times[False][-1]:.2f} s, on {times[True][-1]:.2f} s", flush=True)
        ratio = statistics.median(a / b for a, b in zip(times[False], times[True]))
        results[name] = {"off_s": times[False], "on_s": times[True], "off_median_s": statistics.median(times[False]),
                         "on_median_s": statistics.median(times[True]), "speedup": ratio}
        print(f"{name}: off {results[name]['off_median_s']:.2f} s, on {results[name]['on_median_s']:.2f} s, "
              f"speedup {ratio:.2f}x", flush=True)
    out = {"settings": vars(args) | {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "rows": len(queries),
                                     "prompt_lengths": [len(x) for x in prompts], "response_lengths": lens,
                                     "minibatch_rows": len(mb), "threads": 1},
           "machine": machine(), "load_1min": os.getloadavg()[0], "sharing": share, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
