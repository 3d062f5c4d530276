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


@pytest.fixture(scope="session")
def tiny_llama(tiny_model, tmp_path_factory):
    """A 2-layer, 64-dim Llama (untied head, rotary positions) sharing the tiny GPT-2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny") / "llama"
    tok = AutoTokenizer.from_pretrained(tiny_model)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_chat(tiny_model, tmp_path_factory):
    """A tiny GPT-2 with ChatML special tokens (``<|im_end|>`` = EOS) and a Qwen/Hermes-style tool template
    (tests/helpers/chat.py), built locally."""
    from tests.helpers.chat import build_tiny_chat

    return build_tiny_chat(tmp_path_factory.mktemp("tiny") / "chat", tiny_model)
# A minimal chat template (role markers, one message a line), so conversational prompts render offline
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="session")
def chat_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny GPT-2 with ``TINY_CHAT_TEMPLATE`` as its chat template."""
    import shutil

    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("chat") / "gpt2"
    shutil.copytree(tiny_model, out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = TINY_CHAT_TEMPLATE
    tok.save_pretrained(out)
    return out


def pytest_collection_modifyitems(config, items):
    """Tests marked ``vllm`` need vLLM (``.venv-vllm``, made by ``make install-vllm``; ``make test`` runs them
    there): skipped in an environment without it."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed here (make install-vllm; make test runs these in .venv-vllm)")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)
