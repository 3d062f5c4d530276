"""Character-level tokenizer for the randomwalks task.

One token per node letter, plus ``<|pad|>``, ``<|eos|>`` and ``<|unk|>``. No
BOS and no post-processor: ``tok("dkfa").input_ids`` is exactly the four node
tokens. The decoder fuses tokens without spaces, so
``tok.decode(tok(s).input_ids, skip_special_tokens=True) == s``.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:  # transformers (and torch under it) is imported lazily
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|eos|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, UNK_TOKEN]

__all__ = ["PAD_TOKEN", "EOS_TOKEN", "UNK_TOKEN", "SPECIAL_TOKENS", "vocab", "build_core_tokenizer", "build_tokenizer"]


def vocab(n_nodes: int = 21) -> dict:
    """Token -> id: pad, eos, unk are 0, 1, 2; the node letters follow in order."""
    letters = list(string.ascii_lowercase[:n_nodes])
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS + letters)}


def build_core_tokenizer(n_nodes: int = 21) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` (no transformers import)."""
    core = Tokenizer(models.WordLevel(vocab=vocab(n_nodes), unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    core.decoder = decoders.Fuse()  # join tokens with no separator
    core.add_special_tokens(SPECIAL_TOKENS)
    return core


def build_tokenizer(n_nodes: int = 21) -> "PreTrainedTokenizerFast":
    """Tokenizer over node letters ``'a'..`` (``n_nodes`` of them) wrapped for
    transformers, with ``pad_token`` and ``eos_token`` set (no BOS)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=build_core_tokenizer(n_nodes),
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=16,
    )
