"""DESIGN.md: ``rallyrl/dist/`` is the only code that uses torch.distributed, and within it
``dist/collectives.py`` is the only module that calls torch.distributed's collectives. The FSDP2 / DCP
engine in ``dist/sharding.py`` may import the engine's submodules (``torch.distributed.fsdp``,
``.checkpoint``, ``.tensor``, ``.device_mesh``: their collectives run inside FSDP2's hooks and DCP), but
not ``torch.distributed`` itself. Read from the source with ``ast`` (nothing is imported), so it also
catches a lazy import inside a function, a ``torch.distributed.xxx(...)`` call through plain ``import
torch``, and collectives' lazy ``tdist`` borrowed by another module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "rallyrl"
COLLECTIVES = "dist/collectives.py"  # anything of torch.distributed
SHARDING = "dist/sharding.py"  # the FSDP2 / DCP engine's submodules only
ENGINE = ("torch.distributed.fsdp", "torch.distributed.checkpoint", "torch.distributed.tensor",
          "torch.distributed.device_mesh")


def _is_torch_distributed(name: str) -> bool:
    return name == "torch.distributed" or name.startswith("torch.distributed.")


def _is_engine(name: str) -> bool:
    return any(name == e or name.startswith(e + ".") for e in ENGINE)


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def uses_of_torch_distributed(source: str, filename: str = "<source>", engine_allowed: bool = False) -> list[str]:
    """``line: what`` for every import of torch.distributed (``import torch.distributed[.x]``, ``from
    torch.distributed[.x] import ...``, ``from torch import distributed``), every ``torch.distributed``
    attribute chain, every string naming it (``importlib.import_module("torch.distributed")``) and every
    use of collectives' lazy ``tdist`` outside it. ``engine_allowed``: imports of the FSDP2 / DCP
    engine's submodules (``ENGINE``) are not reported."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if _is_torch_distributed(a.name) and not (engine_allowed and _is_engine(a.name))]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if _is_torch_distributed(node.module) and not (engine_allowed and _is_engine(node.module)):
                found.append(f"{node.lineno}: from {node.module} import ...")
            elif node.module == "torch" and any(a.name == "distributed" for a in node.names):
                found.append(f"{node.lineno}: from torch import distributed")
        elif isinstance(node, ast.ImportFrom) and any(a.name == "tdist" for a in node.names):
            found.append(f"{node.lineno}: from {'.' * node.level}{node.module or ''} import tdist")
        elif isinstance(node, ast.Attribute) and node.attr == "tdist":
            found.append(f"{node.lineno}: .tdist")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            # only the innermost link (torch.distributed), so a.b.c chains are reported once
            if _dotted(node) == "torch.distributed":
                found.append(f"{node.lineno}: torch.distributed")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_torch_distributed(node.value):
            found.append(f"{node.lineno}: {node.value!r}")
    return found


def test_only_dist_collectives_calls_torch_distributed():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == COLLECTIVES:
            continue
        uses = uses_of_torch_distributed(path.read_text(), str(path), engine_allowed=rel == SHARDING)
        if uses:
            offenders[rel] = uses
    assert not offenders, (f"only rallyrl/{COLLECTIVES} may use torch.distributed (rallyrl/{SHARDING}: the FSDP2 / "
                           f"DCP submodules only); found: {offenders}")


def test_dist_does_use_it():
    # the scan sees the dist modules' own uses: a checker that finds nothing anywhere would pass vacuously
    assert uses_of_torch_distributed((PACKAGE / COLLECTIVES).read_text())
    sharding = (PACKAGE / SHARDING).read_text()
    assert uses_of_torch_distributed(sharding) and not uses_of_torch_distributed(sharding, engine_allowed=True)


@pytest.mark.parametrize("source", [
    "import torch.distributed as tdist",
    "import torch.distributed.checkpoint",
    "from torch.distributed.fsdp import fully_shard",
    "from torch import distributed",
    "import torch\ndef f():\n    return torch.distributed.get_world_size()",
    "import torch\nx = torch.distributed.checkpoint.state_dict",
    "import importlib\ntd = importlib.import_module('torch.distributed')",
    "def f():\n    from torch.distributed.tensor import DTensor\n    return DTensor",
    "from .collectives import tdist\ntdist.all_reduce(x)",
    "from rallyrl.dist import collectives\ncollectives.tdist.barrier()",
])
def test_the_scan_catches(source):
    assert uses_of_torch_distributed(source)


@pytest.mark.parametrize("source", [
    # sharding.py may reach the engine's submodules, never the collectives of torch.distributed itself
    "import torch.distributed as tdist\ntdist.all_reduce(x)",
    "from torch.distributed import all_reduce",
    "from torch.distributed.distributed_c10d import all_reduce",
    "import torch\ndef f(x):\n    torch.distributed.all_reduce(x)",
    "import torch.distributed.checkpoint\ntorch.distributed.checkpoint.save(sd)",
    "from .collectives import agree, tdist",
    "import importlib\ntd = importlib.import_module('torch.distributed')",
])
def test_the_scan_catches_collectives_beside_the_engine(source):
    assert uses_of_torch_distributed(source, engine_allowed=True)


@pytest.mark.parametrize("source", [
    "import torch.distributed.checkpoint as dcp\ndcp.save(sd, storage_writer=w)",
    "from torch.distributed.fsdp import fully_shard",
    "def f():\n    from torch.distributed.checkpoint.state_dict import get_state_dict\n    return get_state_dict",
    "from torch.distributed.device_mesh import init_device_mesh",
    "from torch.distributed.tensor import DTensor",
])
def test_the_engine_is_allowed_where_it_is_allowed(source):
    assert not uses_of_torch_distributed(source, engine_allowed=True)
    assert uses_of_torch_distributed(source)  # and nowhere else


@pytest.mark.parametrize("source", [
    "import torch\nx = torch.nn.Linear(2, 2)",
    "from . import dist\ndist.barrier()",
    "# torch.distributed in a comment\nimport torch",
    '"""Written with torch.distributed.checkpoint (DCP)."""',  # prose in a docstring, not a module name
])
def test_the_scan_ignores(source):
    assert not uses_of_torch_distributed(source)
