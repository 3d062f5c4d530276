"""The memory arithmetic of docs/scaling.md "Fitting a model" (benchmarks/fit_model.py)."""

from __future__ import annotations

from benchmarks import fit_model as fm


def test_parameter_counts_match_the_published_models() -> None:
    # The published parameter counts of these checkpoints: the shape formula must reproduce them exactly,
    # or every row of the docs' table is off.
    assert fm.LLAMA_1B.params == 1_235_814_400
    assert fm.LLAMA_8B.params == 8_030_261_248
    assert fm.LLAMA_70B.params == 70_553_706_496
    # SmolLM2-135M: the logged memory/params_bytes per fsdp rank at 2 processes was 513.1 MiB (one fp32 copy).
    assert round(fm.SMOLLM2_135M.params * 4 / 2**20, 1) == 513.1


def test_fsdp_divides_the_state_and_adds_one_gathered_model() -> None:
    ddp, fsdp = fm.Run(sharding="ddp"), fm.Run(sharding="fsdp", gpus=8)
    a, b = fm.parts(fm.LLAMA_8B, ddp), fm.parts(fm.LLAMA_8B, fsdp)
    for k in ("weights", "gradients", "AdamW moments", "reference"):
        assert b[k] * 8 == a[k]
    assert a["gathered model (fsdp, transient)"] == 0
    assert b["gathered model (fsdp, transient)"] == fm.LLAMA_8B.params * 2  # bf16 compute


def test_lora_and_beta0_drop_the_reference_and_most_state() -> None:
    lora = fm.parts(fm.LLAMA_8B, fm.Run(reference="lora", lora_fraction=0.01))
    copy = fm.parts(fm.LLAMA_8B, fm.Run(reference="copy"))
    assert lora["reference"] == 0 and copy["reference"] == copy["weights"]
    assert lora["AdamW moments"] == copy["AdamW moments"] / 100
    assert fm.parts(fm.LLAMA_8B, fm.Run(reference="none"))["reference"] == 0


def test_checkpointing_keeps_block_inputs_only() -> None:
    on = fm.parts(fm.LLAMA_8B, fm.Run(checkpointing=True))["activations (update)"]
    off = fm.parts(fm.LLAMA_8B, fm.Run(checkpointing=False))["activations (update)"]
    assert on < off / 10


def test_peak_is_rest_plus_the_larger_phase() -> None:
    p = fm.parts(fm.LLAMA_8B, fm.Run(sharding="fsdp"))
    rest = p["weights"] + p["AdamW moments"] + p["reference"] + p["reward model (rank 0 only, bf16)"]
    gen = p["gathered model (fsdp, transient)"] + p["KV cache (generation)"]
    upd = p["gradients"] + p["activations (update)"] + p["logits (update, fp32)"]
    assert fm.peak(p) == rest + max(gen, upd) < sum(p.values())


def test_docs_table_is_the_scripts_output() -> None:
    from pathlib import Path

    doc = (Path(fm.ROOT) / "docs/scaling.md").read_text()
    assert fm.table(fm.docs_rows()) in doc
