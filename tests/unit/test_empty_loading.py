"""load_models(empty=True) (model.sharding: fsdp): the model tree is built without weights, and the state
dict rank 0 would send into the shards is exactly what the usual loading gives, tied embeddings, the
seeded value head, dtype casts and non-persistent buffers (rotary inv_freq) included; folders it cannot
read that way fall back to the usual loading with a note saying why."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rallyrl import dist
from rallyrl.config import ModelConfig
from rallyrl.models import load_models
from rallyrl.models.weights import safetensors_files


def _both(path, **model):
    cfg = ModelConfig(path=str(path), **model)
    return load_models(cfg, seed=5, empty=True), load_models(cfg, seed=5)


def _assert_same(full_sd, sd):
    assert sd.keys() == full_sd.keys()
    for k in full_sd:
        assert sd[k].dtype == full_sd[k].dtype, k
        assert torch.equal(sd[k], full_sd[k]), k


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_rank0_state_dict_equals_the_usual_loading(name, tiny_model, tiny_llama, tmp_path):
    from rallyrl.testing import build_tiny_t5

    path = {"gpt2": tiny_model, "llama": tiny_llama}.get(name) or build_tiny_t5(tmp_path / "t5")
    empty, full = _both(path, value_head="mlp", **({"arch": "seq2seq"} if name == "t5" else {}))
    assert empty.weights is not None and not empty.note
    lm_params = list(empty.policy.lm.parameters()) + list(empty.reference.lm.parameters())
    assert lm_params and all(p.is_meta for p in lm_params)  # nothing read, nothing allocated
    _assert_same(full.policy.state_dict(), empty.weights.full_state_dict(empty.policy))  # value head included
    _assert_same(full.reference.state_dict(), empty.weights.full_state_dict(empty.reference))
    # ties survive the empty build (the shards keep one tensor per tie); the reference is frozen
    tied = lambda m: {tuple(v) for v in _names_by_param(m).values() if len(v) > 1}  # noqa: E731
    assert tied(empty.policy) == tied(full.policy)
    assert not any(p.requires_grad for p in empty.reference.parameters())
    # buffers (none persistent here) are built, not loaded: the same values as from_pretrained's
    bufs = dict(empty.policy.named_buffers())
    assert bufs.keys() == dict(full.policy.named_buffers()).keys()
    for k, b in full.policy.named_buffers():
        assert not bufs[k].is_meta and torch.equal(bufs[k], b), k
    if name == "llama":
        assert any(k.endswith("inv_freq") for k in bufs)
    assert empty.policy.lm.generation_config.to_dict() == full.policy.lm.generation_config.to_dict()


def _names_by_param(module):
    out = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(n)
    return out


def test_dtype_and_no_reference(tiny_llama):
    """model.dtype: bfloat16 from float32 files (cast on rank 0, as from_pretrained casts); no value head
    and no reference (GRPO with beta 0): only the LM's keys."""
    cfg = ModelConfig(path=str(tiny_llama), dtype="bfloat16")
    empty = load_models(cfg, seed=1, value_head=False, reference=False, empty=True)
    full = load_models(cfg, seed=1, value_head=False, reference=False)
    assert empty.reference is None and empty.policy.v_head is None
    sd = empty.weights.full_state_dict(empty.policy)
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}
    _assert_same(full.policy.state_dict(), sd)


def test_sharded_index_and_base_model_prefix(tiny_model, tmp_path):
    """A model.safetensors.index.json over two files whose names lack the base model's prefix (as old
    GPT-2 checkpoints): read the same as from_pretrained reads it."""
    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    sd = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(sd)
    parts = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for f, keys in parts.items():
        save_file({k.removeprefix("transformer."): sd[k] for k in keys}, folder / f, metadata={"format": "pt"})
        weight_map |= {k.removeprefix("transformer."): f for k in keys}
    import json
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert safetensors_files(folder) == [folder / "a.safetensors", folder / "b.safetensors"]
    empty, full = _both(folder)
    assert empty.weights is not None, empty.note
    _assert_same(full.policy.state_dict(), empty.weights.full_state_dict(empty.policy))


def test_folders_it_cannot_read_straight_into_shards_load_as_usual(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from rallyrl.models.weights import empty_lm

    # *.bin weights only: loaded the usual way (every rank whole, as before), with the reason
    bin_dir = tmp_path / "bin"
    shutil.copytree(tiny_model, bin_dir)
    torch.save(load_file(bin_dir / "model.safetensors"), bin_dir / "pytorch_model.bin")
    (bin_dir / "model.safetensors").unlink()
    m = load_models(ModelConfig(path=str(bin_dir)), seed=0, empty=True)
    assert m.weights is None and "no model.safetensors or model.safetensors.index.json" in m.note, m.note
    assert not any(p.is_meta for p in m.policy.parameters())
    # a weight under a name the model does not have, or of another shape: transformers would convert it
    ln1, lnf = "transformer.h.0.ln_1.weight", "transformer.ln_f.weight"
    for case, says in (("renamed", f"not in its safetensors files under these names: {ln1}"),
                       ("reshaped", f"shapes differ: {lnf} [10] vs [64]")):
        folder = tmp_path / case
        shutil.copytree(tiny_model, folder)
        sd = load_file(folder / "model.safetensors")
        if case == "renamed":
            sd["transformer.h.0.ln_1.gamma"] = sd.pop(ln1)
        else:
            sd[lnf] = sd[lnf][:10].clone()
        save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
        lm, weights, why = empty_lm(AutoModelForCausalLM, str(folder), torch.float32)
        assert lm is None and weights is None and says in why, why


def test_shared_and_lora_references_load_as_usual(tiny_model):
    m = load_models(ModelConfig(path=str(tiny_model), reference="shared", num_layers_unfrozen=1), seed=0, empty=True)
    assert m.weights is None and "model.reference: shared" in m.note
    assert not any(p.is_meta for p in m.policy.parameters())


def test_an_empty_model_is_only_loaded_into_shards(tiny_model):
    m = load_models(ModelConfig(path=str(tiny_model)), seed=0, empty=True)
    with pytest.raises(RuntimeError, match="loaded only into shards"):
        dist.shard(m.policy, weights=m.weights)
