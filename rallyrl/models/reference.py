"""The two memory-saving references of causal LMs: ``shared`` (trlx's "hydra") and ``lora`` (adapter off).

Both set up the policy's LM (what trains) and return the ``Reference``; ``loading.load_models`` picks
them from ``model.reference`` (``copy`` is ``causal.CopyReference``).

- ``shared``: only the top ``k = model.num_layers_unfrozen`` blocks, the final norm and the LM head train;
  the embeddings and every block below are frozen and shared. The reference is a frozen copy of the top
  ``k`` blocks + final norm + head, run on the shared trunk's hidden state, so the trunk is held once
  (trlx ``modeling_ppo.py``: ``AutoModelForCausalLMWithHydraValueHead``). Unlike trlx's hydra, the
  embeddings are frozen even when ``k`` is every layer, and a head tied to the input embeddings is untied
  (the policy trains its own copy; the reference reads the frozen embedding matrix): trlx's reference
  read trainable embeddings there, so its "frozen" reference drifted.
- ``lora``: a PEFT LoRA adapter on the LM; only adapter weights (and the value head) train; the reference
  is the same model under ``disable_adapter()``: no second copy at all.

Shapes: ``B`` batch, ``Q`` (left-padded) query length, ``T`` (right-padded) response length, ``V`` vocab,
``H`` hidden size, ``S = Q + T``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .. import ops
from ..config import ConfigError, LoraConfig
from .base import frozen_copy
from .causal import causal_forward, response_outputs
from .prefix import causal_prefix_supported

# model_type -> (path of the block list, path of the final norm). Others with the same layout
# (Mistral, Qwen2...) may differ in details (logit soft-capping, scaled heads), so they are refused
# rather than guessed at.
_LAYOUTS = {"gpt2": ("transformer.h", "transformer.ln_f"), "llama": ("model.layers", "model.norm")}


class _TrunkDone(Exception):
    """Raised by the hook on the first reference block: the trunk's work is done."""


def _get(module: nn.Module, dotted: str) -> Any:
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


def _layout(lm: nn.Module) -> tuple[nn.ModuleList, nn.Module]:
    model_type = lm.config.model_type
    if model_type not in _LAYOUTS:
        raise ConfigError(
            f"model.reference: shared supports the architectures {sorted(_LAYOUTS)}; this model is "
            f"{model_type!r} ({type(lm).__name__}). Use model.reference: copy or lora"
        )
    blocks_path, norm_path = _LAYOUTS[model_type]
    return _get(lm, blocks_path), _get(lm, norm_path)


