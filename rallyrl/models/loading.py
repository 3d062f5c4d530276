"""The one loader (``load_models``) and the checks of model and tokenizer folders, with clear errors.

Shapes: ``B`` batch, ``Q`` (left-padded) query length, ``T`` (right-padded) response length, ``V`` vocab,
``H`` hidden size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, ModelConfig
from .base import Reference, checkpoint_activations
from .causal import CausalPolicy, CopyReference
from .reference import save_lora, setup_lora, setup_shared
from .seq2seq import Seq2SeqCopyReference, Seq2SeqPolicy
from .weights import InitialWeights, empty_lm

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                    "spiece.model")


class ModelLoadError(ValueError):
    """The model or tokenizer folder is missing or unusable."""


def max_positions(config: object) -> int | None:
    """The longest sequence the model accepts, from its (text) config; None if it does not say."""
    c = config.get_text_config()
    return getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)


@dataclass
class LoadedModels:
    policy: CausalPolicy | Seq2SeqPolicy  # a Policy (nn.Module)
    reference: Reference | None  # None: no KL term can be non-zero (ppo.uses_reference), so none is built
    tokenizer: Any
    # Set when the models were built empty (``load_models(empty=True)``): their parameters are on the meta
    # device until ``dist.shard(..., weights=...)`` fills their shards from these (models/weights.py).
    weights: InitialWeights | None = None
    note: str = ""  # why ``empty`` was asked for but the weights were loaded the usual way


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


def load_models(cfg: ModelConfig, seed: int, tokenizer: Any = None, value_head: bool = True,
                reference: bool = True, empty: bool = False) -> LoadedModels:
    """The one loader: policy (with a value head unless ``value_head`` is False: critic-free estimators)
    and reference for ``model.arch`` (none unless ``reference``: with beta 0 nothing reads it, so no
    copy is made, no frozen top blocks, no adapter switch), and the tokenizer (``tokenizer`` if
    already loaded). The trainer never names a model class.

    ``empty`` (``model.sharding: fsdp``): build the whole model tree (policy, value head, reference)
    without reading any weight: the LM's parameters stay on the meta device and ``LoadedModels.weights``
    says where their values are, for ``dist.shard`` to read on rank 0 into the shards
    (models/weights.py). When the folder cannot be read that way, or with a ``shared`` / ``lora``
    reference, the weights are loaded as usual and ``LoadedModels.note`` says why."""
    # config.validate refuses this first; the check here covers a ModelConfig built in code, before any load
    if cfg.arch == "seq2seq" and cfg.reference != "copy":
        raise ConfigError(f"model.reference={cfg.reference!r} is implemented for model.arch=causal only; "
                          f"use model.reference=copy with model.arch=seq2seq")
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg)  # the folder was checked with the inputs
    lm, weights, note = _load_lm(cfg, empty)
    # Dropout off, as in TRL/OpenRLHF PPO: the log-probs of the rollout pass and of the first PPO step
    # must agree (ratio 1), which dropout would break. Gradients still flow in eval mode.
    lm.eval()
    ref: Reference | None
    policy: CausalPolicy | Seq2SeqPolicy
    head = cfg.value_head if value_head else None
    if cfg.arch == "seq2seq":
        ref = Seq2SeqCopyReference(lm, cfg.prefill_once) if reference else None
        _checkpointing(lm, cfg)
        policy = Seq2SeqPolicy(lm, cfg.value_head_std, seed, head, cfg.prefill_once).eval()
        return _loaded(policy, ref, tok, weights, note)
    save = None
    fixed = cfg.sharding == "fsdp"  # each block's forward in training is a collective: every rank, the same passes
    if cfg.reference == "shared":
        # What trains is the same with or without a reference: the top blocks over a frozen trunk.
        ref = setup_shared(lm, cfg.num_layers_unfrozen, reference)  # freezes the policy below its top blocks
    elif cfg.reference == "lora":
        lm, ref = setup_lora(lm, cfg.lora, cfg.prefill_once, fixed)  # only the adapter trains
        ref = ref if reference else None
        save = functools.partial(save_lora, merge=cfg.lora.merge_on_save)
    else:
        ref = CopyReference(lm, cfg.prefill_once, fixed) if reference else None
    _checkpointing(lm, cfg)  # after the references copied what they need
    policy = CausalPolicy(lm, cfg.value_head_std, seed, head, save=save, prefill_once=cfg.prefill_once,
                          fixed_passes=fixed,
                          full_when_scoring=cfg.reference == "shared" and ref is not None).eval()
    return _loaded(policy, ref, tok, weights, note)


def _load_lm(cfg: ModelConfig, empty: bool) -> tuple[Any, InitialWeights | None, str]:
    """The transformers model of ``model.arch`` (built empty when ``empty`` and the folder allows it, see
    ``load_models``), where its weights are when built empty, and the note saying why it was not."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    auto, what = ((AutoModelForSeq2SeqLM, "seq2seq LM (model.arch: seq2seq)") if cfg.arch == "seq2seq"
                  else (AutoModelForCausalLM, "causal LM (model.arch: causal)"))
    lm, weights, note = None, None, ""
    if empty and cfg.reference != "copy":
        # shared: setup_shared unties a tied head by copying its (here empty) weight and freezes the trunk;
        # lora: peft wraps the LM and renames its keys. Both would need their own mapping from the files'
        # names to the changed tree; until then they load the usual way, then shard.
        note = f"model.reference: {cfg.reference} loads the whole model on every rank, then shards it"
    elif empty:
        try:
            lm, weights, why = empty_lm(auto, cfg.path, getattr(torch, cfg.dtype))
        except Exception as e:
            raise ModelLoadError(f"model.path: could not build a {what} from {cfg.path}/config.json: {e}") from None
        note = f"every rank loads the whole model before sharding it: {why}" if lm is None else ""
    if lm is None:
        try:
            lm = auto.from_pretrained(cfg.path, dtype=getattr(torch, cfg.dtype))
        except Exception as e:
            raise ModelLoadError(f"model.path: could not load a {what} from {cfg.path}: {e}") from None
    return lm, weights, note


def _loaded(policy: Any, ref: Reference | None, tok: Any, weights: InitialWeights | None, note: str) -> LoadedModels:
    if weights is not None:
        # The value head was built for real (seeded, the same on every rank): rank 0 sends its values with
        # the LM's (dist.shard's to_empty discards what the shards held).
        weights.in_memory |= {k: v.detach() for k, v in policy.state_dict().items() if not k.startswith("lm.")}
    return LoadedModels(policy=policy, reference=ref, tokenizer=tok, weights=weights, note=note)


def _checkpointing(lm: Any, cfg: ModelConfig) -> None:
    if cfg.gradient_checkpointing and not checkpoint_activations(lm):
        raise ConfigError(f"model.gradient_checkpointing: no transformer blocks found in {type(lm).__name__} "
                          f"(its model declares no `_no_split_modules`); set it to false")
