"""Shared pieces of the benchmarks: reading run directories, steady-state statistics, the iteration
profile, peak RSS of a process tree measured from outside, and subprocess timing.

Nothing here imports torch at module level, so the orchestrator and the unit tests stay light.

Metric names: only ``time/*``, ``reward/*`` and ``eval/*`` keys are read from ``metrics.jsonl`` (other
namespaces are being renamed, e.g. ``opt/steps`` -> ``policy/optimizer_steps``; ``first_key`` tolerates
both spellings where a benchmark needs one of them).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rallyrl.run.logs import read_jsonl  # (no torch)

ROOT = Path(__file__).resolve().parents[1]

# Every benchmark process: offline, one torch thread (2 shared cores), quiet libraries.
ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "ACCELERATE_MIXED_PRECISION": "no",
    "TRL_EXPERIMENTAL_SILENCE": "1",  # trl.experimental.ppo's import warning, once per process
}

# The phases of a rallyrl iteration, from metrics.jsonl (main rank). `reward` is the whole reward step
# as the main rank sees it: time inside reward functions plus moving samples/rewards between ranks.
PROFILE_PHASES = {
    "generate": ("time/generate",),
    "forward": ("time/forward",),
    "reward": ("time/reward", "time/reward_gather"),
    "update": ("time/update",),
}


class BenchError(RuntimeError):
    """A benchmark run failed or produced something unusable (the message says which and where)."""


# ------------------------------------------------------------------------------------------------
# Run directories


def run_rows(section: str, rows_table: dict[str, Any], plan: dict[str, dict[str, tuple[int, int]]], quick: bool,
             rows: list[str], out_dir: Path) -> dict[str, Any]:
    """Run the chosen rows of a ``*_vs_trl`` section with their (iterations, repeats) plan; a row that
    fails is reported (``"error"``) and the others still run."""
    report: dict[str, Any] = {}
    for name in rows:
        iterations, repeats = plan[name]["quick" if quick else "full"]
        t0 = time.perf_counter()
        try:
            report[name] = rows_table[name](iterations, repeats, out_dir, quick)
        except BenchError as e:
            report[name] = {"error": str(e)[-2000:]}
            print(f"[bench] {section} {name} FAILED: {e}", flush=True)
        report[name]["wall_s"] = time.perf_counter() - t0
    return report


def rows_main(ap: Any, args: Any, rows_table: dict[str, Any], run: Any) -> int:
    """The section command of a ``*_vs_trl`` script: run the ``--rows`` (unknown names are an argparse
    error), write the JSON report to ``--out`` and print each row's ratio (or error)."""
    import datetime

    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in rows_table]
    if bad:
        ap.error(f"unknown row(s) {bad}; rows are {list(rows_table)}")
    out = ROOT / args.out
    # run directories and logs (GBs for the SmolLM2 rows) under the ignored runs/bench/, wherever --out is
    report = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              **run(args.quick, rows, ROOT / "runs" / "bench" / out.stem)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({r: report[r].get("ratio", report[r].get("error")) for r in rows}, indent=2))
    return 0


def worker_main(args: Any, worker_rallyrl: Any, worker_trl: Any) -> int:
    """A benchmark worker process: run one system, rank 0 writes its result JSON to ``--result``."""
    res = worker_rallyrl(args) if args.worker == "rallyrl" else worker_trl(args)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.result).write_text(json.dumps(res, indent=2))
    return 0


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The per-iteration records of ``run_dir/metrics.jsonl`` (a clear error if there are none)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise BenchError(f"{path} does not exist: the run did not log any iteration")
    rows = [r for r in read_jsonl(path) if r.get("step", 1) >= 1]  # step 0 is the evaluation before training
    if not rows:
        raise BenchError(f"{path} is empty: the run did not log any iteration")
    return rows


