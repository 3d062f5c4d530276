"""The README's quick starts, run as written (in a fresh folder, with the installed `rallyrl`), must run
and show the reward rising: a newcomer's first run has to show PPO doing something."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.smoke


def _section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def _blocks(section: str) -> list[tuple[str, str]]:
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)


def _env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only what a user has: the install
    e.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
              "PATH": str(Path(sys.executable).parent) + os.pathsep + e.get("PATH", "")})
    return e


def _rewards(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["reward/mean"] for r in rows if r["step"] >= 1]  # step 0: the evaluation before training


def _assert_rises(rewards: list[float]) -> None:
    print("reward/mean per iteration:", [round(r, 2) for r in rewards])
    assert len(rewards) == 20
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 1.0 and last > 2 * first, rewards


def test_python_quick_start(tmp_path):
    (lang, code), = [b for b in _blocks(_section("Quick start: Python")) if b[0] == "python"]
    (tmp_path / "quickstart.py").write_text(code)
    p = subprocess.run([sys.executable, "quickstart.py"], cwd=tmp_path, env=_env(), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "reward per iteration:" in p.stdout
    _assert_rises(_rewards(tmp_path / "runs" / "quickstart"))


def test_cli_quick_start(tmp_path):
    blocks = _blocks(_section("Quick start: CLI"))
    files = [(lang, code) for lang, code in blocks if lang in ("python", "yaml")]
    assert len(files) == 2
    for _, code in files:
        name = code.splitlines()[0].removeprefix("# ").strip()  # each file's block starts with its name
        (tmp_path / name).write_text(code)
    (bash,) = [code for lang, code in blocks if lang == "bash"]
    p = subprocess.run(["bash", "-e", "-c", bash], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "# ok: this config trains on 2 process(es)" in p.stdout  # the dry run's report
    _assert_rises(_rewards(tmp_path / "runs" / "cli-quickstart"))
