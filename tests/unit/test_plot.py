"""rallyrl plot on small metrics.jsonl files written here (no training run: see tests/smoke/test_plot_smoke.py)."""

import json

import pytest

pytest.importorskip("matplotlib")

from rallyrl.cli import main as cli_main  # noqa: E402
from rallyrl.plot import PlotError, load_run, plot_runs, series  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(path, rows, raw_tail=""):
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("train:\n  iterations: 3\n")
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (path / "metrics.jsonl").write_text(text + raw_tail)
    return path


def rows_with(reward_means, **extra):
    rows = []
    for i, m in enumerate(reward_means, 1):
        rows.append({"step": i, "reward/mean": m, "reward/std": 0.1, "policy/kl": 0.01 * i, "policy/kl_coef": 0.05,
                     "policy/loss": -0.1, "value/loss": 0.5, "time/generate": 1.0, "time/update": 2.0, **extra})
    return rows


def test_series_skips_missing_null_and_non_finite_values(tmp_path):
    run = load_run(write_run(tmp_path / "r", [
        {"step": 1, "reward/mean": 0.1},
        {"step": 2, "reward/mean": None},      # null: how a non-finite value may be written
        {"step": 3, "reward/mean": "nan"},     # or as text
        {"step": 4},                           # or missing
        {"step": 5, "reward/mean": 0.5, "flag": True},
    ]))
    assert series(run, "reward/mean") == ([1, 5], [0.1, 0.5])
    assert series(run, "flag") == ([], [])  # booleans are not plotted as numbers


def test_rows_with_the_same_step_merge_and_steps_are_sorted(tmp_path):
    run = load_run(write_run(tmp_path / "r", [
        {"step": 2, "reward/mean": 0.2},
        {"step": 0, "eval/sentiment": 0.0},   # eval before training, its own row
        {"step": 1, "reward/mean": 0.1},
        {"step": 2, "eval/sentiment": 0.4},   # eval after the last iteration, logged separately
    ]))
    assert [r["step"] for r in run.rows] == [0, 1, 2]
    assert run.rows[2] == {"step": 2, "reward/mean": 0.2, "eval/sentiment": 0.4}
    assert series(run, "eval/sentiment") == ([0, 2], [0.0, 0.4])


