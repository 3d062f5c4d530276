"""What generation costs on an FSDP-sharded policy (model.sharding: fsdp), against a whole replica (ddp).

    .venv/bin/python benchmarks/fsdp_generate.py [--model PATH] [--nproc 2] [--batch 4] [--new-tokens 16]
                                                 [--repeats 3] [--out runs/bench/fsdp_generate.json]

``--nproc`` processes (gloo on CPU) each build the policy (``rallyrl.models.load_models``: LM + value
head) from ``--model`` (default: a locally built 2-layer, 64-dim GPT-2), and time the policy's generation (``policy.run`` of ``lm.generate``, as the HF engine decodes)
on the same ``--batch`` prompts, ``--new-tokens`` tokens each (``min_new_tokens`` = max, so every rank
decodes the same number of steps), three ways, in one run:

- ``replica``: the unsharded policy, as every rank holds it under ddp. The baseline.
- ``gathered``: the sharded policy inside ``rallyrl.dist.gathered`` (what rallyrl does): every FSDP
  unit (each transformer block, the root) is all-gathered once, generation runs on whole weights with
  no collective, then the weights are resharded. L + 1 all-gathers per call for L blocks.
- ``per_step``: the sharded policy with FSDP2's own forward hooks only: every block is all-gathered
  before and freed after each of its forwards, i.e. (L + 1) x new-tokens all-gathers per call, but
  never more than one block whole at a time. (rallyrl does not use it: ranks decoding different
  numbers of steps would need a per-step "done" all-reduce, transformers' ``synced_gpus``.)

Reported: the median seconds per call of each, and each as a ratio to ``replica`` (the number to
read: the machine is shared, absolute times are noisy). All ranks produce the same tokens in the three
modes (checked: the gathered weights are the weights).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _generate(policy, ids, mask, **kw):
    """The response ids of ``policy.lm.generate`` (what the HF engine runs, through ``policy.run``)."""
    return policy.lm.generate(input_ids=ids, attention_mask=mask, **kw)[:, ids.shape[1]:]


def _worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.nproc),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(args.nproc))
    import torch

    from rallyrl import dist
    from rallyrl.config import ModelConfig
    from rallyrl.models import load_models

    dist.init_accelerator(60.0, sharding="fsdp")  # the gloo group, and dist.shard / gathered shard as in training
    torch.set_num_threads(1)
    models = load_models(ModelConfig(path=args.model), seed=0)
    replica = load_models(ModelConfig(path=args.model), seed=0).policy
    # transformer blocks: the classes the model lists in _no_split_modules, FSDP's units besides the root
    names = {n for m in models.policy.modules() for n in (getattr(m, "_no_split_modules", None) or [])}
    L = sum(type(m).__name__ in names for m in models.policy.modules())
    policy = dist.shard(models.policy, forward_methods=("run",))  # the engine decodes through run
    assert dist.is_sharded()
    tok = models.tokenizer
    texts = ["the cat sat", "a dog ran in", "good morning", "what a lovely"] * (args.batch // 4 + 1)
    enc = tok(texts[: args.batch], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
              pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)

    def run(mode: str) -> tuple[float, list[list[int]]]:
        dist.barrier()
        t0 = time.perf_counter()
        if mode == "replica":
            ids = _generate(replica, enc.input_ids, enc.attention_mask, **kw)
        elif mode == "gathered":
            with dist.gathered(policy):
                ids = policy.run(_generate, enc.input_ids, enc.attention_mask, **kw)
        else:
            ids = policy.run(_generate, enc.input_ids, enc.attention_mask, **kw)
        return time.perf_counter() - t0, ids.tolist()

    modes = ("replica", "gathered", "per_step")
    times: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, list[list[int]]] = {}
    run("gathered")  # warm-up: FSDP's lazy init, allocator
    for _ in range(args.repeats):
        for m in modes:
            dt, ids = run(m)
            times[m].append(dt)
            tokens[m] = ids
    same = tokens["replica"] == tokens["gathered"] == tokens["per_step"]
    if rank == 0:
        med = {m: statistics.median(v) for m, v in times.items()}
        result = {"model": args.model, "nproc": args.nproc, "batch": args.batch, "new_tokens": args.new_tokens,
                  "blocks": L, "seconds_per_call": med,
                  "ratio_to_replica": {m: med[m] / med["replica"] for m in modes},
                  "all_gathers_per_call": {"replica": 0, "gathered": L + 1, "per_step": (L + 1) * args.new_tokens},
                  "same_tokens": same, "load_average": os.getloadavg()}
        Path(out).write_text(json.dumps(result, indent=1))
    dist.shutdown()  # a last barrier, then the group is destroyed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="runs/bench/fsdp_generate.json")
    args = ap.parse_args()
    for k, v in {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}.items():
        os.environ.setdefault(k, v)
    if args.model is None:
        from rallyrl.testing import build_tiny_gpt2

        args.model = str(build_tiny_gpt2(Path(tempfile.mkdtemp()) / "gpt2"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.multiprocessing as mp

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    mp.spawn(_worker, args=(args, port, args.out), nprocs=args.nproc, join=True)
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
