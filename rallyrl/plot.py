"""``rallyrl plot RUN_DIR [RUN_DIR ...] [--out DIR]``: PNG curves from run directories.

Reads only what the run-directory contract promises (``metrics.jsonl``: one JSON object per row with
``step`` plus metrics; ``config.yaml``), never trainer internals, so it works on a finished run, on a
run that is still going and on a copy of a run dir from another machine. Rows that share a ``step``
are merged (a later value wins), so an evaluation logged in its own row joins its iteration. Values
that are missing, ``null``, or not finite (written as text such as ``"nan"``) are skipped point by
point.

Files written (one figure each; several run dirs share every figure, the legend names each by its
folder name):

- ``reward.png``: ``reward/mean`` with a ``± reward/std`` band.
- ``kl.png``: ``policy/kl`` and ``policy/kl_coef`` (not written when no run computed a KL: a run without
  a reference model, ``ppo.init_kl_coef: 0``, has none).
- ``eval.png``: every ``eval/*`` metric (only rows that have it; not written when no run has any).
- ``losses.png``: ``policy/loss`` and ``value/loss``.
- ``episodes.png``: multi-turn runs only: ``episode/turns``, ``episode/tool_calls`` with
  ``episode/tool_errors``, ``episode/truncated`` and ``episode/env_token_fraction`` per iteration.
- ``time.png``: per iteration, stacked seconds of each stage (``time/generate``, ``time/forward``,
  ``time/reward``, ``time/reward_gather``, ``time/update``, ``time/eval``; a missing key counts 0;
  ``other`` = the rest of ``time/iteration``), one panel per run.

matplotlib (the ``plot`` extra) is imported only when plotting, with no GUI backend.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .run.logs import JsonlError, iter_jsonl

TIME_STAGES = ("time/generate", "time/forward", "time/reward", "time/reward_gather", "time/update", "time/eval")

__all__ = ["PlotError", "Run", "load_run", "series", "plot_runs", "add_parser", "main", "TIME_STAGES"]


class PlotError(ValueError):
    """A run directory cannot be plotted (not a run dir, no or malformed metrics)."""


@dataclass
class Run:
    name: str  # legend label: the run dir's folder name
    path: Path
    rows: list[dict[str, Any]]  # one merged row per step, sorted by step


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None  # null, "nan"/"inf" text, or anything else that is not a number
    v = float(v)
    return v if math.isfinite(v) else None


def load_run(run_dir: str | Path) -> Run:
    """Read ``RUN_DIR/metrics.jsonl`` into one row per step; clear errors for what cannot be plotted."""
    path = Path(run_dir)
    if not path.is_dir():
        raise PlotError(f"{path}: no such directory")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        if (path / "config.yaml").is_file():
            raise PlotError(f"{path}: no metrics.jsonl yet (the run has not logged an iteration)")
        raise PlotError(f"{path} is not a run directory (it has neither metrics.jsonl nor config.yaml)")
    by_step: dict[int, dict[str, Any]] = {}
    try:  # a live or killed run's last line may be half-written: not a row yet
        rows = list(iter_jsonl(metrics, complete_only=True))
    except JsonlError as e:
        raise PlotError(str(e)) from None
    for lineno, row in rows:
        if not isinstance(row, dict):
            raise PlotError(f"{metrics}:{lineno} is not a JSON object")
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise PlotError(f"{metrics}:{lineno} has no integer 'step' (got {step!r})")
        by_step.setdefault(step, {}).update(row)
    if not by_step:
        raise PlotError(f"{metrics} is empty: nothing to plot")
    name = path.resolve().name or str(path)
    return Run(name=name, path=path, rows=[by_step[s] for s in sorted(by_step)])


def series(run: Run, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the run, skipping rows where it is missing or not finite."""
    steps, values = [], []
    for row in run.rows:
        v = _finite(row.get(key))
        if v is not None:
            steps.append(row["step"])
            values.append(v)
    return steps, values


