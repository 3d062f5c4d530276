"""DESIGN.md: ``dist.py`` is the ONLY module that calls torch.distributed (all collectives, FSDP2 and DCP
included). Read from the source with ``ast`` (nothing is imported), so it also catches a lazy import
inside a function and a ``torch.distributed.xxx(...)`` call through plain ``import torch``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "rallyrl"
ALLOWED = {"dist.py"}


def _is_torch_distributed(name: str) -> bool:
    return name == "torch.distributed" or name.startswith("torch.distributed.")


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def uses_of_torch_distributed(source: str, filename: str = "<source>") -> list[str]:
    """``line: what`` for every import of torch.distributed (``import torch.distributed[.x]``, ``from
    torch.distributed[.x] import ...``, ``from torch import distributed``), every ``torch.distributed``
    attribute chain, and every string naming it (``importlib.import_module("torch.distributed")``)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if _is_torch_distributed(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if _is_torch_distributed(node.module):
                found.append(f"{node.lineno}: from {node.module} import ...")
            elif node.module == "torch" and any(a.name == "distributed" for a in node.names):
                found.append(f"{node.lineno}: from torch import distributed")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            # only the innermost link (torch.distributed), so a.b.c chains are reported once
            if _dotted(node) == "torch.distributed":
                found.append(f"{node.lineno}: torch.distributed")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_torch_distributed(node.value):
            found.append(f"{node.lineno}: {node.value!r}")
    return found


def test_only_dist_calls_torch_distributed():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ALLOWED:
            continue
        uses = uses_of_torch_distributed(path.read_text(), str(path))
        if uses:
            offenders[rel] = uses
    assert not offenders, f"only rallyrl/dist.py may use torch.distributed; found: {offenders}"


def test_dist_does_use_it():
    # the scan sees dist.py's own uses: a checker that finds nothing anywhere would pass vacuously
    assert uses_of_torch_distributed((PACKAGE / "dist.py").read_text())


@pytest.mark.parametrize("source", [
    "import torch.distributed as tdist",
    "import torch.distributed.checkpoint",
    "from torch.distributed.fsdp import fully_shard",
    "from torch import distributed",
    "import torch\ndef f():\n    return torch.distributed.get_world_size()",
    "import torch\nx = torch.distributed.checkpoint.state_dict",
    "import importlib\ntd = importlib.import_module('torch.distributed')",
    "def f():\n    from torch.distributed.tensor import DTensor\n    return DTensor",
])
def test_the_scan_catches(source):
    assert uses_of_torch_distributed(source)


@pytest.mark.parametrize("source", [
    "import torch\nx = torch.nn.Linear(2, 2)",
    "from . import dist\ndist.barrier()",
    "# torch.distributed in a comment\nimport torch",
    '"""Written with torch.distributed.checkpoint (DCP)."""',  # prose in a docstring, not a module name
])
def test_the_scan_ignores(source):
    assert not uses_of_torch_distributed(source)
