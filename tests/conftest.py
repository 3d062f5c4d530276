import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `examples.*` and `tests.helpers` are importable


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer, 64-dim GPT-2 with a small BPE tokenizer, built locally once per session."""
    from rallyrl.testing import build_tiny_gpt2

    return build_tiny_gpt2(tmp_path_factory.mktemp("tiny") / "gpt2")
