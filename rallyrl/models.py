"""Policy with a value head, the frozen reference policy, and loading with clear errors.

Shapes: ``B`` batch, ``Q`` (left-padded) query length, ``T`` (right-padded) response length, ``V`` vocab,
``H`` hidden size.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .config import ConfigError, ModelConfig
from .seeding import shared_generator

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                    "spiece.model")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """The model or tokenizer folder is missing or unusable."""


class PolicyWithValueHead(nn.Module):
    """A causal LM plus a scalar value head on its last hidden state (one forward gives both)."""

    def __init__(self, lm: nn.Module, value_head_std: float, seed: int, head: str = "linear") -> None:
        super().__init__()
        self.lm = lm
        hidden = lm.config.get_text_config().hidden_size
        dtype = next(lm.parameters()).dtype
        # Initialised from the shared seed: identical on every rank and independent of the global RNG.
        g = shared_generator(seed, 17)
        if head == "mlp":
            # trlx's head: Linear(H, 2H) -> ReLU -> Linear(2H, 1); more capacity for the value than a
            # single projection of the policy's features.
            first = nn.Linear(hidden, 2 * hidden, dtype=dtype)
            with torch.no_grad():
                bound = 1.0 / hidden**0.5  # nn.Linear's default init, drawn from the shared generator
                first.weight.copy_((torch.rand(first.weight.shape, generator=g) * 2 - 1) * bound)
                first.bias.copy_((torch.rand(first.bias.shape, generator=g) * 2 - 1) * bound)
            last = nn.Linear(2 * hidden, 1, dtype=dtype)
            self.v_head = nn.Sequential(first, nn.ReLU(), last)
        else:
            last = nn.Linear(hidden, 1, dtype=dtype)
            self.v_head = last
        with torch.no_grad():
            last.weight.copy_((torch.randn(last.weight.shape, generator=g) * value_head_std).to(dtype))
            last.bias.zero_()

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids/attention_mask (B, Q+T) = [left-padded query | right-padded response].

        Returns logits (B, T, V) predicting each response token and values (B, T): the value of the
        state in which response token t is chosen (the hidden state one position before it).
        """
        out = _response_forward(self.lm, input_ids, attention_mask, response_len, hidden_states=True)
        T = response_len
        logits = out.logits[:, -(T + 1) : -1]  # (B, T, V)
        hidden = out.hidden_states[-1][:, -(T + 1) : -1]  # (B, T, H)
        values = self.v_head(hidden).squeeze(-1)  # (B, T)
        return logits, values


def reference_logits(
    ref: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int
) -> torch.Tensor:
    """Logits (B, T, V) of the frozen reference policy for the response tokens."""
    T = response_len
    return _response_forward(ref, input_ids, attention_mask, T, hidden_states=False).logits[:, -(T + 1) : -1]


def _response_forward(lm: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                      hidden_states: bool) -> object:
    """The causal-LM forward both passes share: left padding shifts the real tokens, so positions count
    real tokens only (as generate() does); only the last T + 1 logits are computed where the model
    supports it."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, Q+T)
    keep = "logits_to_keep" in inspect.signature(lm.forward).parameters
    return lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
              output_hidden_states=hidden_states, use_cache=False,
              **({"logits_to_keep": response_len + 1} if keep else {}))


def max_positions(config: object) -> int | None:
    """The longest sequence the model accepts, from its (text) config; None if it does not say."""
    c = config.get_text_config()
    return getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)


@dataclass
class LoadedModels:
    policy: PolicyWithValueHead
    ref: nn.Module
    tokenizer: object


def load_tokenizer(cfg: ModelConfig):  # -> PreTrainedTokenizerBase
    from transformers import AutoTokenizer

    path = Path(cfg.tokenizer_path or cfg.path)
    key = "model.tokenizer_path" if cfg.tokenizer_path else "model.path"
    if not path.is_dir():
        raise ModelLoadError(f"{key}: folder not found: {path}")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelLoadError(
            f"{key}: no tokenizer in {path} (none of {', '.join(_TOKENIZER_FILES)}); save one there with "
            f"tokenizer.save_pretrained() or set model.tokenizer_path"
        )
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many kinds here; the message is what matters
        if not cfg.tokenizer_path:
            # AutoTokenizer reads the model's config.json too: a broken one is a model-folder problem
            # and is reported as such, not as "no usable tokenizer".
            check_model_folder(cfg)
        raise ModelLoadError(
            f"{key}: no usable tokenizer in {path} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            f"save one there with tokenizer.save_pretrained() or set model.tokenizer_path"
        ) from None
    if len(tok) <= 1:
        raise ModelLoadError(f"{key}: the tokenizer in {path} has an empty vocabulary")
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ModelLoadError(f"{key}: the tokenizer in {path} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # prompts are left-padded so every response starts at the same column
    return tok


def check_model_folder(cfg: ModelConfig) -> None:
    """Cheap checks that run before anything heavy is loaded: the folder, a readable ``config.json`` that
    transformers understands, and weight files (their presence only; nothing is loaded)."""
    import json

    from transformers import AutoConfig

    weight_patterns = ("*.safetensors", "pytorch_model*.bin", "*.gguf")
    if not cfg.path:
        raise ConfigError("model.path is required (a local Hugging Face model folder)")
    path = Path(cfg.path)
    if not path.is_dir():
        raise ModelLoadError(f"model.path: folder not found: {path}")
    config_json = path / "config.json"
    if not config_json.is_file():
        raise ModelLoadError(f"model.path: {path} has no config.json (not a saved Hugging Face model)")
    try:
        json.loads(config_json.read_text(encoding="utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(
            f"model.path: {config_json} is not valid JSON ({e}); re-save the model with save_pretrained()"
        ) from None
    try:
        AutoConfig.from_pretrained(str(path))
    except Exception as e:  # unknown model_type, missing fields...: a model-folder problem
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelLoadError(
            f"model.path: {config_json} is not a usable model config ({type(e).__name__}: {first})"
        ) from None
    if not any(any(path.glob(p)) for p in weight_patterns):
        raise ModelLoadError(
            f"model.path: {path} has no weights (none of {', '.join(weight_patterns)}); save the model "
            f"there with save_pretrained()"
        )


def load_models(cfg: ModelConfig, seed: int, tokenizer: object | None = None) -> LoadedModels:
    """Policy (with value head), frozen reference and tokenizer (``tokenizer`` if already loaded)."""
    from transformers import AutoModelForCausalLM

    check_model_folder(cfg)
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    try:
        lm = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=_DTYPES[cfg.dtype])
    except Exception as e:
        raise ModelLoadError(f"model.path: could not load a causal LM from {cfg.path}: {e}") from None
    # Dropout off, as in TRL/OpenRLHF PPO: the log-probs of the rollout pass and of the first PPO step
    # must agree (ratio 1), which dropout would break. Gradients still flow in eval mode.
    lm.eval()
    ref = copy.deepcopy(lm).eval().requires_grad_(False)
    policy = PolicyWithValueHead(lm, cfg.value_head_std, seed, cfg.value_head).eval()
    return LoadedModels(policy=policy, ref=ref, tokenizer=tok)