def first_key(row: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The value of the first of ``names`` present in ``row`` (for metrics renamed between versions)."""
    for n in names:
        if n in row:
            return row[n]
    return default


def read_rollouts(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "rollouts.jsonl"
    if not path.is_file():
        raise BenchError(f"{path} does not exist (train.log_rollouts must be on)")
    return read_jsonl(path)  # (splits on "\n" only: older rollouts.jsonl may hold raw U+2028 inside strings)


def loop_iteration_times(metrics: Sequence[dict[str, Any]]) -> list[float]:
    """``time/iteration`` per iteration without evaluation (rallyrl evaluates inside the timer of the
    iteration that evaluates; ``time/eval`` is logged with it and subtracted here)."""
    return [float(m["time/iteration"]) - float(m.get("time/eval", 0.0)) for m in metrics]


# ------------------------------------------------------------------------------------------------
# Statistics


def steady(values: Sequence[float], warmup: int) -> list[float]:
    """``values`` without the first ``warmup`` (model loading, first-call allocations, lazy imports)."""
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if len(values) <= warmup:
        raise BenchError(f"need more than {warmup} warm-up value(s) to measure anything, got {len(values)}")
    return list(values[warmup:])


def spread(values: Sequence[float]) -> dict[str, float]:
    """min / median / max (and n) of a non-empty sample."""
    if not values:
        raise BenchError("no values to summarise")
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def episodes_per_s(iteration_s: Sequence[float], episodes_per_iteration: int, warmup: int) -> float:
    """Throughput after warm-up: episodes of the steady iterations / their summed time."""
    times = steady(iteration_s, warmup)
    total = sum(times)
    if total <= 0:
        raise BenchError(f"non-positive iteration time {total}")
    return episodes_per_iteration * len(times) / total


def profile(metrics: Sequence[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Where a rallyrl iteration's time goes, from its ``time/*`` metrics: per phase the MEAN seconds
    per steady iteration and its share of the mean loop iteration (means, not medians, so that the
    phases and ``other`` add up to the iteration); ``other`` is what the four phases do not cover
    (advantages, the statistics all-reduce, logging rollouts, Python)."""
    rows = steady(metrics, warmup)
    it = statistics.fmean(loop_iteration_times(rows))
    out: dict[str, Any] = {"iteration_s": it, "phases": {}}
    covered = 0.0
    for phase, keys in PROFILE_PHASES.items():
        mean = statistics.fmean(sum(float(r.get(k, 0.0)) for k in keys) for r in rows)
        covered += mean
        out["phases"][phase] = {"s": mean, "share": mean / it if it > 0 else 0.0}
    other = it - covered
    out["phases"]["other"] = {"s": other, "share": other / it if it > 0 else 0.0}
    return out


def median_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """median(num) / median(den)."""
    d = statistics.median(den)
    if d <= 0:
        raise BenchError(f"non-positive baseline median {d}")
    return statistics.median(num) / d


# ------------------------------------------------------------------------------------------------
# Peak RSS of a process tree, from outside (/proc; Linux)


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        # the command name (field 2) may contain spaces and parentheses: split after the last ')'
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    return kids


def descendants(pid: int) -> list[int]:
    kids = _children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def vm_hwm_kib(pid: int) -> int | None:
    """Peak resident set size (``VmHWM``, KiB) of a live process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def env_rank(pid: int) -> int | None:
    """The ``RANK`` in a process's environment (torchrun sets it in each worker), or None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"RANK="):
            try:
                return int(kv[5:])
            except ValueError:
                return None
    return None


class PeakRSSMonitor:
    """Polls the descendants of ``pid`` and keeps, per rank (the worker's ``RANK``), the last seen
    ``VmHWM``. VmHWM only grows, so the last reading before a worker exits is its peak, up to what it
    allocated in its last ``interval`` seconds (the workers' peaks come while scoring/training, long
    before they exit)."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid, self.interval = pid, interval
        self.peak_kib: dict[int, int] = {}
        self.root_kib = 0  # the process started (a 1-process run is that process; else the launcher)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "PeakRSSMonitor":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def poll(self) -> None:
        self.root_kib = max(self.root_kib, vm_hwm_kib(self.pid) or 0)
        for p in descendants(self.pid):
            rank = env_rank(p)
            hwm = vm_hwm_kib(p)
            if rank is None or hwm is None:
                continue
            # torchrun's agent also carries no RANK; a worker's own children (tokenizers threads are
            # threads, not processes) inherit it, so keep the largest per rank.
            self.peak_kib[rank] = max(self.peak_kib.get(rank, 0), hwm)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval)


def run_timed(cmd: list[str], log: Path, cwd: Path = ROOT, extra_env: dict[str, str] | None = None,
              monitor: bool = False, timeout: float | None = None) -> dict[str, Any]:
    """Run ``cmd`` (stdout+stderr to ``log``) with the benchmark environment. Returns exit code, wall
    seconds, CPU seconds of the process tree and (``monitor=True``) the per-rank peak RSS in MiB."""
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.update(extra_env or {})
    log.parent.mkdir(parents=True, exist_ok=True)
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT)
        mon = PeakRSSMonitor(proc.pid) if monitor else None
        if mon:
            mon.__enter__()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            raise BenchError(f"{' '.join(cmd[:4])} ... ran past {timeout}s; see {log}") from None
        finally:
            if mon:
                mon.__exit__()
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out: dict[str, Any] = {"rc": rc, "wall_s": wall,
                           "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)}
    if mon:
        peaks = mon.peak_kib or {0: mon.root_kib}  # no worker with a RANK: the run was this one process
        out["peak_rss_mib"] = {str(r): kib / 1024 for r, kib in sorted(peaks.items())}
    if rc != 0:
        raise BenchError(f"{' '.join(cmd[:6])} ... failed with exit code {rc}; see {log}:\n"
                         + log.read_text()[-3000:])
    return out


# ------------------------------------------------------------------------------------------------
# Environment description


def versions(pkgs: Sequence[str] = ("torch", "transformers", "accelerate", "trl", "datasets", "rallyrl",
                                    "vaderSentiment")) -> dict[str, str]:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for p in pkgs:
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = "missing"
    return out


def machine() -> dict[str, Any]:
    import platform

    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                            "load_1min": os.getloadavg()[0]}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["mem_gib"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    return info


def git_state() -> dict[str, Any]:
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    return {"commit": git("rev-parse", "HEAD"), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "uncommitted_changes": git("status", "--porcelain", "--", "rallyrl", "examples", "benchmarks").splitlines()}


# ------------------------------------------------------------------------------------------------
# TRL's PPOTrainer: the baseline set-up every ppo_vs_trl row shares (trl 1.12.0, trl.experimental.ppo)

# The phases of a TRL iteration, measured by timing wrappers around the functions its loop calls
# (``TrlPhaseClock``); the same split as rallyrl's ``PROFILE_PHASES`` plus TRL's ``gc.collect()``.
TRL_PHASES = ("generate", "forward", "reward", "update", "gc", "other")


def trl_ppo_args(*, run_dir: str | Path, episodes: int, chunk: int, iterations: int, epochs: int, minibatches: int,
                 lr: float, kl_coef: float, vf_coef: float, max_new_tokens: int, world: int = 1,
                 kl_estimator: str = "k1") -> dict[str, Any]:
    """``PPOConfig`` keyword arguments for ``episodes`` per iteration (global) on ``world`` ranks.

    What every row shares: seed 0, CPU, float32, no gradient checkpointing, constant lr, TRL's default
    optimizer (fused AdamW, as rallyrl), no weight decay, gamma 1, lam 0.95, clip 0.2 / value clip 0.2,
    sampling at temperature 1, stop at EOS, no in-loop evaluation (``num_sample_generations=0``: both
    systems' final policies are scored by the same evaluator instead). ``gradient_accumulation_steps=1``:
    each minibatch is one micro-batch and one optimizer step (TRL wraps every micro-batch in
    ``accelerator.accumulate()``, so more accumulation steps than micro-batches would skip steps)."""
    return dict(
        output_dir=str(run_dir), seed=0, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True,
        per_device_train_batch_size=episodes // world, gradient_accumulation_steps=1, num_mini_batches=minibatches,
        num_ppo_epochs=epochs, total_episodes=episodes * iterations, local_rollout_forward_batch_size=chunk,
        learning_rate=lr, lr_scheduler_type="constant", optim="adamw_torch_fused", weight_decay=0.0,
        kl_coef=kl_coef, kl_estimator=kl_estimator, gamma=1.0, lam=0.95, cliprange=0.2, cliprange_value=0.2,
        vf_coef=vf_coef, whiten_rewards=False, response_length=max_new_tokens, temperature=1.0, stop_token="eos",
        missing_eos_penalty=None, num_sample_generations=0,
    )


def same_work_mismatches(cfg: Any, trl: dict[str, Any], world: int = 1) -> list[str]:
    """Where a rallyrl ``Config`` and TRL ``PPOConfig`` kwargs would NOT do the same work (empty: same).

    The contract of ppo_vs_trl: same episodes per iteration, generation chunk, PPO epochs, minibatches
    (optimizer steps), optimizer and lr, KL penalty, GAE, clipping, value-loss weight, advantage
    whitening, response length and sampling, dtype; and nothing one system does that the other cannot
    (gradient clipping, entropy bonus, reward scaling, stop strings). The value function starts at 0 in
    both (rallyrl ``value_head_std 0``; the TRL set-up zeroes its critic's ``score``)."""
    p, g, m = cfg.ppo, cfg.generation, cfg.model
    pairs = {
        "episodes per iteration": (cfg.rollout.num_rollouts,
                                   trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"] * world),
        "generation chunk": (cfg.rollout.chunk_size, trl["local_rollout_forward_batch_size"]),
        "PPO epochs": (p.epochs, trl["num_ppo_epochs"]),
        "minibatches": (p.num_minibatches, trl["num_mini_batches"]),
        "one micro-batch per minibatch": (p.micro_batch_size, None),
        "lr": (p.lr, trl["learning_rate"]),
        "lr schedule": (p.lr_schedule, trl["lr_scheduler_type"]),
        "warm-up steps": (p.warmup_steps, 0),
        "optimizer": ("fused AdamW", {"adamw_torch_fused": "fused AdamW"}.get(trl["optim"], trl["optim"])),
        "weight decay": (p.weight_decay, trl["weight_decay"]),
        "adam eps": (p.adam_eps, trl.get("adam_epsilon", 1e-8)),
        "gradient clipping (TRL's PPO loop has none)": (p.max_grad_norm, None),
        "KL coefficient": (p.init_kl_coef, trl["kl_coef"]),
        "adaptive KL (TRL: fixed)": (p.target_kl, None),
        "KL estimator": (p.kl_estimator, trl["kl_estimator"]),
        "gamma": (p.gamma, trl["gamma"]),
        "lam": (p.lam, trl["lam"]),
        "clip range": (p.clip_range, trl["cliprange"]),
        "value clip range": (p.clip_range_value, trl["cliprange_value"]),
        "vf_coef": (p.vf_coef, trl["vf_coef"]),
        "entropy bonus (TRL: none)": (p.entropy_coef, 0.0),
        "whiten advantages (TRL: always)": (p.whiten_advantages, True),
        "reward scaling / whitening": (p.reward_scaling, "running" if trl["whiten_rewards"] else "none"),
        "reward clip": (p.reward_clip, None),
        "response length": (g.max_new_tokens, trl["response_length"]),
        "sampling": (g.do_sample, True),
        "temperature": (g.temperature, trl["temperature"]),
        "top_k (0 = off)": (g.top_k or 0, 0),
        "top_p": (g.top_p, 1.0),
        "stop strings (TRL: EOS only)": (list(g.stop_sequences), []),
        "dtype": (m.dtype, "bfloat16" if trl["bf16"] else "float32"),
        "value function starts at 0": (m.value_head_std, 0.0),
        # TRL keeps the logits of its generate() call as the old log-probs; rallyrl does the same with
        # rollout.logprobs_from=generate (a separate forward pass would be one more policy pass per chunk)
        "policy log-probs from the generation pass (TRL: always)": (cfg.rollout.logprobs_from, "generate"),
    }
    return [f"{k}: rallyrl {a!r} vs TRL {b!r}" for k, (a, b) in pairs.items() if a != b]


def check_same_work(cfg: Any, trl: dict[str, Any], world: int = 1) -> None:
    bad = same_work_mismatches(cfg, trl, world)
    if bad:
        raise BenchError("rallyrl and TRL would not do the same work: " + "; ".join(bad))


def make_text_reward_model(tokenizer: Any, score_texts: Any) -> Any:
    """A Python text reward as the ``nn.Module`` TRL's PPOTrainer wants, and nothing more.

    TRL's ``get_reward(model, query_responses, pad_token_id, context_length)`` calls
    ``getattr(model, model.base_model_prefix)(input_ids=..., attention_mask=..., ...)``, then
    ``model.score(output.hidden_states[-1])`` -> (B, L, 1), and reads each row at its last response
    token. The "backbone" decodes each row's real tokens (``attention_mask``; special tokens skipped, as
    rallyrl decodes) to text, scores the texts in one call (``score_texts(texts) -> list[float]``) and
    writes each score at every position; ``score`` is the identity. ``calls``, ``samples`` and
    ``seconds`` count the reward work.
    """
    import torch
    from torch import nn

    class _DecodeAndScore(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls, self.samples, self.seconds = 0, 0, 0.0

        def forward(self, input_ids, attention_mask, **_: Any):  # noqa: ANN001
            t0 = time.perf_counter()
            texts = [tokenizer.decode(row[m].tolist(), skip_special_tokens=True)
                     for row, m in zip(input_ids, attention_mask.bool())]
            s = torch.tensor(score_texts(texts), dtype=torch.float32, device=input_ids.device)
            hidden = s[:, None, None].expand(input_ids.shape[0], input_ids.shape[1], 1)  # (B, L, 1)
            self.calls += 1
            self.samples += len(texts)
            self.seconds += time.perf_counter() - t0
            return type("Out", (), {"hidden_states": (hidden,)})()

    class TextRewardModel(nn.Module):
        base_model_prefix = "backbone"

        def __init__(self) -> None:
            super().__init__()
            self.backbone = _DecodeAndScore()
            self.score = nn.Identity()

    return TextRewardModel()


class TrlPhaseClock:
    """Splits each TRL iteration into ``TRL_PHASES`` by wrapping, with a timer and nothing else, the
    module-level functions ``PPOTrainer.train()`` calls: ``batch_generation`` (generate), ``forward``
    (the reference pass at rollout time; inside the PPO epochs the policy+critic pass, which marks the
    start of ``update``), ``get_reward`` (the critic's rollout pass -> forward; the reward adapter ->
    reward) and ``gc.collect``. ``update`` = first policy+critic pass to the end of the iteration, less
    the ``gc.collect`` calls in it; ``other`` = the rest (advantages, statistics, logging). The work TRL
    does is unchanged; a wrapper costs microseconds per call."""

    def __init__(self, ppo_module: Any, reward_model: Any) -> None:
        self.mod, self.reward_model = ppo_module, reward_model
        self.rows: list[dict[str, float]] = []
        self._reset(time.perf_counter())
        for name in ("batch_generation", "forward", "get_reward"):
            setattr(ppo_module, name, self._wrap(name, getattr(ppo_module, name)))
        import types

        ppo_module.gc = types.SimpleNamespace(collect=self._wrap("gc", ppo_module.gc.collect))  # all TRL uses

    def _reset(self, t: float) -> None:
        self._start, self._update_start = t, None
        self._acc = dict.fromkeys(TRL_PHASES, 0.0)
        self._gc_in_update = 0.0

    def _wrap(self, name: str, fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            if name == "forward" and self._update_start is None and _is_policy_and_value(a[0] if a else None):
                self._update_start = t0
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                if name == "batch_generation":
                    self._acc["generate"] += dt
                elif name == "get_reward":
                    self._acc["reward" if (a and a[0] is self.reward_model) else "forward"] += dt
                elif name == "gc":
                    self._acc["gc"] += dt
                    if self._update_start is not None:
                        self._gc_in_update += dt
                elif self._update_start is None:  # forward() before the PPO epochs: the reference pass
                    self._acc["forward"] += dt
        return timed

    def begin(self) -> None:
        self._reset(time.perf_counter())

    def end_iteration(self) -> None:
        t = time.perf_counter()
        row = dict(self._acc, iteration_s=t - self._start)
        row["update"] = (t - self._update_start - self._gc_in_update) if self._update_start is not None else 0.0
        row["other"] = row["iteration_s"] - sum(row[k] for k in TRL_PHASES if k != "other")
        self.rows.append(row)
        self._reset(t)


def _is_policy_and_value(model: Any) -> bool:
    return type(getattr(model, "module", model)).__name__ == "PolicyAndValueWrapper"


def trl_profile(rows: Sequence[dict[str, float]], warmup: int) -> dict[str, Any]:
    """Mean seconds per steady TRL iteration and share, per phase (the layout of ``profile``)."""
    rows = steady(rows, warmup)
    it = statistics.fmean(r["iteration_s"] for r in rows)
    return {"iteration_s": it, "phases": {ph: {"s": (s := statistics.fmean(r[ph] for r in rows)),
                                               "share": s / it if it > 0 else 0.0} for ph in TRL_PHASES}}


def run_trl_ppo(ppo_kwargs: dict[str, Any], model_dir: str | Path, tokenizer: Any, train_ids: list[list[int]],
                eval_ids: list[list[int]], make_reward_model: Any, no_gc_collect: bool = False) -> dict[str, Any]:
    """Build TRL's PPOTrainer on ``model_dir`` (policy, frozen reference, and a separate critic: the
    same pretrained weights with a 1-output ``score`` head, zeroed so the first values are 0, as
    rallyrl's value head starts), train it, save the final policy on rank 0 and return the timings:
    ``iteration_s`` (between ``on_step_end`` callbacks, one per PPO batch; the first from
    ``on_train_begin``), the per-iteration phase split (``TrlPhaseClock``), optimizer steps (counted by
    a hook on the optimizer) and the reward adapter's calls. ``no_gc_collect``: diagnostic only, TRL's
    two ``gc.collect()`` calls per iteration become no-ops (the interpreter's automatic collection stays)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback, set_seed
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_module

    datasets.disable_progress_bars()
    # PPOTrainer does not seed numpy, whose global RNG orders its minibatches (np.random.permutation);
    # seed everything as a user would, so the baseline is reproducible like rallyrl (seed 0).
    set_seed(0)
    rank = int(os.environ.get("RANK", "0"))
    run_dir = Path(ppo_kwargs["output_dir"])
    t0 = time.perf_counter()
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        value.score.weight.zero_()
    reward = make_reward_model(tokenizer)
    if no_gc_collect:
        import types

        ppo_module.gc = types.SimpleNamespace(collect=lambda *a, **k: 0)
    clock = TrlPhaseClock(ppo_module, reward)

    def ds(ids: list[list[int]]) -> Any:
        return datasets.Dataset.from_dict({"input_ids": ids})

    trainer = PPOTrainer(args=PPOConfig(**ppo_kwargs), processing_class=tokenizer, model=policy, ref_model=ref,
                         reward_model=reward, value_model=value, train_dataset=ds(train_ids), eval_dataset=ds(eval_ids))
    steps = [0]
    trainer.optimizer.optimizer.register_step_post_hook(lambda *a, **k: steps.__setitem__(0, steps[0] + 1))
    marks: list[float] = []

    class _Clock(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            marks.append(time.perf_counter())
            clock.begin()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            marks.append(time.perf_counter())
            clock.end_iteration()

    trainer.add_callback(_Clock())
    t1 = time.perf_counter()
    if os.environ.get("BENCH_PROFILE"):  # diagnostic: where TRL's loop spends its time, per rank
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.runcall(trainer.train)
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / f"profile_rank{rank}.txt").write_text(buf.getvalue())
    else:
        trainer.train()
    t2 = time.perf_counter()
    final = run_dir / "final"
    out = {"iterations": len(marks) - 1, "optimizer_steps": steps[0], "ppo_loop_s": t2 - t1, "setup_s": t1 - t0,
           "train_call_s": t2 - t0, "iteration_s": [b - a for a, b in zip(marks, marks[1:])],
           "phases_per_iteration": clock.rows, "reward_calls": reward.backbone.calls,
           "reward_samples": reward.backbone.samples, "reward_s": reward.backbone.seconds,
           "world_size": trainer.accelerator.num_processes, "mixed_precision": str(trainer.accelerator.mixed_precision),
           "optimizer": type(trainer.optimizer.optimizer).__name__,
           "optimizer_fused": bool(trainer.optimizer.optimizer.defaults.get("fused")),
           "torch_threads": torch.get_num_threads(), "final_dir": str(final)}
    if rank == 0:
        trainer.policy_model.save_pretrained(final, safe_serialization=True)
        tokenizer.save_pretrained(final)
    trainer.accelerator.wait_for_everyone()
    return out