class SharedReference(nn.Module):
    """Frozen copies of the top blocks + final norm + head, over the policy LM's frozen trunk.

    ``logprobs`` runs the policy LM (``causal.causal_forward``: same positions, masks and left padding
    as the policy) under ``no_grad`` with a pre-hook on its first unfrozen block that captures that
    block's inputs (hidden state and the kwargs the model computed: causal mask, rotary position
    embeddings, position ids) and stops the forward there, so the trunk runs once and the trainable
    blocks not at all. The captured inputs then go through the frozen copies.

    It always runs the full ``[query | response]`` forward, ignoring ``model.prefill_once``: a prompt run
    once would leave the captured inputs as a response pass over a KV cache that the frozen copies do not
    have (they would need the prefix pass's cache of their own blocks too). The policy shares in training;
    its scoring pass runs the full forward as this does (``CausalPolicy.full_when_scoring``), so the two
    agree bit for bit before the first update.

    Under ``model.sharding: fsdp`` the trunk is the policy's sharded LM: ``reads_policy`` tells the
    rollout to gather the policy together with this reference for ``logprobs``; this module's own frozen
    copies are sharded like any model (``_no_split_modules`` names their block class for ``dist.shard``).
    """

    reads_policy = True  # logprobs runs the policy's own LM (its frozen trunk)

    def __init__(self, lm: nn.Module, num_layers_unfrozen: int) -> None:
        super().__init__()
        blocks, norm = _layout(lm)
        L, k = len(blocks), num_layers_unfrozen
        if not 1 <= k <= L:
            raise ConfigError(f"model.num_layers_unfrozen must be between 1 and the model's {L} layers, got {k}")
        self._lm = [lm]  # a list: the trunk belongs to the policy, not to this module's parameters
        # A list too: an nn.Module attribute would register the policy's first trainable block as a
        # submodule, so reference.parameters() would hold trainable weights.
        self._first = [blocks[L - k]]
        self.blocks = frozen_copy(blocks[L - k :])
        # The transformer-block classes, as a Hugging Face model declares them: dist.shard makes each of
        # the copied blocks one FSDP unit (this module holds no PreTrainedModel that would declare them).
        self._no_split_modules = list(getattr(lm, "_no_split_modules", None) or [])
        self.norm = frozen_copy(norm)
        head, emb = lm.get_output_embeddings(), lm.get_input_embeddings()
        self.tied = head.weight is emb.weight
        # A tied head's weight is the (frozen) input embedding matrix: read it there, copy nothing.
        self.head = None if self.tied else frozen_copy(head)

    @torch.no_grad()
    def logprobs(self, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                 response_mask: torch.Tensor, temperature: float) -> torch.Tensor:
        lm, T = self._lm[0], response.shape[1]
        captured: dict[str, Any] = {}

        def stop(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            captured.update(args=args, kwargs=kwargs)
            raise _TrunkDone

        # prepend: the hook runs before any other pre-hook of that block, FSDP's included, so under fsdp
        # the policy's first trainable block is never entered (nor gathered) for the reference.
        handle = self._first[0].register_forward_pre_hook(stop, with_kwargs=True, prepend=True)
        try:
            causal_forward(lm, query, query_mask, response, response_mask, hidden_states=False)
        except _TrunkDone:
            pass
        finally:
            handle.remove()
        if not captured:
            raise RuntimeError("shared reference: the policy's forward never reached its first unfrozen block")
        h, rest, kwargs = captured["args"][0], captured["args"][1:], captured["kwargs"]  # h: (B, S, H)
        for block in self.blocks:
            h = block(h, *rest, **kwargs)
            h = h[0] if isinstance(h, tuple) else h  # blocks of older transformers return tuples
        h = self.norm(h[:, -(T + 1) : -1])  # (B, T, H): position t-1 predicts response token t
        if self.tied:
            logits = F.linear(h, lm.get_input_embeddings().weight)  # (B, T, V)
        else:
            logits = self.head(h)  # (B, T, V)
        return ops.logprobs_from_logits(logits.float() / temperature, response)  # (B, T)


def setup_shared(lm: nn.Module, num_layers_unfrozen: int, reference: bool = True) -> SharedReference | None:
    """Build the reference from the initial LM (unless ``reference`` is False: then no frozen copies
    are made), then freeze the policy LM below its top blocks."""
    blocks, norm = _layout(lm)
    if not 1 <= num_layers_unfrozen <= len(blocks):
        raise ConfigError(f"model.num_layers_unfrozen must be between 1 and the model's {len(blocks)} layers, "
                          f"got {num_layers_unfrozen}")
    ref = SharedReference(lm, num_layers_unfrozen) if reference else None
    head, emb = lm.get_output_embeddings(), lm.get_input_embeddings()
    tied = head.weight is emb.weight
    lm.requires_grad_(False)
    for block in blocks[len(blocks) - num_layers_unfrozen :]:
        block.requires_grad_(True)
    norm.requires_grad_(True)
    if tied:
        # Untie: the policy's head trains its own copy; the input embeddings stay frozen (the trunk, and
        # so the reference, never reads a trained weight). final/ then holds both matrices.
        head.weight = nn.Parameter(head.weight.detach().clone())
        lm.config.tie_word_embeddings = False
        lm.config.get_text_config().tie_word_embeddings = False
    head.requires_grad_(True)
    return ref


# ------------------------------------------------------------------------------------------------
# LoRA


class LoraReference(nn.Module):
    """The policy's own PEFT model with its adapter disabled: the base weights, which never train. It
    holds no parameters (``dist.shard`` leaves it as is); under fsdp the policy is gathered with it."""

    reads_policy = True  # logprobs runs the policy's own LM (adapter off)

    def __init__(self, peft_lm: nn.Module, prefill_once: bool = True, fixed_passes: bool = False) -> None:
        super().__init__()
        self._lm = [peft_lm]  # not a submodule: the weights are the policy's
        # as the policy (causal.py), passes included: the same path gives the policy's bits at the start
        self.prefill_once = prefill_once and causal_prefix_supported(peft_lm)
        self.fixed_passes = fixed_passes

    @torch.no_grad()
    def logprobs(self, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                 response_mask: torch.Tensor, temperature: float) -> torch.Tensor:
        lm = self._lm[0]
        with lm.disable_adapter():
            logits, _ = response_outputs(lm, query, query_mask, response, response_mask, False, self.prefill_once,
                                         self.fixed_passes)
        return ops.logprobs_from_logits(logits.float() / temperature, response)  # (B, T)


def setup_lora(lm: nn.Module, cfg: LoraConfig, prefill_once: bool = True,
               fixed_passes: bool = False) -> tuple[nn.Module, LoraReference]:
    """Wrap ``lm`` in a PEFT LoRA model (only the adapter trains); returns it and its reference
    (``prefill_once``: ``model.prefill_once``; ``fixed_passes``: as the policy's, causal.py)."""
    try:
        import peft
    except ImportError:
        raise ConfigError("model.reference: lora needs peft: pip install 'rallyrl[lora]'") from None
    target = cfg.target_modules if isinstance(cfg.target_modules, str) else list(cfg.target_modules)
    lora = peft.LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=target,
                           task_type="CAUSAL_LM")
    try:
        peft_lm = peft.get_peft_model(lm, lora)
    except ValueError as e:  # e.g. target modules not found in the model
        raise ConfigError(f"model.lora.target_modules: {e}") from None
    peft_lm.eval()
    return peft_lm, LoraReference(peft_lm, prefill_once, fixed_passes)


