"""Peak RSS per rank under ``model.sharding: fsdp`` on SmolLM2-135M (examples/sentiments), 2 processes:
loading straight into shards (every rank builds the model empty, rank 0 alone reads the weights and
sends each rank its shards) against the old loading (every rank loads the whole model, copies it for
the reference, then shards both), measured in the same invocation, one after the other.

Each setting is one ``rallyrl.train`` on 2 ranks (torchrun, gloo, CPU) with docs/scaling.md's settings
(fp32, ``model.reference: copy``, 2 iterations of 8 rollouts). Inside each rank, ``getrusage``'s
``ru_maxrss`` (the high-water mark of the resident set, VmHWM) is read three times:

- ``before_load``: right before ``load_models`` (Python, torch, transformers, the tokenizer, the prompts
  and the process group: the runtime without any model);
- ``loaded``: right after the models are built, sharded and filled and the optimizer exists, before
  the first generation (``trainer._build`` returned);
- ``run``: at the end of the run (the whole run's peak: it includes the full model gathered for
  generation, activations, the optimizer state and ``final/`` assembly on rank 0).

Two more settings repeat both with glibc's ``MALLOC_MMAP_THRESHOLD_=1048576`` (every
allocation of 1 MiB or more gets its own mapping, returned to the system when freed): without it the
memory FSDP frees after gathering a model for generation, and the update's gradients, stay in malloc's
heap, so the whole run's peak is mostly allocator retention, not what the run holds at any time.

The old loading is reached the way the tests reach it (``RALLYRL_TEST_FULL_LOAD``: the folder is treated
as one that cannot be read into shards). ``full_model_mib`` is the policy's LM in float32 as read from
disk (parameters, tied embeddings once): what rank 0's state dict holds while it sends the shards.

    .venv/bin/python benchmarks/fsdp_load_memory.py [--out benchmarks/results/fsdp_load_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ENV, ROOT, machine  # noqa: E402
from rallyrl.run.logs import read_jsonl  # noqa: E402

OVERRIDES = ["model.sharding=fsdp", "train.iterations=2", "rollout.num_rollouts=8", "rollout.chunk_size=4",
             "generation.max_new_tokens=8", "ppo.epochs=1", "ppo.num_minibatches=1", "data.eval_prompts=null",
             "train.progress=false"]


def _mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def worker(run_dir: str, out: str) -> None:
    """One rank: ``rallyrl.train`` with the peak RSS read before and after loading and at the end."""
    sys.path.insert(0, str(ROOT))
    import rallyrl
    from rallyrl import trainer

    rank = int(os.environ["RANK"])
    rec: dict[str, float] = {}
    if os.environ.get("RALLYRL_TEST_FULL_LOAD"):
        import rallyrl.models.loading as loading

        loading.empty_lm = lambda *args: (None, None, "RALLYRL_TEST_FULL_LOAD")
    load_models, build = trainer.load_models, trainer._build

    def timed_load(*args, **kwargs):
        rec["before_load_mib"] = _mib()
        t0 = time.perf_counter()
        m = load_models(*args, **kwargs)
        rec["load_models_s"] = time.perf_counter() - t0
        return m

    def measured_build(*args, **kwargs):
        t0 = time.perf_counter()
        built = build(*args, **kwargs)
        rec["loaded_mib"] = _mib()
        rec["build_s"] = time.perf_counter() - t0  # load_models + sharding + filling + the optimizer
        return built

    trainer.load_models, trainer._build = timed_load, measured_build
    rallyrl.train(str(ROOT / "examples" / "sentiments" / "config.yaml"),
                  overrides=[*OVERRIDES, f"train.run_dir={run_dir}"])
    rec["run_mib"] = _mib()
    Path(out, f"rank{rank}.json").write_text(json.dumps(rec))


def full_model_mib() -> float:
    from safetensors import safe_open

    from examples.sentiments.prepare import smollm2_dir

    total = 0
    with safe_open(str(smollm2_dir() / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            s = f.get_slice(k)
            n = 1
            for d in s.get_shape():
                n *= d
            total += n * 4  # float32
    return total / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/fsdp_load_memory.json")
    p.add_argument("--work", default="runs/bench/fsdp_load_memory")
    p.add_argument("--worker", nargs=2, metavar=("RUN_DIR", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(*args.worker)
    from examples.sentiments.prepare import smollm2_dir

    smollm2_dir()  # converted once, before any rank starts (cached afterwards)
    work = Path(args.work)
    runs: dict[str, dict] = {}
    mmap = {"MALLOC_MMAP_THRESHOLD_": "1048576"}
    for mode, extra in (("whole", {"RALLYRL_TEST_FULL_LOAD": "1"}), ("shards", {}),
                        ("whole_malloc_mmap_1mib", {"RALLYRL_TEST_FULL_LOAD": "1", **mmap}),
                        ("shards_malloc_mmap_1mib", mmap)):
        out = work / mode
        if out.exists():
            import shutil

            shutil.rmtree(out)
        (out / "ranks").mkdir(parents=True)
        env = {**os.environ, **ENV, **extra, "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               "--worker", str(out / "run"), str(out / "ranks")]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{mode}: exit code {proc.returncode}\n{proc.stderr[-4000:]}")
        ranks = {r: json.loads((out / "ranks" / f"rank{r}.json").read_text()) for r in range(2)}
        metrics = read_jsonl(out / "run" / "metrics.jsonl")
        runs[mode] = {"wall_s": time.perf_counter() - t0, "ranks": ranks,
                      "metrics_step1": {k: metrics[0][k] for k in ("policy/loss", "value/loss", "policy/grad_norm",
                                                                   "memory/params_bytes", "memory/optimizer_bytes")}}
        print(mode, json.dumps(runs[mode]), flush=True)
    load1 = os.getloadavg()[0]
    # shards over whole with the same allocator setting; and the allocator setting's own effect
    pairs = {"shards_over_whole": ("shards", "whole"),
             "shards_over_whole_malloc_mmap_1mib": ("shards_malloc_mmap_1mib", "whole_malloc_mmap_1mib"),
             "shards_malloc_mmap_1mib_over_shards": ("shards_malloc_mmap_1mib", "shards")}
    ratios = {f"rank{r}_{k}_{name}": runs[a]["ranks"][r][k] / runs[b]["ranks"][r][k]
              for name, (a, b) in pairs.items() for r in range(2) for k in ("loaded_mib", "run_mib")}
    result = {"settings": {"overrides": OVERRIDES, "processes": 2, "model": "SmolLM2-135M-Instruct, float32"},
              "machine": machine(), "load_average_1min_at_end": load1, "full_model_mib": full_model_mib(),
              "runs": runs, "ratios": ratios,
              # the same training whichever way the weights arrived
              "same_step1_metrics": all(runs[m]["metrics_step1"] == runs["whole"]["metrics_step1"] for m in runs)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(ratios, indent=2))


if __name__ == "__main__":
    main()
