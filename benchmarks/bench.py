"""`make bench`: every benchmark, one table, ``benchmarks/results/latest.json`` and ``benchmarks/RESULTS.md``.

    .venv-bench/bin/python benchmarks/bench.py [--quick] [--sections ppo_vs_trl,reward_phase]

Sections (see benchmarks/README.md):

- ``ppo_vs_trl``: rallyrl vs TRL's PPOTrainer on the same work, rows ``randomwalks`` and ``smollm2``
  (``benchmarks/ppo_vs_trl.py``).
- ``grpo_vs_trl``: rallyrl ``ppo.estimator: grpo`` vs TRL's GRPOTrainer on the same work, row
  ``randomwalks`` and ``arithmetic`` (``benchmarks/grpo_vs_trl.py``).
- ``reward_phase``: the central reward step against one direct batched call, ``local`` placement, the
  reward server when present, peak RSS per rank (``benchmarks/reward_phase.py``); and ``scaling``:
  world size 1, 2, 3 on the same global work.
- ``engines``: the two generation engines on the same work (``generation.engine: hf`` vs ``vllm`` float32
  and bfloat16; generation alone in tokens per CPU-second, a GRPO arithmetic iteration, a shortened
  learning curve, the engine/trainer disagreement), run from ``.venv-vllm`` (``benchmarks/engines.py``).
- ``floors``: each phase of a steady iteration (generate, score, update) against a bare-torch floor doing
  the same work, tasks ``randomwalks`` and ``smollm2`` (``benchmarks/floors.py``).

Running some sections replaces only those in the JSON report: the other sections' results (from an
earlier run, its date in ``meta.earlier_sections``) are kept.

Only ratios measured in this same invocation are claims; the absolute seconds describe this machine at
this moment (2 CPU cores shared with other people's jobs when these numbers were taken).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import ENV, BenchError, git_state, machine, versions  # noqa: E402

SECTIONS = ("ppo_vs_trl", "grpo_vs_trl", "reward_phase", "floors", "engines")
# the report keys each section writes (reward_phase also writes the scaling runs)
SECTION_KEYS = {"ppo_vs_trl": ("ppo_vs_trl",), "grpo_vs_trl": ("grpo_vs_trl",),
                "reward_phase": ("reward_phase", "scaling"), "floors": ("floors",), "engines": ("engines",)}
GOALS = {"ppo_ratio": 2.0, "overhead_ratio": 1.10, "floor_ratio": 1.10}


def _f(x: Any, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _spread(s: dict[str, float] | None, fmt: str = ".3f") -> str:
    if not s:
        return "-"
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}–{s['max']:{fmt}})"


def table(report: dict[str, Any]) -> str:
    """The one summary table (markdown) of a bench report."""
    lines = ["| benchmark | measure | rallyrl | baseline | ratio | goal |", "|---|---|---|---|---|---|"]
    add = lines.append
    for section in ("ppo_vs_trl", "grpo_vs_trl"):
        _trl_rows(section, report.get(section, {}), add)
    _reward_phase_rows(report, add)
    _floors_rows(report.get("floors"), add)
    _engines_rows(report.get("engines"), add)
    return "\n".join(lines)


def _engines_rows(en: dict[str, Any] | None, add: Any) -> None:
    """``engines``: tokens per CPU-second (vLLM vs hf), the disagreement, GRPO s/iteration, the short curve."""
    if not en:
        return
    if "error" in en:
        add(f"| engines | (failed) | {en['error'].splitlines()[0][:120]} | | | |")
        return
    gen = en.get("generate", {})
    for e in ("vllm-float32", "vllm-bfloat16"):
        if e in gen and "hf" in gen:
            add(f"| engines.generate | {e}: sampled tokens per CPU-second, 1 thread (median of repeats) | "
                f"{gen[e]['median']:.1f} | hf {gen['hf']['median']:.1f} | **{gen[e]['ratio_to_hf']:.2f}** | > 1 |")
    for r in gen.get("runs", []):
        d = r.get("disagreement")
        if d and r.get("repeat") == 1:
            add(f"| engines.disagreement | {r['engine']} vs a float32 trainer: mean / max abs log-prob difference, "
                f"share of ratios outside [0.9, 1.1]; probe mean | {d['logprob_abs_diff_mean']:.2g} / "
                f"{d['logprob_abs_diff_max']:.2g}, {d['ratio_outside_0.9_1.1']:.1%}; {r['probe']['mean']:.2g} | | | |")
    for e, r in (en.get("grpo") or {}).items():
        it = statistics.median(r["iteration_s"]) if r["iteration_s"] else float("nan")
        hf = en["grpo"].get("hf")
        ratio = statistics.median(hf["iteration_s"]) / it if hf and hf["iteration_s"] and it == it else None
        add(f"| engines.grpo | {e}: arithmetic GRPO s/iteration after the first (1 process) | {it:.1f} | "
            f"{'hf ' + format(statistics.median(hf['iteration_s']), '.1f') if hf else ''} | "
            f"{'**' + format(ratio, '.2f') + '** (hf/this)' if ratio else ''} | |")
    for e, r in (en.get("curve") or {}).items():
        add(f"| engines.curve | {e}: eval/correct by iteration (shortened run) | "
            f"{', '.join(f'{k}: {v:.2f}' for k, v in r.get('eval_correct', {}).items())} | | | |")


def _floors_rows(fl: dict[str, Any] | None, add: Any) -> None:
    """One row per task and phase: rallyrl's seconds vs the bare-torch floor's, the ratio of the medians."""
    if not fl:
        return
    if "error" in fl:
        add(f"| floors | (failed) | {fl['error'].splitlines()[0][:120]} | | | |")
        return
    for task, t in fl.items():
        if not isinstance(t, dict):
            continue
        if "error" in t:
            add(f"| floors.{task} | (failed) | {t['error'].splitlines()[0][:120]} | | | |")
            continue
        for phase, r in t["phases"].items():
            ok = "met" if r["ratio"] <= GOALS["floor_ratio"] else "NOT met"
            add(f"| floors.{task} | {phase}: s per iteration, median (min–max) of {r['pairs']} alternating pairs; "
                f"ratio = median of the pair ratios (min–max {r['pair_ratio']['min']:.2f}–{r['pair_ratio']['max']:.2f}); "
                f"ratio of the medians {r['ratio_of_medians']:.2f} | {_spread(r['rallyrl_s'])} | "
                f"bare torch {_spread(r['floor_s'])} | **{r['ratio']:.2f}** | <= {GOALS['floor_ratio']} ({ok}) |")
        add(f"| floors.{task} | 1 process, 1 torch thread; 1-min load average before / after | "
            f"{t['load_1min_start']:.1f} / {t['load_1min_end']:.1f} | | | |")


def merge_reports(old: dict[str, Any] | None, new: dict[str, Any], ran: list[str]) -> dict[str, Any]:
    """``new`` (the sections in ``ran``) plus every other section of ``old``: running one section must
    not erase the others' results. ``meta.earlier_sections`` names each kept section with the date of
    the run that measured it."""
    if not old:
        return new
    out = dict(new)
    earlier = dict(old.get("meta", {}).get("earlier_sections", {}))
    for section, keys in SECTION_KEYS.items():
        if section in ran:
            earlier.pop(section, None)
            continue
        kept = [k for k in keys if k in old]
        if kept:
            for k in kept:
                out[k] = old[k]
            earlier.setdefault(section, old.get("meta", {}).get("date", "?"))
    out["meta"] = {**new["meta"], "earlier_sections": earlier}
    return out


def _trl_rows(section: str, rows: dict[str, Any], add: Any) -> None:
    """The rows of a rallyrl-vs-TRL section (``ppo_vs_trl``: PPOTrainer; ``grpo_vs_trl``: GRPOTrainer)."""
    for row, r in rows.items():
        if "error" in r:
            add(f"| {section}.{row} | (failed) | {r['error'].splitlines()[0][:120]} | | | |")
            continue
        rl, trl = r["rallyrl1"], r["trl1"]
        ok = "met" if r["ratio"] >= GOALS["ppo_ratio"] else "NOT met"
        add(f"| {section}.{row} | episodes/s after warm-up (median of {r['repeats']} interleaved repeats) | "
            f"{rl['episodes_per_s_median']:.2f} | TRL {trl['episodes_per_s_median']:.2f} | "
            f"**{r['ratio']:.2f}** | >= {GOALS['ppo_ratio']} ({ok}) |")
        if "ratio_per_repeat_spread" in r:
            add(f"| {section}.{row} | episodes/s per run, min–max; ratio within each repeat (median, min–max) | "
                f"{_spread(rl.get('episodes_per_s_spread'), '.2f')} | TRL {_spread(trl.get('episodes_per_s_spread'), '.2f')} | "
                f"{_spread(r['ratio_per_repeat_spread'], '.2f')} | |")
        add(f"| {section}.{row} | final task score (pretrained {r['pretrained_score']:.3f}) | "
            f"{', '.join(f'{x:.3f}' for x in rl['final_score'])} | TRL {', '.join(f'{x:.3f}' for x in trl['final_score'])} | | |")
        for name, sysrow in (("rallyrl", rl), ("TRL", trl)):
            prof = sysrow.get("profile")
            if prof:
                parts = ", ".join(f"{k} {v['s']:.3f}s ({v['share']:.0%})" for k, v in prof["phases"].items())
                add(f"| {section}.{row} | {name} iteration profile (mean steady iteration {prof['iteration_s']:.3f}s) | "
                    f"{parts if name == 'rallyrl' else ''} | {parts if name == 'TRL' else ''} | | |")
        add(f"| {section}.{row} | whole process: wall s / CPU s (start-up, loading, eval included; per repeat) | "
            f"{', '.join(f'{w:.0f}/{c:.0f}' for w, c in zip(rl['process_s'], rl['cpu_s']))} | "
            f"TRL {', '.join(f'{w:.0f}/{c:.0f}' for w, c in zip(trl['process_s'], trl['cpu_s']))} | | |")


def _reward_phase_rows(report: dict[str, Any], add: Any) -> None:
    rp = report.get("reward_phase")
    if rp and "error" in rp:
        add(f"| reward_phase | (failed) | {rp['error'].splitlines()[0][:120]} | | | |")
    elif rp:
        a, b, c = rp["main"], rp["direct"], rp["local"]
        ok = "met" if rp["overhead_ratio"] <= GOALS["overhead_ratio"] else "NOT met"
        pairs = rp.get("overhead_pairs") or []
        first = " (first pair)" if len(pairs) > 1 else ""
        of_pairs = f", median of {len(pairs)} pairs" if len(pairs) > 1 else ""
        add(f"| reward_phase | (a) `main` reward step s/iteration, 2 processes (median, min–max){first} | "
            f"{_spread(a['reward_step_s'])} | (b) direct call {_spread(b['call_s_steady'])} | "
            f"**{rp['overhead_ratio']:.2f}** (a/b{of_pairs}) | <= {GOALS['overhead_ratio']} ({ok}) |")
        if len(pairs) > 1:
            add(f"| reward_phase | (a)/(b) per interleaved pair (a s, b s, ratio); the goal reads the median | "
                + "; ".join(f"{q['a_median_s']:.3f}, {q['b_median_s']:.3f}, {q['ratio']:.2f}" for q in pairs)
                + " | | | |")
        add(f"| reward_phase | (a) split: in the reward fn / gather+scatter | {_spread(a['reward_fn_s'])} / "
            f"{_spread(a['reward_gather_s'])} | | | |")
        add(f"| reward_phase | reward calls per iteration, samples per call | {a['reward_calls_per_iteration']:g}, "
            f"{a['samples_per_call']:g} | (c) `local`: {c['reward_calls_per_iteration']:g}, {c['samples_per_call']:g} | | |")
        add(f"| reward_phase | (c) `local`: reward fn s (summed over ranks) / gather | {_spread(c['reward_fn_s'])} / "
            f"{_spread(c['reward_gather_s'])} | | | |")
        srv = rp.get("server", {})
        if "status" in srv or "error" in srv:
            add(f"| reward_phase | (d) reward server, overlap off / on | "
                f"{srv.get('status') or 'error: ' + srv['error'].splitlines()[0][:100]} | | | |")
        else:
            def cell(v: dict[str, Any]) -> str:
                return (f"error: {v['error'].splitlines()[0][:80]}" if "error" in v else
                        f"reward step {_spread(v.get('reward_step_s'))}, iteration {_spread(v.get('iteration_s'))}")
            n = srv.get("rounds_per_iteration", "?")
            for overlap in ("false", "true"):
                if f"server_overlap_{overlap}" in srv:
                    add(f"| reward_phase | (d) `rallyrl serve-reward`, trainer, 2 processes, {n} rounds/iteration, "
                        f"overlap {'on' if overlap == 'true' else 'off'} (s, median, min–max) | "
                        f"{cell(srv[f'server_overlap_{overlap}'])} | | | |")
            if srv.get("ratio_overlap_to_sync") is not None:
                add(f"| reward_phase | (d) trainer, overlap on / off, s per iteration (median of the interleaved "
                    f"repeats' medians) | {_spread(srv['server_overlap_true']['iteration_s'])} | "
                    f"{_spread(srv['server_overlap_false']['iteration_s'])} | "
                    f"**{srv['ratio_overlap_to_sync']:.2f}** (overlap/sync) | < 1 |")
        rss = rp.get("rss")
        if rss:
            add(f"| reward_phase | peak RSS MiB, `main`: reward rank 0 / rank 1 (difference) | "
                f"{rss['main_rank0_mib']:.0f} / {rss['main_rank1_mib']:.0f} ({rss['main_difference_mib']:+.0f}) | "
                f"reward model weights {rss['reward_model_safetensors_mib']:.0f} MiB | | rank 1 holds none |")
            add(f"| reward_phase | peak RSS MiB, `local`: rank 0 / rank 1 | {_f(rss['local_rank0_mib'], '.0f')} / "
                f"{_f(rss['local_rank1_mib'], '.0f')} | | | |")
    for w, s in (report.get("scaling") or {}).items():
        add(f"| scaling | world size {w}: reward step s / iteration s (median, min–max) | "
            f"{_spread(s['reward_step_s'])} / {_spread(s['iteration_s'])} | | | noisy: 2 shared cores |")


def results_md(report: dict[str, Any], raw: str = "results/latest.json") -> str:
    m, meta = report["meta"]["machine"], report["meta"]
    v = meta["versions"]
    vs = ", ".join(f"{k} {v[k]}" for k in v)
    commit = meta["git"].get("commit", "")[:10]
    dirty = meta["git"].get("uncommitted_changes") or []
    return "\n".join([
        "# Benchmark results (generated by `make bench`; do not edit by hand)",
        "",
        f"- date: {meta['date']} to {meta['finished']} (wall time {meta['wall_s'] / 60:.1f} min)"
        f"{' — QUICK smoke run (`make bench QUICK=1`): few iterations, 1 repeat; ratios are indicative only' if meta['quick'] else ''}",
        f"- command: `{meta['command']}` (run by `make bench{' QUICK=1' if meta['quick'] else ''}`)",
        f"- machine: {m.get('cpus')} CPU cores ({m.get('cpu_model', '?')}), {m.get('mem_gib', '?')} GiB RAM, "
        f"{m.get('platform')}; no GPU; 1 torch thread per process",
        f"- **the machine was shared** with other engineers' jobs: 1-minute load average {meta['load_start']:.1f} "
        f"at the start, {meta['load_end']:.1f} at the end (2 cores). Absolute seconds are noisy; the ratios "
        "compare runs made back to back in this invocation, interleaved.",
        f"- versions: {vs}",
        f"- rallyrl commit {commit}{' (with uncommitted changes: ' + ', '.join(dirty) + ')' if dirty else ''}",
        "- what each number means and how it is measured: [README.md](README.md); raw data: "
        f"[{raw}]({raw})",
        *([f"- sections kept from earlier runs (not rerun by this command): "
           + ", ".join(f"{k} ({v})" for k, v in meta["earlier_sections"].items())] if meta.get("earlier_sections") else []),
        "",
        table(report),
        "",
    ])


def _run_engines(quick: bool, work: Path) -> dict[str, Any]:
    """``benchmarks/engines.py`` in .venv-vllm (its own transformers; `make install-vllm`), its JSON back."""
    python = ROOT / ".venv-vllm" / "bin" / "python"
    out = work / "engines.json"
    if not python.is_file():
        return {"error": "no .venv-vllm: run `make install-vllm` (make bench does)"}
    work.mkdir(parents=True, exist_ok=True)
    cmd = [str(python), str(ROOT / "benchmarks" / "engines.py"), "--out", str(out), "--work", str(work)]
    done = subprocess.run(cmd + (["--quick"] if quick else []), cwd=ROOT, capture_output=True, text=True)
    (work / "engines.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        return {"error": f"benchmarks/engines.py failed ({done.returncode}); see {work / 'engines.log'}:\n"
                         + done.stderr[-2000:]}
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke version: few iterations, one repeat")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    # A QUICK smoke run writes beside the full results instead of over them.
    ap.add_argument("--json", default=None, help="default benchmarks/results/latest.json (quick: quick.json)")
    ap.add_argument("--md", default=None, help="default benchmarks/RESULTS.md (quick: RESULTS-QUICK.md)")
    ap.add_argument("--work", default="runs/bench", help="run directories and logs")
    args = ap.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section(s) {bad}; sections are {list(SECTIONS)}")
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    args.json = args.json or ("benchmarks/results/quick.json" if args.quick else "benchmarks/results/latest.json")
    args.md = args.md or ("benchmarks/RESULTS-QUICK.md" if args.quick else "benchmarks/RESULTS.md")
    work = ROOT / args.work
    t0 = time.perf_counter()
    meta: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(["benchmarks/bench.py"] + (argv if argv is not None else sys.argv[1:])),
        "quick": args.quick, "machine": machine(), "versions": versions(), "git": git_state(),
        "load_start": os.getloadavg()[0], "torch_threads_per_process": 1,
    }
    report: dict[str, Any] = {"meta": meta}
    if "ppo_vs_trl" in sections:
        from benchmarks import ppo_vs_trl

        report["ppo_vs_trl"] = ppo_vs_trl.run(args.quick, list(ppo_vs_trl.ROWS), work / "ppo_vs_trl")
    if "grpo_vs_trl" in sections:
        from benchmarks import grpo_vs_trl

        report["grpo_vs_trl"] = grpo_vs_trl.run(args.quick, list(grpo_vs_trl.ROWS), work / "grpo_vs_trl")
    if "reward_phase" in sections:
        from benchmarks import reward_phase

        t1 = time.perf_counter()
        try:
            rp = reward_phase.main_run(args.quick, work / "reward_phase")
            report["scaling"] = rp.pop("scaling")
            report["reward_phase"] = rp
        except BenchError as e:
            report["reward_phase"] = {"error": str(e)[-2000:]}
            print(f"[bench] reward_phase FAILED: {e}", flush=True)
        report["reward_phase"]["wall_s"] = time.perf_counter() - t1
    if "engines" in sections:
        report["engines"] = _run_engines(args.quick, work / "engines")
    if "floors" in sections:
        from benchmarks import floors

        t1 = time.perf_counter()
        report["floors"] = floors.run(args.quick, list(floors.PAIRS), work / "floors")
        report["floors"]["wall_s"] = time.perf_counter() - t1
    meta.update(finished=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                wall_s=time.perf_counter() - t0, load_end=os.getloadavg()[0])
    js, md = ROOT / args.json, ROOT / args.md
    js.parent.mkdir(parents=True, exist_ok=True)
    report = merge_reports(json.loads(js.read_text()) if js.is_file() else None, report, sections)
    js.write_text(json.dumps(report, indent=2) + "\n")
    md.write_text(results_md(report, os.path.relpath(js, md.parent)))
    print(table(report))
    print(f"[bench] {meta['wall_s'] / 60:.1f} min; wrote {os.path.relpath(js, ROOT)} and {os.path.relpath(md, ROOT)}")
    failed = [k for k in sections if k in report and (  # this run's sections, not the ones kept from earlier
        "error" in report[k] or any(isinstance(v, dict) and "error" in v for v in report[k].values()))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
