"""Tiny, locally built models for tests, examples and trying rallyrl offline (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

_CORPUS = [
    "the cat sat on the mat", "a dog ran in the park", "good morning to you", "what a lovely day",
    "i like green tea", "the sun is bright today", "we walk home slowly", "birds sing in the trees",
    "this is a bad idea", "that was a great movie", "my friend is happy", "the rain is cold",
]


def build_tiny_gpt2(out_dir: str | Path, *, n_layer: int = 2, n_embd: int = 64, n_positions: int = 128,
                    seed: int = 0, corpus: list[str] | None = None) -> Path:
    """A randomly initialised GPT-2 with a small byte-level BPE tokenizer trained on ``corpus``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(corpus or _CORPUS, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                  bos_token="<|endoftext|>")
    tok.save_pretrained(out)
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=n_positions, n_embd=n_embd, n_layer=n_layer, n_head=2,
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    GPT2LMHeadModel(cfg).save_pretrained(out)
    return out