def test_an_unfinished_last_line_is_ignored_but_a_bad_line_inside_is_an_error(tmp_path):
    run = load_run(write_run(tmp_path / "live", rows_with([0.1, 0.2]), raw_tail='{"step": 3, "rew'))
    assert [r["step"] for r in run.rows] == [1, 2]
    bad = write_run(tmp_path / "bad", [])
    (bad / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(PlotError, match=r"metrics.jsonl:2 is not valid JSON"):
        load_run(bad)
    nostep = write_run(tmp_path / "nostep", [{"reward/mean": 1.0}])
    with pytest.raises(PlotError, match=r"metrics.jsonl:1 has no integer 'step'"):
        load_run(nostep)


def test_clear_errors_for_what_is_not_a_plottable_run_dir(tmp_path):
    with pytest.raises(PlotError, match="no such directory"):
        load_run(tmp_path / "missing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(PlotError, match="is not a run directory"):
        load_run(tmp_path / "plain")
    started = tmp_path / "started"
    started.mkdir()
    (started / "config.yaml").write_text("{}\n")
    with pytest.raises(PlotError, match="no metrics.jsonl yet"):
        load_run(started)
    empty = write_run(tmp_path / "empty", [])
    with pytest.raises(PlotError, match="metrics.jsonl is empty"):
        load_run(empty)


def test_plot_writes_every_figure_as_a_png(tmp_path):
    run = write_run(tmp_path / "run_a", rows_with([0.1, 0.3, 0.5]) + [{"step": 3, "eval/sentiment": 0.4}])
    written = plot_runs([run], tmp_path / "out")
    assert sorted(p.name for p in written) == ["eval.png", "kl.png", "losses.png", "reward.png", "time.png"]
    for p in written:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000


def test_no_eval_metrics_means_no_eval_figure(tmp_path):
    written = plot_runs([write_run(tmp_path / "r", rows_with([0.1, 0.2]))], tmp_path / "out")
    assert "eval.png" not in {p.name for p in written} and len(written) == 4


def test_no_kl_means_no_kl_figure(tmp_path):
    """A run without a reference model logs no policy/kl (and a flat kl_coef of 0): no empty kl.png."""
    rows = [{k: v for k, v in r.items() if k != "policy/kl"} | {"policy/kl_coef": 0.0} for r in rows_with([0.1, 0.2])]
    written = {p.name for p in plot_runs([write_run(tmp_path / "r", rows)], tmp_path / "out")}
    assert written == {"reward.png", "losses.png", "time.png"}
    with_kl = write_run(tmp_path / "k", rows_with([0.1, 0.2]))  # compared with a run that has one: drawn
    assert "kl.png" in {p.name for p in plot_runs([tmp_path / "r", with_kl], tmp_path / "out2")}


def test_several_runs_share_figures_and_get_distinct_labels(tmp_path):
    from matplotlib.figure import Figure

    import rallyrl.plot as plot

    a = write_run(tmp_path / "x" / "run", rows_with([0.1, 0.2]))
    b = write_run(tmp_path / "y" / "run", rows_with([0.3, 0.1, 0.0]))  # same folder name
    runs = [load_run(a), load_run(b)]
    plot._unique_names(runs)
    assert [r.name for r in runs] == ["x/run", "y/run"]
    fig = plot._reward_figure(runs)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.get_lines()] == ["x/run", "y/run"]
    assert list(ax.get_lines()[1].get_ydata()) == [0.3, 0.1, 0.0]
    time_fig = plot._time_figure(runs)
    assert len(time_fig.axes) == 2  # one stacked-bar panel per run


def test_time_bars_stack_the_stages_and_count_missing_stages_as_zero(tmp_path):
    import rallyrl.plot as plot

    run = load_run(write_run(tmp_path / "r", [
        {"step": 1, "time/generate": 1.0, "time/forward": 0.5, "time/update": 2.0},
        {"step": 2, "time/generate": 1.5, "time/update": 1.0, "time/eval": 3.0},
    ]))
    ax = plot._time_figure([run]).axes[0]
    tops = {}
    for patch in ax.patches:
        x = round(patch.get_x() + patch.get_width() / 2)
        tops[x] = max(tops.get(x, 0.0), patch.get_y() + patch.get_height())
    assert tops == {1: pytest.approx(3.5), 2: pytest.approx(5.5)}
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"generate", "forward", "update", "eval"}


def test_time_bars_show_the_rest_of_the_iteration_as_other(tmp_path):
    import rallyrl.plot as plot

    run = load_run(write_run(tmp_path / "r", [{"step": 1, "time/generate": 1.0, "time/iteration": 4.0}]))
    ax = plot._time_figure([run]).axes[0]
    assert sorted((p.get_y(), p.get_height()) for p in ax.patches) == [(0.0, 1.0), (1.0, 3.0)]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["generate", "other"]


def test_cli_plot_default_out_and_error_exit_code(tmp_path, capsys):
    run = write_run(tmp_path / "run", rows_with([0.1, 0.2]))
    assert cli_main(["plot", str(run)]) == 0
    assert (run / "plots" / "reward.png").is_file()
    out_dir = tmp_path / "cmp"
    assert cli_main(["plot", str(run), str(run), "--out", str(out_dir)]) == 0
    assert (out_dir / "time.png").is_file()
    assert cli_main(["plot", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_multi_turn_runs_get_an_episodes_figure(tmp_path):
    episodes = {"episode/turns": 2.0, "episode/tool_calls": 1.0, "episode/tool_errors": 0.25,
                "episode/truncated": 0.0, "episode/env_token_fraction": 0.1}
    multi = write_run(tmp_path / "multi", rows_with([0.1, 0.2], **episodes))
    single = write_run(tmp_path / "single", rows_with([0.1, 0.2]))
    written = {p.name: p for p in plot_runs([multi, single], tmp_path / "out")}
    assert "episodes.png" in written and written["episodes.png"].read_bytes()[:8] == PNG_MAGIC
    assert "episodes.png" not in {p.name for p in plot_runs([single], tmp_path / "out2")}
