"""The reward host: server throughput (batching on vs off) and reward/generation overlap, measured in one run.

    .venv/bin/python benchmarks/reward_server.py [--seconds 4] [--out runs/bench/reward_server.json]

Part 1, throughput. `rallyrl serve-reward` (a real subprocess on a loopback port) serves ``cost_reward``:
a reward that sleeps 10 ms per call + 0.1 ms per sample, the shape of a GPU reward model (a fixed
per-forward cost, a small per-sample one) without using the 2 CPU cores the clients need. 1, 2 and 4
client threads (one ``RemoteReward`` each) send requests of 16 samples back to back for ``--seconds``;
requests/s and samples/s are counted at the clients. Batching ON is the default server
(``--max-batch 256 --max-wait-ms 5``); OFF is ``--no-batching`` (one request per reward call). The
ratio on/off is the number to read.

Part 2, overlap at the reward-step level. One process, 4 chunk rounds per iteration, each round a real
sampled generation (the HF engine, rallyrl.rollout.HFEngine) on a locally built 2-layer GPT-2 (8 prompts x 24 new
tokens), the reward a server calling ``sleepy_reward`` (0.3 s per call). Synchronous: ``submit`` of a
``RewardStep`` without overlap (the step itself) after each round. Overlap: ``submit`` of an
``overlap=True`` step after each round, ``collect`` after the last. This is the reward-step loop of
``collect_rollouts`` without the logprob/value passes.

Part 3, overlap in training. ``rallyrl train --nproc 2`` on the same tiny GPT-2 with ``reward.server:
local`` serving ``sleepy_reward`` (0.3 s per call): 16 rollouts per iteration = 8 per rank in chunks of 2,
so 4 chunk rounds per iteration, 16 new tokens, ``--iterations`` iterations. Runs in the order sync,
overlap, overlap, sync (so drifting machine load hits both modes alike); seconds/iteration is
``time/iteration`` of metrics.jsonl, the first iteration of each run left out (warm-up). Ratio
overlap/sync of the medians is the number to read.

Timings on a shared machine are noisy: read ratios measured in the same run, not absolute values.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cost_reward(samples, prompts, outputs, **kwargs):
    time.sleep(0.010 + 0.0001 * len(samples))
    return [float(len(o)) for o in outputs]


def sleepy_reward(samples, prompts, outputs, **kwargs):
    time.sleep(0.3)
    return [float(len(o)) for o in outputs]


def start_server(fn: str, *args: str):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "rallyrl.cli", "serve-reward", "--fn", fn, "--port", "0", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    url = line.split(" on ", 1)[1].split(" ", 1)[0]
    import httpx

    for _ in range(400):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.05)
    raise RuntimeError("server did not start")


def throughput(url: str, clients: int, seconds: float, n: int = 16) -> dict[str, float]:
    from rallyrl.reward import RemoteReward

    prompts = [f"prompt {i} " for i in range(n)]
    outputs = [f"output {i}" for i in range(n)]
    samples = [p + o for p, o in zip(prompts, outputs)]
    ids = [[1, 2, 3]] * n
    counts = [0] * clients
    fns = [RemoteReward(url, retries=0) for _ in range(clients)]
    for fn in fns:  # connect (and warm up) before the clock starts
        fn(samples, prompts, outputs, output_token_ids=ids)
    stop = time.monotonic() + seconds

    def loop(k: int) -> None:
        while time.monotonic() < stop:
            fns[k](samples, prompts, outputs, output_token_ids=ids)
            counts[k] += 1
        fns[k].close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    req = sum(counts)
    return {"requests_per_s": req / wall, "samples_per_s": req * n / wall}


def overlap_bench(url: str, iterations: int) -> dict[str, list[float]]:
    import torch

    from rallyrl.config import GenerationConfig, ModelConfig
    from rallyrl.models import load_models
    from rallyrl.reward import NamedRewardFn, RemoteReward, RewardStep, Samples
    from rallyrl.rollout import HFEngine, SamplingSpec, run_episodes
    from rallyrl.testing import build_tiny_gpt2

    torch.set_num_threads(1)
    path = build_tiny_gpt2(ROOT / "runs" / "bench" / "tiny-gpt2")
    models = load_models(ModelConfig(path=str(path)), seed=0)  # the trainer's loader: a Policy
    tok, lm = models.tokenizer, models.policy
    gen = GenerationConfig(max_new_tokens=24)
    queries = [tok(p)["input_ids"] for p in ["the cat", "a dog", "good morning", "what a", "i like", "the sun",
                                             "we walk", "birds sing"]]
    remote = [NamedRewardFn("remote", RemoteReward(url))]
    sync_step, overlap_step = RewardStep(remote, "main"), RewardStep(remote, "main", overlap=True)
    out: dict[str, list[float]] = {"sync_s": [], "overlap_s": [], "overlap_wait_s": [], "generate_s": []}

    def one_round():
        t0 = time.perf_counter()
        g = run_episodes(HFEngine(lm, tok, torch.device("cpu")), tok, queries, SamplingSpec.of(gen, True, tok))
        out["generate_s"].append(time.perf_counter() - t0)
        return Samples([tok.decode(q) for q in queries], g.outputs, g.response_lists, [{} for _ in queries])

    for it in range(iterations):
        for mode in (("sync", "overlap") if it % 2 == 0 else ("overlap", "sync")):
            t0 = time.perf_counter()
            step = sync_step if mode == "sync" else overlap_step
            res = step.collect([step.submit(one_round()) for _ in range(4)])
            out[f"{mode}_s"].append(time.perf_counter() - t0)
            if mode == "overlap":
                out["overlap_wait_s"].append(sum(st.time_wait for _, st in res))
    overlap_step.close()
    return out


def training_bench(iterations: int) -> dict:
    """Part 3: `rallyrl train --nproc 2` with reward.server: local, without and with reward.overlap."""
    import tempfile

    import yaml

    from rallyrl.run.logs import read_jsonl
    from rallyrl.testing import build_tiny_gpt2

    model = build_tiny_gpt2(ROOT / "runs" / "bench" / "tiny-gpt2")
    prompts = ["the cat", "a dog", "good morning", "what a", "i like", "the sun", "we walk", "birds sing",
               "my friend", "the rain", "this is", "that was", "green tea", "the park", "we sing", "a day"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    out: dict = {"sync": [], "overlap": [], "runs": []}
    with tempfile.TemporaryDirectory(prefix="rallyrl-bench-overlap-") as tmp:
        for k, overlap in enumerate((False, True, True, False)):
            run_dir = Path(tmp) / f"run{k}"
            cfg = {"model": {"path": str(model)}, "data": {"prompts": prompts},
                   "train": {"run_dir": str(run_dir), "iterations": iterations, "seed": 1, "progress": False,
                             "num_threads": 1, "save_final": False},
                   "rollout": {"num_rollouts": 16, "chunk_size": 2}, "generation": {"max_new_tokens": 16},
                   "ppo": {"epochs": 1, "num_minibatches": 1},
                   "reward": {"fn": "benchmarks.reward_server:sleepy_reward", "server": "local", "overlap": overlap}}
            path = Path(tmp) / f"run{k}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            proc = subprocess.run([sys.executable, "-m", "rallyrl.cli", "train", str(path), "--nproc", "2"], cwd=ROOT,
                                  env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-3000:])
            rows = read_jsonl(run_dir / "metrics.jsonl")
            steady = [r for r in rows if r["step"] >= 2]
            mode = "overlap" if overlap else "sync"
            out[mode] += [r["time/iteration"] for r in steady]
            out["runs"].append({"overlap": overlap, "time_iteration_s": [r["time/iteration"] for r in steady],
                                "time_reward_s": [r["time/reward"] for r in steady],
                                "time_reward_wait_s": [r["time/reward_wait"] for r in steady],
                                "time_generate_s": [r["time/generate"] for r in steady],
                                "reward_calls": [r["reward/calls"] for r in steady]})
            print(f"training run {k} ({mode}): s/iteration {[round(r['time/iteration'], 2) for r in steady]}, "
                  f"reward_wait {[round(r['time/reward_wait'], 2) for r in steady]}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--training-iterations", type=int, default=5)
    p.add_argument("--out", default="runs/bench/reward_server.json")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    result: dict = {"throughput": {}, "cpu_count": os.cpu_count()}
    for mode, extra in (("batching_on", ()), ("batching_off", ("--no-batching",))):
        proc, url = start_server("benchmarks.reward_server:cost_reward", *extra)
        try:
            for clients in (1, 2, 4):
                r = throughput(url, clients, args.seconds)
                result["throughput"][f"{mode}/{clients}"] = r
                print(f"{mode:13s} clients={clients}: {r['requests_per_s']:7.1f} req/s {r['samples_per_s']:8.1f} samples/s",
                      flush=True)
        finally:
            proc.terminate()
            proc.wait()
    proc, url = start_server("benchmarks.reward_server:sleepy_reward")
    try:
        ov = overlap_bench(url, args.iterations)
    finally:
        proc.terminate()
        proc.wait()
    sync, over = statistics.median(ov["sync_s"]), statistics.median(ov["overlap_s"])
    result["overlap"] = {**ov, "median_sync_s": sync, "median_overlap_s": over, "ratio_overlap_over_sync": over / sync,
                         "median_generate_round_s": statistics.median(ov["generate_s"])}
    print(f"iteration (4 rounds, 0.3 s reward): sync {sync:.2f} s, overlap {over:.2f} s, ratio {over / sync:.2f}; "
          f"one generate round {result['overlap']['median_generate_round_s']:.3f} s; "
          f"overlap wait {statistics.median(ov['overlap_wait_s']):.2f} s")
    tr = training_bench(args.training_iterations)
    sync, over = statistics.median(tr["sync"]), statistics.median(tr["overlap"])
    result["training"] = {**tr, "median_sync_s": sync, "median_overlap_s": over, "ratio_overlap_over_sync": over / sync,
                          "load_average": os.getloadavg()}
    waits = {m: statistics.median([w for r in tr["runs"] if r["overlap"] == (m == "overlap")
                                   for w in r["time_reward_wait_s"]]) for m in ("sync", "overlap")}
    result["training"]["median_reward_wait_s"] = waits
    print(f"training, 2 processes, 4 chunk rounds, 0.3 s reward: sync {sync:.2f} s/iteration, overlap {over:.2f} "
          f"s/iteration, ratio {over / sync:.2f}; reward_wait sync {waits['sync']:.2f} s, "
          f"overlap {waits['overlap']:.2f} s")
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
