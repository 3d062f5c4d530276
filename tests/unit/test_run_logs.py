"""``rallyrl.run.logs``: the one reader and writer of the run's JSONL files (no model, ms)."""

from __future__ import annotations

import json

import pytest

from rallyrl.run.logs import JsonlError, has_iteration, iter_jsonl, jsonl_line, read_jsonl, truncate_jsonl


def test_rows_are_read_with_their_line_numbers_and_blank_lines_skipped(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2}\n', encoding="utf-8")
    assert list(iter_jsonl(path)) == [(1, {"step": 1}), (3, {"step": 2})]
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]


def test_a_half_written_last_line_is_left_out_only_when_asked(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "reward/me', encoding="utf-8")
    assert [row for _, row in iter_jsonl(path, complete_only=True)] == [{"step": 1}]
    with pytest.raises(JsonlError) as e:
        read_jsonl(path)
    assert e.value.lineno == 2 and str(e.value).startswith(f"{path}:2 is not valid JSON: ")


def test_text_with_unicode_line_breaks_is_one_line_read_back_whole(tmp_path):
    odd = "a\x85b\u2028c\u2029d"
    line = jsonl_line({"output": odd})
    assert line.count("\n") == 1 and len(line.splitlines()) == 1 and odd not in line
    path = tmp_path / "r.jsonl"
    path.write_text(line * 2, encoding="utf-8")
    assert read_jsonl(path) == [{"output": odd}] * 2


def test_strict_lines_write_non_finite_values_as_null():
    assert json.loads(jsonl_line({"a": float("nan"), "b": float("inf"), "c": 1.5}, strict=True)) == \
        {"a": None, "b": None, "c": 1.5}
    assert "NaN" in jsonl_line({"a": float("nan")})  # eval samples are written as they are


def test_truncation_keeps_steps_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "x', encoding="utf-8")
    truncate_jsonl(path, 2)
    assert path.read_text(encoding="utf-8") == '{"step": 1}\n{"step": 2}\n'
    assert not path.with_suffix(".jsonl.tmp").exists()


def test_a_run_is_a_metrics_file_with_a_completed_iteration(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert not has_iteration(path)
    path.write_text('{"step": 0, "eval/x": 1}\n', encoding="utf-8")
    assert not has_iteration(path)  # only the evaluation before training
    path.write_text('{"step": 0}\n{"step": 1}\n', encoding="utf-8")
    assert has_iteration(path)
    path.write_text("not json\n", encoding="utf-8")
    assert has_iteration(path)  # not ours to judge: treated as a run
