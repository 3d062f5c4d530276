"""Start-up time and peak memory of a run as the prompt set grows (issue #20: docs/data.md).

For each size and format, a 1-iteration ``rallyrl train --nproc 2`` on a tiny GPT-2 with N short prompts
(each with an ``answer`` metadata column); it reports

- ``wall_s``: the command's wall time (launcher start to exit);
- ``iteration_s``: ``time/iteration`` from ``metrics.jsonl``;
- ``startup_s``: ``wall_s - iteration_s``: process start, preflight, loading the prompts, the model and
  the process group, until the first iteration begins (plus the exit after it, the same at every size);
- ``rank_peak_mib``: the highest RSS of each worker process (psutil, sampled every 50 ms);
- ``launcher_peak_mib``: the same for the launcher (it runs the preflight, which opens the prompts);
- ``any_peak_mib``: ``ru_maxrss`` of the largest process of the run (exact, from the kernel).

``first`` runs with an empty datasets cache (the file is converted to Arrow), ``cached`` right after
it. ``--long-prompts error`` (issue 28) runs with ``data.long_prompts: error``, which checks the length of
every prompt at start: ``first`` then also builds the length index (cached beside the Arrow file, so the
empty cache removes it too) and ``cached`` reads it; ``--long-prompts skip error`` measures both in one
invocation, the default (skip, no start-up check) being the baseline. ``--index`` measures that start-up
check alone (open + length index, in a fresh process, no model), the figure least disturbed by a shared
machine's load. ``--code DIR`` runs another checkout of rallyrl (e.g. the one before this change: only the
formats it reads, and there is no cache then, so one phase). Run from the repository root::

    HF_DATASETS_OFFLINE=1 .venv/bin/python -m benchmarks.prompt_scale --sizes 10000 100000 1000000 \\
        --formats jsonl parquet --out benchmarks/results/prompt_scale.json

Speed and memory here are measured, never asserted in tests (DESIGN.md, style rule 11).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the cat sat on a mat and we walk in the sun while birds sing to my friend".split()


def prompt(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(4 + i % 5)) + f" {i % 1000}"


def make_file(work: Path, n: int, fmt: str) -> Path:
    path = work / f"prompts_{n}.{fmt}"
    if path.exists():
        return path
    tmp = path.with_suffix(".tmp")
    if fmt == "jsonl":
        with tmp.open("w") as f:
            for i in range(n):
                f.write(json.dumps({"prompt": prompt(i), "answer": i}) + "\n")
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"prompt": [prompt(i) for i in range(n)], "answer": list(range(n))}), tmp)
    else:
        raise SystemExit(f"unknown format {fmt}")
    tmp.rename(path)
    return path


def measure(cmd: list[str], env: dict[str, str], cwd: Path) -> dict:
    """Run ``cmd``; the peak RSS of each process in its tree (sampled) and ``ru_maxrss`` (exact). Runs in a
    fresh Python process (``--_measure``), so ``ru_maxrss`` of its children is this command's alone."""
    import psutil

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root = psutil.Process(proc.pid)
    peaks: dict[int, tuple[str, int]] = {}
    while proc.poll() is None:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            procs = []
        for p in procs:
            try:
                rss, kind = p.memory_info().rss, ("launcher" if p.pid == proc.pid else "rank")
            except psutil.Error:
                continue
            peaks[p.pid] = (kind, max(rss, peaks.get(p.pid, (kind, 0))[1]))
        time.sleep(0.05)
    out = proc.stdout.read() if proc.stdout else ""
    wall = time.perf_counter() - t0
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
    ranks = sorted((rss for kind, rss in peaks.values() if kind == "rank"), reverse=True)
    return {"rc": proc.returncode, "wall_s": wall, "any_peak_mib": ru,
            "rank_peak_mib": [r / 2**20 for r in ranks[:2]],
            "launcher_peak_mib": max((rss for kind, rss in peaks.values() if kind == "launcher"), default=0) / 2**20,
            "tail": out[-3000:] if proc.returncode else "", "out": out[-20000:]}