def _unique_names(runs: list[Run]) -> None:
    """Legend labels are folder names; two runs in same-named folders get their parent added."""
    seen: dict[str, int] = {}
    for r in runs:
        seen[r.name] = seen.get(r.name, 0) + 1
    for r in runs:
        if seen[r.name] > 1:
            r.name = f"{r.path.resolve().parent.name}/{r.name}"


def _new_figure(nrows: int, ncols: int, width: float = 6.4, height: float = 3.6, **subplots_kw: Any):
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained", dpi=110)
    axes = fig.subplots(nrows, ncols, squeeze=False, **subplots_kw)
    return fig, [ax for row in axes for ax in row]


def _style(ax, title: str, ylabel: str = "", xlabel: str = "iteration") -> None:
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    lo, hi = ax.get_xlim()
    if hi - lo < 2:  # a single iteration (e.g. one eval row): whole-number ticks around it
        mid = round((lo + hi) / 2)
        ax.set_xlim(mid - 1, mid + 1)


def _legend(ax, runs: list[Run]) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")
    elif runs:
        ax.text(0.5, 0.5, "no finite values", ha="center", va="center", transform=ax.transAxes, color="gray")


def _line_panel(ax, runs: list[Run], key: str, marker: str = "") -> None:
    for i, run in enumerate(runs):
        xs, ys = series(run, key)
        if xs:
            ax.plot(xs, ys, marker=marker or ("o" if len(xs) <= 30 else ""), markersize=4,
                    color=f"C{i}", label=run.name)
    _legend(ax, runs)


def _reward_figure(runs: list[Run]):
    fig, (ax,) = _new_figure(1, 1, width=7.5, height=4.2)
    for i, run in enumerate(runs):
        xs, ys = series(run, "reward/mean")
        if not xs:
            continue
        ax.plot(xs, ys, marker="o" if len(xs) <= 30 else "", markersize=4, color=f"C{i}", label=run.name)
        band = [(row["step"], m, s) for row in run.rows
                if (m := _finite(row.get("reward/mean"))) is not None
                and (s := _finite(row.get("reward/std"))) is not None]
        if band:
            bx = [b[0] for b in band]
            ax.fill_between(bx, [b[1] - b[2] for b in band], [b[1] + b[2] for b in band],
                            color=f"C{i}", alpha=0.18, linewidth=0)
    _style(ax, "reward/mean (band: ± reward/std over the iteration's samples)", "reward")
    _legend(ax, runs)
    return fig


def _kl_figure(runs: list[Run]):
    if not any(series(run, "policy/kl")[0] for run in runs):
        return None  # no reference model: no KL, and the coefficient is a flat 0 (an empty figure says nothing)
    fig, axes = _new_figure(1, 2)
    _line_panel(axes[0], runs, "policy/kl")
    _style(axes[0], "policy/kl (per sequence, to the reference)", "KL (nats)")
    _line_panel(axes[1], runs, "policy/kl_coef")
    _style(axes[1], "policy/kl_coef (beta)", "coefficient")
    return fig


def _eval_figure(runs: list[Run]):
    keys = sorted({k for run in runs for row in run.rows for k in row
                   if k.startswith("eval/") and _finite(row[k]) is not None})
    if not keys:
        return None
    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig, axes = _new_figure(nrows, ncols, width=5.2, height=3.6)
    for ax, key in zip(axes, keys):
        _line_panel(ax, runs, key, marker="o")  # eval rows are sparse: always mark the points
        _style(ax, key)
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    return fig


EPISODE_PANELS = (("episode/turns", "assistant turns per episode"),
                  ("episode/tool_calls", "tool calls per episode (dashed: tool errors)"),
                  ("episode/truncated", "fraction of episodes truncated"),
                  ("episode/env_token_fraction", "environment tokens / response tokens"))