def save_lora(peft_lm: nn.Module, out: Path, merge: bool, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """``final/``: the adapter (``save_pretrained`` of the PEFT model); with ``merge`` the merged model
    goes to ``final/`` and the adapter to ``final/adapter/`` (transformers would load an adapter config
    found next to a model's config.json on top of it, applying the adapter twice). ``state_dict``: the
    whole policy state dict (``lm.*``), given when ``peft_lm``'s own parameters are FSDP shards; the
    folder is then written from an unsharded copy built from it (``_unsharded_copy``)."""
    own = state_dict is None
    if not own:
        peft_lm = _unsharded_copy(peft_lm, state_dict)
    if not merge:
        peft_lm.save_pretrained(out, safe_serialization=True)
        return
    peft_lm.save_pretrained(out / "adapter", safe_serialization=True)
    # merge_and_unload() folds the adapter into the wrapped model in place: merge a copy of the policy's
    # own model, so the policy stays trainable (final/ is written at the end of training; the copy is
    # freed right after). An unsharded copy is ours to merge.
    merged = (copy.deepcopy(peft_lm) if own else peft_lm).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)


def _unsharded_copy(peft_lm: nn.Module, state_dict: dict[str, torch.Tensor]) -> nn.Module:
    """A CPU PEFT model like ``peft_lm`` (same architecture, same LoRA config) holding ``state_dict``'s
    ``lm.*`` weights: what ``save_lora`` writes under fsdp, where the policy's parameters are shards and
    PEFT's own saving and merging need whole ones. One full copy on the main rank, as ``copy`` costs."""
    import peft
    from transformers import AutoModelForCausalLM

    lm_sd = {k[len("lm."):]: v for k, v in state_dict.items() if k.startswith("lm.")}
    base = peft_lm.get_base_model()
    config = copy.deepcopy(peft_lm.peft_config[peft_lm.active_adapter])
    fresh = AutoModelForCausalLM.from_config(base.config, dtype=next(iter(lm_sd.values())).dtype)
    fresh.name_or_path = base.name_or_path  # PEFT records it as the adapter's base model, as unsharded
    out = peft.get_peft_model(fresh, config)
    out.load_state_dict(lm_sd, strict=True)
    return out.eval()
