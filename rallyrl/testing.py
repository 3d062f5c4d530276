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


def build_tiny_t5(out_dir: str | Path, *, num_layers: int = 2, d_model: int = 64, seed: int = 0,
                  corpus: list[str] | None = None) -> Path:
    """A randomly initialised T5 (encoder-decoder, relative positions) with a small BPE tokenizer trained
    on ``corpus``, laid out as T5's: ``<pad>`` = 0 (also the decoder-start token), ``</s>`` = 1 (appended
    to every encoded text), ``<unk>`` = 2, words marked with a leading ``▁``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast, T5Config, T5ForConditionalGeneration

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specials = ["<pad>", "</s>", "<unk>"]
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    tk.train_from_iterator(corpus or _CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    tk.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                      special_tokens=[("</s>", tk.token_to_id("</s>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    tok.save_pretrained(out)
    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=len(tok), d_model=d_model, d_kv=d_model // 2, d_ff=2 * d_model, num_layers=num_layers,
                   num_decoder_layers=num_layers, num_heads=2, relative_attention_num_buckets=8,
                   relative_attention_max_distance=32, dropout_rate=0.0, pad_token_id=tok.pad_token_id,
                   eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.pad_token_id)
    T5ForConditionalGeneration(cfg).save_pretrained(out)
    return out
