"""The memory arithmetic behind docs/scaling.md "Fitting a model": per-GPU bytes of each part of a
rallyrl run for a model shape, a GPU count and the knobs, as one markdown table.

    python benchmarks/fit_model.py            # the docs' table (1B, 8B, 70B on 8 GPUs)
    python benchmarks/fit_model.py --check    # the same formulas against what was measured on SmolLM2

Reasoned, not measured: the formulas count what rallyrl holds (see the docs for each term). The
``--check`` mode compares them with the SmolLM2-135M measurements committed in benchmarks/results/.
No torch needed: the shapes are the models' published configs.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

GiB = 1024**3
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @property
    def params(self) -> int:
        h, L = self.hidden, self.layers
        attn = h * self.heads * self.head_dim * 2 + h * self.kv_heads * self.head_dim * 2  # q, o; k, v
        mlp = 3 * h * self.intermediate  # gate, up, down (SwiGLU)
        norms = 2 * h
        emb = self.vocab * h * (1 if self.tied else 2)
        return L * (attn + mlp + norms) + emb + h


# Published configs (config.json of each model).
SMOLLM2_135M = Shape("SmolLM2-135M", 30, 576, 1536, 9, 3, 64, 49152, True)
LLAMA_1B = Shape("Llama-3.2-1B", 16, 2048, 8192, 32, 8, 64, 128256, True)
LLAMA_8B = Shape("Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128, 128256, False)
LLAMA_70B = Shape("Llama-3.1-70B", 80, 8192, 28672, 64, 8, 128, 128256, False)


@dataclass(frozen=True)
class Run:
    gpus: int = 8
    sharding: str = "ddp"  # ddp | fsdp
    weight_bytes: int = 4  # model.dtype: float32 4, bfloat16 2
    compute_bytes: int = 2  # train.mixed_precision: bf16 2, no 4
    reference: str = "copy"  # copy | lora | none (beta 0: GRPO default)
    checkpointing: bool = True  # model.gradient_checkpointing
    micro_batch: int = 4  # ppo.micro_batch_size (sequences per forward/backward)
    chunk: int = 16  # rollout.chunk_size (sequences per generate call on a rank)
    seq: int = 1536  # prompt + response tokens
    response: int = 1024
    lora_fraction: float = 0.0  # trainable share of the parameters with lora (~0.5% at r=16 all-linear)
    reward_params: float = 0.0  # a reward model's parameters, held in bf16 by the reward host (rank 0) only


def parts(m: Shape, r: Run) -> dict[str, float]:
    """Per-GPU bytes of each part, the largest rank (rank 0 holds the reward host in addition)."""
    P = m.params
    shard = r.gpus if r.sharding == "fsdp" else 1
    trainable = P * r.lora_fraction if r.reference == "lora" else P
    out: dict[str, float] = {}
    out["weights"] = P * r.weight_bytes / shard
    if r.reference == "lora":  # the adapter's own weights, in float32
        out["weights"] += trainable * 4 / shard
    out["gradients"] = trainable * 4 / shard  # in the dtype of the (trainable, float32) parameters
    out["AdamW moments"] = trainable * 8 / shard  # two float32 moments
    out["reference"] = P * r.weight_bytes / shard if r.reference == "copy" else 0.0
    # Generation and scoring under fsdp gather one whole model (in the compute dtype) at a time.
    out["gathered model (fsdp, transient)"] = P * r.compute_bytes if r.sharding == "fsdp" else 0.0
    # KV cache of one generate call: K and V per layer, per kv head, in the compute dtype.
    out["KV cache (generation)"] = 2 * m.layers * m.kv_heads * m.head_dim * r.compute_bytes * r.chunk * r.seq
    # Activations kept for backward, per micro-batch. With checkpointing: each block's input, plus one
    # block's full activations during its recomputation. Without: ~34 bytes per token per hidden unit per
    # layer at 16 bits (Korthikanti et al. 2022, with fused attention: no s^2 term), x2 at 32 bits.
    tokens = r.micro_batch * r.seq
    per_layer_full = 34 / 2 * r.compute_bytes * tokens * m.hidden
    if r.checkpointing:
        out["activations (update)"] = m.layers * tokens * m.hidden * r.compute_bytes + per_layer_full
    else:
        out["activations (update)"] = m.layers * per_layer_full
    # The loss math reads float32 logits at the response positions: logits, log-softmax and its gradient.
    out["logits (update, fp32)"] = 3 * r.micro_batch * r.response * m.vocab * 4
    out["reward model (rank 0 only, bf16)"] = r.reward_params * 2
    return out


RESTING = ("weights", "AdamW moments", "reference", "reward model (rank 0 only, bf16)")
GENERATION = ("gathered model (fsdp, transient)", "KV cache (generation)")
UPDATE = ("gradients", "activations (update)", "logits (update, fp32)")


def peak(p: dict[str, float]) -> float:
    """What is held at rest, plus the larger of the two phases: generation/scoring (a gathered model and
    the KV cache) and the update (gradients, activations, logits); the two never overlap."""
    return sum(p[k] for k in RESTING) + max(sum(p[k] for k in GENERATION), sum(p[k] for k in UPDATE))


def gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def table(rows: list[tuple[str, Shape, Run]]) -> str:
    keys = list(parts(rows[0][1], rows[0][2]))
    head = "| part (GiB per GPU) | " + " | ".join(label for label, _, _ in rows) + " |"
    lines = [head, "|---" * (len(rows) + 1) + "|"]
    all_parts = [parts(m, r) for _, m, r in rows]
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(gib(p[k]) for p in all_parts) + " |")
    lines.append("| **peak** (at rest + the larger phase) | "
                 + " | ".join(f"**{gib(peak(p))}**" for p in all_parts) + " |")
    return "\n".join(lines)


def docs_rows() -> list[tuple[str, Shape, Run]]:
    return [
        ("1B: ddp, bf16, copy", LLAMA_1B, Run(sharding="ddp", checkpointing=False, reward_params=LLAMA_1B.params)),
        ("8B: ddp, bf16, AC, copy", LLAMA_8B, Run(sharding="ddp", reward_params=LLAMA_8B.params)),
        ("8B: fsdp, bf16, AC, copy", LLAMA_8B, Run(sharding="fsdp", reward_params=LLAMA_8B.params)),
        ("70B: fsdp, bf16, AC, copy", LLAMA_70B, Run(sharding="fsdp", micro_batch=1, chunk=8,
                                                    reward_params=LLAMA_8B.params)),
        ("70B: fsdp, bf16 weights, AC, lora", LLAMA_70B,
         Run(sharding="fsdp", weight_bytes=2, reference="lora", lora_fraction=0.005, micro_batch=1, chunk=8,
             reward_params=LLAMA_8B.params)),
    ]


def check() -> None:
    """The formulas against the SmolLM2-135M measurements committed in benchmarks/results/."""
    m = SMOLLM2_135M
    print(f"{m.name}: {m.params / 1e6:.1f} M parameters from the shape")
    print(f"  float32 weights, formula: {m.params * 4 / 2**20:.1f} MiB; measured `memory/params_bytes` under fsdp "
          f"at 2 processes (policy + value head + reference, each half): 513.1 MiB per rank (docs/scaling.md)")
    path = ROOT / "benchmarks/results/activation_checkpointing.json"
    if path.exists():
        res = json.loads(path.read_text())
        print(f"  activation checkpointing, measured: {json.dumps(res.get('summary', res))[:400]}")
    r_off = Run(sharding="ddp", compute_bytes=4, reference="none", checkpointing=False, micro_batch=2, seq=288,
                response=256)
    r_on = Run(**{**r_off.__dict__, "checkpointing": True})
    off, on = parts(m, r_off)["activations (update)"], parts(m, r_on)["activations (update)"]
    print(f"  formula, batch 2 x (32 + 256) tokens, float32: activations {off / 2**20:.0f} MiB without checkpointing, "
          f"{on / 2**20:.0f} MiB with: saving {(off - on) / 2**20:.0f} MiB (measured saving: 2619 - 1919 = 700 MiB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare the formulas with the SmolLM2 measurements")
    args = ap.parse_args()
    if args.check:
        check()
        return
    for _, m, _ in docs_rows():
        print(f"{m.name}: {m.params / 1e9:.2f} B parameters")
    print(table(docs_rows()))


if __name__ == "__main__":
    main()