def interpreter(code: Path, work: Path) -> tuple[str, str]:
    """The Python and PYTHONPATH that run ``code``. This checkout: this interpreter. Another one: a bare
    venv that sees this environment's packages through PYTHONPATH, so this environment's editable
    install of rallyrl (a meta-path finder, which PYTHONPATH does not override) is not in its way."""
    if code == ROOT:
        return sys.executable, str(code)
    import sysconfig

    venv = work / "venv-plain"
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    paths = dict.fromkeys([str(code), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    return str(venv / "bin" / "python"), os.pathsep.join(paths)


def run_once(code: Path, work: Path, data: Path, label: str, long_prompts: str | None = None) -> dict:
    from rallyrl.testing import build_tiny_gpt2

    model = work / "model"
    if not (model / "config.json").exists():
        build_tiny_gpt2(model, n_layer=1, n_embd=32)
    run_dir = work / "runs" / label
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = {
        "model": {"path": str(model)},
        "data": {"prompts": str(data)},
        "train": {"run_dir": str(run_dir), "iterations": 1, "seed": 0, "progress": False, "num_threads": 1,
                  "save_final": False},
        "rollout": {"num_rollouts": 8, "chunk_size": 4},
        "generation": {"max_new_tokens": 4},
        "ppo": {"epochs": 1, "num_minibatches": 1},
        "reward": {"fn": "tests.helpers.rewards:hashed"},
    }
    if long_prompts:  # absent for another checkout that may not know the key
        cfg["data"]["long_prompts"] = long_prompts
    import yaml

    cfg_path = work / f"{label}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", HF_DATASETS_CACHE=str(work / "hf_cache"))
    python, env["PYTHONPATH"] = interpreter(code, work)
    cmd = [python, "-m", "rallyrl.cli", "train", str(cfg_path), "--nproc", "2"]
    res = json.loads(subprocess.run([sys.executable, "-m", "benchmarks.prompt_scale", "--_measure", json.dumps(
        {"cmd": cmd, "env": env, "cwd": str(code)})], cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    if res["rc"] == 0:
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        res["iteration_s"] = metrics[-1]["time/iteration"]
        res["startup_s"] = res["wall_s"] - res["iteration_s"]
        res["first_prompts"] = [json.loads(line)["prompt"] for line in
                                (run_dir / "rollouts.jsonl").read_text().splitlines()[:8]]
        res["index_s"] = _measured_s(res.get("out", ""))
    res.pop("out", None)
    return res


def _measured_s(out: str) -> float | None:
    """The length index's build time, from the run's own line ("measured the token length of N prompts
    of X in S s"); None when the run built none."""
    import re

    m = re.search(r"measured the token length of [\d,]+ prompts of \S+ in ([\d.]+) s", out)
    return float(m.group(1)) if m else None


INDEX_PROBE = """
import json, sys, time
from transformers import AutoTokenizer
from rallyrl.data import PromptLimit, PromptSet, open_prompts
tok = AutoTokenizer.from_pretrained(sys.argv[1])
t0 = time.perf_counter()
table = open_prompts(sys.argv[2])
t1 = time.perf_counter()
PromptSet.of(table, tok, 128, 4, "data.prompts", limit=PromptLimit.of(None, "error", 128, 4)).check_lengths()
print(json.dumps({"open_s": t1 - t0, "check_s": time.perf_counter() - t1}))
"""


def index_once(work: Path, data: Path) -> dict:
    """``data.long_prompts: error``'s start-up check alone, in a fresh process: opening the prompts and
    ``PromptSet.check_lengths`` (building the length index, or reading it), without the model loading and
    process start-up that make the whole-run figures noisy on a shared machine."""
    from rallyrl.testing import build_tiny_gpt2

    model = work / "model"
    if not (model / "config.json").exists():
        build_tiny_gpt2(model, n_layer=1, n_embd=32)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", HF_DATASETS_CACHE=str(work / "hf_cache"), PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", INDEX_PROBE, str(model), str(data)], env=env, capture_output=True,
                       text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    """The docs/data.md table: one line per (code, format, phase, size)."""
    out = ["| code | format | long_prompts | phase | prompts | start-up (s) | length index built (s) | "
           "peak RSS per rank (MiB) | launcher peak (MiB) | load (1 min) |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mode = r.get("long_prompts") or "default"
        head = f"| {r['code']} | {r['format']} | {mode} | {r['phase']} | {r['prompts']:,} |"
        if r["rc"]:
            out.append(f"{head} failed (rc {r['rc']}) | | | | |")
            continue
        ranks = " / ".join(f"{m:.0f}" for m in r["rank_peak_mib"])
        index = f"{r['index_s']:.1f}" if r.get("index_s") is not None else "-"
        out.append(f"{head} {r['startup_s']:.1f} | {index} | {ranks} | {r['launcher_peak_mib']:.0f} | "
                   f"{r['load_1m']:.1f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--formats", nargs="+", default=["jsonl", "parquet"])
    ap.add_argument("--phases", nargs="+", default=["first", "cached"])
    ap.add_argument("--code", type=Path, default=ROOT, help="the rallyrl checkout to run (default: this one)")
    ap.add_argument("--label", default="after")
    ap.add_argument("--long-prompts", nargs="+", default=[None], choices=["skip", "truncate_left", "error"],
                    help="data.long_prompts of the runs (default: the config's default); several: each in turn")
    ap.add_argument("--index", action="store_true",
                    help="measure only data.long_prompts: error's start-up check (open + length index), per phase")
    ap.add_argument("--work", type=Path, default=Path("/tmp/rallyrl_prompt_scale"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--table", type=Path, nargs="+", help="print the markdown table of these result files")
    ap.add_argument("--_measure", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.table:
        print(table([row for f in args.table for row in json.loads(f.read_text())]))
        return
    if args._measure:
        spec = json.loads(args._measure)
        print(json.dumps(measure(spec["cmd"], spec["env"], Path(spec["cwd"]))))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    if args.index:
        for fmt, n, phase in [(f, n, p) for f in args.formats for n in args.sizes for p in args.phases]:
            data = make_file(args.work, n, fmt)
            if phase == "first":
                shutil.rmtree(args.work / "hf_cache", ignore_errors=True)
            load = os.getloadavg()[0]
            print(json.dumps({"format": fmt, "prompts": n, "phase": phase, "load_1m": load,
                              **index_once(args.work, data)}), flush=True)
        return
    rows = []
    for fmt, n, mode, phase in [(f, n, m, p) for f in args.formats for n in args.sizes for m in args.long_prompts
                                for p in args.phases]:
        data = make_file(args.work, n, fmt)
        if phase == "first":
            shutil.rmtree(args.work / "hf_cache", ignore_errors=True)
        load = os.getloadavg()[0]
        res = run_once(args.code.resolve(), args.work, data, f"{args.label}-{fmt}-{n}-{mode}-{phase}", mode)
        row = {"code": args.label, "format": fmt, "prompts": n, "long_prompts": mode, "phase": phase,
               "load_1m": load, **res}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("first_prompts", "tail")}), flush=True)
        if res["rc"]:
            print(res["tail"], file=sys.stderr)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            old = json.loads(args.out.read_text()) if args.out.exists() else []
            args.out.write_text(json.dumps(old + [row], indent=1))


if __name__ == "__main__":
    main()
