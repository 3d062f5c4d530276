"""The model protocols (``Policy``, ``Reference``), their causal-LM implementations, and the one loader.

The trainer and the rollout code talk to models only through ``Policy.forward`` / ``Policy.generate``
and ``Reference.logprobs``; how a model lays out query and response (a causal LM concatenates them, a
seq2seq model would encode the query and decode the response) stays in here. Adding a model type means
implementing the two protocols and choosing it in ``load_models``.

Shapes: ``B`` batch, ``Q`` (left-padded) query length, ``T`` (right-padded) response length, ``V`` vocab,
``H`` hidden size.
"""

from __future__ import annotations

import copy
import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from . import ops
from .config import ConfigError, ModelConfig
from .seeding import stream_generator

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                    "spiece.model")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """The model or tokenizer folder is missing or unusable."""


class Policy(Protocol):
    """What the loop needs from a policy (an ``nn.Module``; its parameters are what PPO trains).

    Shapes: ``query`` (B, Q) left-padded, ``response`` (B, T) right-padded, masks True on real tokens.
    """

    def forward(self, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, V) predicting each response token, and values (B, T): the value of the state in
        which response token t is chosen."""
        ...

    def generate(self, query: torch.Tensor, query_mask: torch.Tensor, **sampling: Any) -> torch.Tensor:
        """Sampled response token ids (B, T') for the queries (no query tokens; ends padded)."""
        ...

    def save_pretrained(self, out: Path) -> None:
        """Write the policy (without the value head) as a folder plain ``transformers`` can load."""
        ...


class Reference(Protocol):
    """The frozen reference policy of the KL penalty."""

    def logprobs(self, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                 response_mask: torch.Tensor, temperature: float) -> torch.Tensor:
        """(B, T) log-probabilities of the response tokens under the reference, logits divided by
        ``temperature`` (the sampling policy's temperature, so the KL compares like with like)."""
        ...


def make_value_head(hidden: int, kind: str, std: float, seed: int, dtype: torch.dtype) -> nn.Module:
    """Scalar value head on a hidden state, initialised from the shared seed: identical on every rank
    and independent of the global RNG. ``linear`` as TRL; ``mlp`` is trlx's Linear(H, 2H) -> ReLU ->
    Linear(2H, 1), more capacity for the value than a single projection of the policy's features."""
    g = stream_generator(seed, "value_head")
    last: nn.Linear
    if kind == "mlp":
        first = nn.Linear(hidden, 2 * hidden, dtype=dtype)
        with torch.no_grad():
            bound = 1.0 / hidden**0.5  # nn.Linear's default init, drawn from the shared generator
            first.weight.copy_((torch.rand(first.weight.shape, generator=g) * 2 - 1) * bound)
            first.bias.copy_((torch.rand(first.bias.shape, generator=g) * 2 - 1) * bound)
        last = nn.Linear(2 * hidden, 1, dtype=dtype)
        head: nn.Module = nn.Sequential(first, nn.ReLU(), last)
    else:
        last = nn.Linear(hidden, 1, dtype=dtype)
        head = last
    with torch.no_grad():
        last.weight.copy_((torch.randn(last.weight.shape, generator=g) * std).to(dtype))
        last.bias.zero_()
    return head


class CausalPolicy(nn.Module):
    """A causal LM plus a scalar value head on its last hidden state (one forward gives both)."""

    def __init__(self, lm: nn.Module, value_head_std: float, seed: int, head: str = "linear") -> None:
        super().__init__()
        self.lm = lm
        self.v_head = make_value_head(lm.config.get_text_config().hidden_size, head, value_head_std, seed,
                                      next(lm.parameters()).dtype)

    def forward(self, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = response.shape[1]
        out = _causal_forward(self.lm, query, query_mask, response, response_mask, hidden_states=True)
        logits = out.logits[:, -(T + 1) : -1]  # (B, T, V): position t-1 predicts response token t
        hidden = out.hidden_states[-1][:, -(T + 1) : -1]  # (B, T, H)
        return logits, self.v_head(hidden).squeeze(-1)  # (B, T, V), (B, T)

    @torch.no_grad()
    def generate(self, query: torch.Tensor, query_mask: torch.Tensor, **sampling: Any) -> torch.Tensor:
        # We always pass the attention mask, but generate() drops an all-ones one, after which the pads
        # of finished rows make transformers warn about a missing mask; that warning does not apply.
        hf_log = logging.getLogger("transformers.modeling_utils")
        level = hf_log.level
        hf_log.setLevel(logging.ERROR)
        try:
            out = self.lm.generate(input_ids=query, attention_mask=query_mask, use_cache=True, **sampling)
        finally:
            hf_log.setLevel(level)
        return out[:, query.shape[1] :]  # (B, T'): a causal LM echoes the query first

    def save_pretrained(self, out: Path) -> None:
        self.lm.save_pretrained(out, safe_serialization=True)


class CopyReference(nn.Module):
    """The reference as a full frozen copy of the initial causal LM (trlx / TRL default)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = copy.deepcopy(lm).eval().requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                 response_mask: torch.Tensor, temperature: float) -> torch.Tensor:
        T = response.shape[1]
        logits = _causal_forward(self.lm, query, query_mask, response, response_mask, hidden_states=False).logits
        return ops.logprobs_from_logits(logits[:, -(T + 1) : -1].float() / temperature, response)  # (B, T)


def _causal_forward(lm: nn.Module, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                    response_mask: torch.Tensor, hidden_states: bool) -> Any:
    """The causal-LM forward both passes share, on [left-padded query | right-padded response]. Left
    padding shifts the real tokens, so positions count real tokens only (as generate() does); only the
    last T + 1 logits are computed where the model supports it."""
    ids = torch.cat([query, response], 1)  # (B, Q+T)
    mask = torch.cat([query_mask, response_mask], 1)  # (B, Q+T)
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, Q+T)
    keep = "logits_to_keep" in inspect.signature(lm.forward).parameters
    return lm(input_ids=ids, attention_mask=mask, position_ids=position_ids, output_hidden_states=hidden_states,
              use_cache=False, **({"logits_to_keep": response.shape[1] + 1} if keep else {}))


def max_positions(config: object) -> int | None:
    """The longest sequence the model accepts, from its (text) config; None if it does not say."""
    c = config.get_text_config()
    return getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)


@dataclass
class LoadedModels:
    policy: CausalPolicy  # a Policy (nn.Module)
    reference: Reference
    tokenizer: Any


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
    """Cheap checks that run before anything heavy is loaded."""
    if not cfg.path:
        raise ConfigError("model.path is required (a local Hugging Face model folder)")
    path = Path(cfg.path)
    if not path.is_dir():
        raise ModelLoadError(f"model.path: folder not found: {path}")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model.path: {path} has no config.json (not a saved Hugging Face model)")


def load_models(cfg: ModelConfig, seed: int, tokenizer: Any = None) -> LoadedModels:
    """The one loader: policy (with value head) and reference for ``model.arch``, and the tokenizer
    (``tokenizer`` if already loaded). The trainer never names a model class."""
    from transformers import AutoModelForCausalLM

    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg)  # the folder was checked with the inputs
    try:
        lm = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=_DTYPES[cfg.dtype])
    except Exception as e:
        raise ModelLoadError(f"model.path: could not load a causal LM from {cfg.path}: {e}") from None
    # Dropout off, as in TRL/OpenRLHF PPO: the log-probs of the rollout pass and of the first PPO step
    # must agree (ratio 1), which dropout would break. Gradients still flow in eval mode.
    lm.eval()
    reference = CopyReference(lm)
    policy = CausalPolicy(lm, cfg.value_head_std, seed, cfg.value_head).eval()
    return LoadedModels(policy=policy, reference=reference, tokenizer=tok)