def _episode_figure(runs: list[Run]):
    """Turns and tool use of multi-turn runs (None when no run has ``episode/*`` metrics)."""
    if not any(k.startswith("episode/") for run in runs for row in run.rows for k in row):
        return None
    fig, axes = _new_figure(2, 2, width=5.6, height=3.4)
    for ax, (key, title) in zip(axes, EPISODE_PANELS):
        _line_panel(ax, runs, key)
        if key == "episode/tool_calls":
            for i, run in enumerate(runs):
                xs, ys = series(run, "episode/tool_errors")
                if xs:
                    ax.plot(xs, ys, linestyle="--", color=f"C{i}", label=f"{run.name}: errors")
            _legend(ax, runs)
        _style(ax, f"{key}: {title}")
    return fig


def _loss_figure(runs: list[Run]):
    fig, axes = _new_figure(1, 2)
    _line_panel(axes[0], runs, "policy/loss")
    _style(axes[0], "policy/loss (clipped surrogate)", "loss")
    _line_panel(axes[1], runs, "value/loss")
    _style(axes[1], "value/loss", "loss")
    return fig


def _time_figure(runs: list[Run]):
    panels = [(run, [row for row in run.rows if any(k.startswith("time/") for k in row)]) for run in runs]
    # One y scale for all runs, so the bars compare across panels.
    fig, axes = _new_figure(len(panels), 1, width=7.5, height=3.4, sharey=True)
    for ax, (run, rows) in zip(axes, panels):
        steps = [row["step"] for row in rows]
        bottom = [0.0] * len(rows)
        for j, key in enumerate(TIME_STAGES):
            vals = [_finite(row.get(key)) or 0.0 for row in rows]
            if any(vals):
                ax.bar(steps, vals, bottom=bottom, width=0.8, color=f"C{j}", label=key.removeprefix("time/"))
                bottom = [b + v for b, v in zip(bottom, vals)]
        # What time/iteration holds beyond the named stages (statistics, logging, the PPO batch set-up).
        rest = [max(0.0, (_finite(row.get("time/iteration")) or 0.0) - b) for row, b in zip(rows, bottom)]
        if any(r > 1e-3 for r in rest):
            ax.bar(steps, rest, bottom=bottom, width=0.8, color="lightgray", label="other")
        _style(ax, f"where the time goes: {run.name}", "seconds")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        else:
            ax.text(0.5, 0.5, "no time/* metrics", ha="center", va="center", transform=ax.transAxes,
                    color="gray")
    return fig


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path) -> list[Path]:
    """Write the PNGs for ``run_dirs`` (all on the same figures) into ``out_dir``; return their paths."""
    if not run_dirs:
        raise PlotError("no run directory given")
    runs = [load_run(d) for d in run_dirs]
    _unique_names(runs)
    try:
        import matplotlib
    except ImportError:
        raise PlotError("rallyrl plot needs matplotlib: pip install 'rallyrl[plot]'") from None
    matplotlib.use("Agg")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, make in (("reward", _reward_figure), ("kl", _kl_figure), ("eval", _eval_figure),
                       ("episodes", _episode_figure), ("losses", _loss_figure), ("time", _time_figure)):
        fig = make(runs)
        if fig is None:
            continue
        if len(runs) > 1:
            fig.suptitle("  vs  ".join(r.name for r in runs), fontsize=10)
        path = out / f"{name}.png"
        fig.savefig(path)
        written.append(path)
    return written


# ------------------------------------------------------------------------------------------------
# CLI: registered by rallyrl/cli.py


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plot", help="write PNG curves (reward, KL, eval, episodes, losses, time) of run directories",
                              description=__doc__.splitlines()[0].split(": ", 1)[-1])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directory (several: compared on each figure)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output folder (default: RUN_DIR/plots for one run, ./plots for several)")
    return p


def main(args: argparse.Namespace) -> int:
    out = args.out or (Path(args.run_dirs[0]) / "plots" if len(args.run_dirs) == 1 else Path("plots"))
    try:
        written = plot_runs(args.run_dirs, out)
    except PlotError as e:
        print(f"rallyrl: error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
