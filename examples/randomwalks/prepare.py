"""Pretrain the randomwalks policy: a tiny GPT-2 that imitates a random walker.

The model is trained from scratch with the causal-LM loss on fresh random walks
from :func:`task.random_walks`, each formatted as ``walk + <|eos|>``, so it learns
to follow existing edges uniformly at random and to stop after reaching the goal
(or after ``MAX_LENGTH`` nodes). Sampled at temperature 1 it behaves like a
random walker; PPO then has to teach it to take shortest paths.

The result (``save_pretrained``: safetensors + config + generation config +
tokenizer + ``prepare.json``) is cached in ``out_dir``: when ``out_dir`` already
holds a model whose ``prepare.json`` has the same settings fingerprint, nothing
is trained. Training happens in a temporary sibling directory that is renamed
into place at the end, so an interrupted run never leaves a broken cache.

CLI::

    python examples/randomwalks/prepare.py [--out DIR] [--seed 0] [--force] [--eval]

Default ``out_dir``: ``$RALLYRL_RANDOMWALKS_MODEL`` if set, else
``<repo>/.cache/randomwalks/model``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Union

if __package__ in (None, ""):  # run as a script: make `examples.randomwalks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.randomwalks import task  # noqa: E402
from examples.randomwalks.tokenizer import build_tokenizer, vocab  # noqa: E402

FORMAT_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parents[2]
ENV_VAR = "RALLYRL_RANDOMWALKS_MODEL"

# Model and training settings (all part of the cache fingerprint).
MODEL_SETTINGS: Dict[str, Any] = dict(n_layer=2, n_head=2, n_embd=64, n_positions=16)
TRAIN_SETTINGS: Dict[str, Any] = dict(steps=800, batch_size=128, lr=3e-3, warmup=50, weight_decay=0.0)
GRAPH_SETTINGS: Dict[str, Any] = dict(seed=task.DEFAULT_SEED, n_nodes=task.DEFAULT_N_NODES, p=task.DEFAULT_P)

__all__ = ["default_model_dir", "settings", "fingerprint", "is_prepared", "prepare_model", "main"]


def default_model_dir() -> Path:
    """``$RALLYRL_RANDOMWALKS_MODEL`` or ``<repo>/.cache/randomwalks/model``."""
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else REPO_ROOT / ".cache" / "randomwalks" / "model"


def settings(seed: int = 0) -> Dict[str, Any]:
    """Everything that determines the prepared model."""
    graph = task.build_graph(**GRAPH_SETTINGS)
    return {
        "format_version": FORMAT_VERSION,
        "graph": dict(
            GRAPH_SETTINGS,
            seed_used=graph.seed,
            max_length=graph.max_length,
            edges={u: "".join(sorted(vs)) for u, vs in graph.adjacency.items()},
        ),
        "tokenizer": sorted(vocab(GRAPH_SETTINGS["n_nodes"]).items(), key=lambda kv: kv[1]),
        "model": dict(MODEL_SETTINGS),
        "train": dict(TRAIN_SETTINGS, seed=seed),
    }


def fingerprint(seed: int = 0) -> str:
    blob = json.dumps(settings(seed), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "prepare.json")


def is_prepared(out_dir: Union[str, Path], seed: int = 0) -> bool:
    """Whether ``out_dir`` holds a complete model with the current fingerprint."""
    out_dir = Path(out_dir)
    if not all((out_dir / f).is_file() for f in _REQUIRED_FILES):
        return False
    try:
        info = json.loads((out_dir / "prepare.json").read_text())
    except (OSError, ValueError):
        return False
    return info.get("fingerprint") == fingerprint(seed)


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """Exclusive inter-process lock (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _n_threads() -> int:
    """Torch threads for pretraining: ``$RALLYRL_RANDOMWALKS_THREADS`` or 1.

    The model is tiny, so a second thread gains little (~1.5x on an idle
    2-core machine) and, when other processes share the cores, spin-waiting
    threads can make steps 10x slower; one thread is the robust default.
    """
    try:
        return max(1, int(os.environ.get("RALLYRL_RANDOMWALKS_THREADS", "1")))
    except ValueError:
        return 1


def _encode_batch(walks, tok, max_len: int):
    """``walk + eos`` right-padded to ``max_len``; labels are -100 on padding."""
    import torch

    ids = torch.full((len(walks), max_len), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(walks), max_len), -100, dtype=torch.long)
    mask = torch.zeros((len(walks), max_len), dtype=torch.long)
    for i, w in enumerate(walks):
        row = tok.convert_tokens_to_ids(list(w)) + [tok.eos_token_id]
        n = len(row)
        ids[i, :n] = torch.tensor(row)
        labels[i, :n] = ids[i, :n]
        mask[i, :n] = 1
    return ids, mask, labels


def _train(tmp_dir: Path, seed: int, progress: bool) -> Dict[str, Any]:
    import torch

    prev_threads = torch.get_num_threads()
    torch.set_num_threads(_n_threads())
    try:
        return _train_loop(tmp_dir, seed, progress)
    finally:
        torch.set_num_threads(prev_threads)


def _train_loop(tmp_dir: Path, seed: int, progress: bool) -> Dict[str, Any]:
    import torch
    from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    graph = task.build_graph(**GRAPH_SETTINGS)
    tok = build_tokenizer(GRAPH_SETTINGS["n_nodes"])
    cfg = GPT2Config(
        vocab_size=len(tok),
        **MODEL_SETTINGS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = GPT2LMHeadModel(cfg)
    model.train()
    ts = TRAIN_SETTINGS
    opt = torch.optim.AdamW(model.parameters(), lr=ts["lr"], weight_decay=ts["weight_decay"], betas=(0.9, 0.98))

    def lr_at(step: int) -> float:  # linear warmup, then cosine decay to 0
        if step < ts["warmup"]:
            return (step + 1) / ts["warmup"]
        frac = (step + 1 - ts["warmup"]) / max(1, ts["steps"] - ts["warmup"])
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    rng = random.Random(seed)
    max_len = graph.max_length + 1
    log_every = max(1, ts["steps"] // 10)
    t0 = time.time()
    running = None
    for step in range(ts["steps"]):
        walks = task.random_walks(graph, ts["batch_size"], rng)
        ids, mask, labels = _encode_batch(walks, tok, max_len)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        value = float(loss.detach())
        running = value if running is None else 0.9 * running + 0.1 * value
        if progress and ((step + 1) % log_every == 0 or step == 0):
            print(
                f"[randomwalks] step {step + 1}/{ts['steps']} loss {value:.4f} (avg {running:.4f}) "
                f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.1f}s",
                flush=True,
            )
    train_s = time.time() - t0

    # Final loss on a fixed held-out batch of fresh walks (comparable across runs).
    model.eval()
    held = task.random_walks(graph, 4096, random.Random(10_000 + seed))
    ids, mask, labels = _encode_batch(held, tok, max_len)
    with torch.no_grad():
        final_loss = float(model(input_ids=ids, attention_mask=mask, labels=labels).loss)

    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=graph.max_length - 1,
    )
    model.save_pretrained(tmp_dir, safe_serialization=True)
    tok.save_pretrained(tmp_dir)
    return {
        "steps": ts["steps"],
        "final_loss": final_loss,
        "train_loss_avg": running,
        "entropy_floor": walk_entropy(graph, 4096, 10_000 + seed),
        "train_seconds": round(train_s, 2),
        "n_params": sum(p.numel() for p in model.parameters()),
        "torch_threads": torch.get_num_threads(),
    }


def walk_entropy(graph: task.Graph, n: int, seed: int) -> float:
    """Mean per-token entropy (nats) of the walk + eos distribution over the
    same tokens the LM loss averages: the best achievable final loss."""
    walks = task.random_walks(graph, n, random.Random(seed))
    total, count = 0.0, 0
    for w in walks:
        for i in range(len(w)):  # predicting token i+1 (a node or eos) from w[: i + 1]
            count += 1
            if w[i] != graph.goal and i + 1 < graph.max_length:
                total += math.log(len(graph.adjacency[w[i]]))
    return total / count


def prepare_model(
    out_dir: Union[str, Path, None] = None,
    *,
    seed: int = 0,
    force: bool = False,
    progress: bool = True,
    evaluate: bool = False,
) -> Path:
    """Pretrain (or reuse) the randomwalks policy in ``out_dir`` and return its path.

    ``out_dir`` defaults to :func:`default_model_dir`. With ``force`` the cache is
    ignored. With ``evaluate`` the pretrained model's optimality is measured
    (see ``evaluate.py``) and stored in ``prepare.json`` under ``"eval"``.
    """
    out_dir = Path(out_dir) if out_dir is not None else default_model_dir()
    out_dir = out_dir.expanduser().resolve()
    if not force and is_prepared(out_dir, seed):
        if progress:
            print(f"[randomwalks] using cached model in {out_dir}", flush=True)
        return out_dir
    with _lock(out_dir.parent / f".{out_dir.name}.lock"):
        if not force and is_prepared(out_dir, seed):  # someone else finished meanwhile
            return out_dir
        for stale in list(out_dir.parent.glob(f".{out_dir.name}.tmp-*")) + list(
            out_dir.parent.glob(f".{out_dir.name}.old-*")
        ):  # left by a killed run; writers hold the lock, so none is in use
            shutil.rmtree(stale, ignore_errors=True)
        t0 = time.time()
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(parents=True)
            info = _train(tmp, seed, progress)
            s = settings(seed)
            info = {
                "fingerprint": fingerprint(seed),
                "graph_seed": s["graph"]["seed"],
                "graph_seed_used": s["graph"]["seed_used"],
                "train_seed": seed,
                **info,
                "settings": s,
            }
            if evaluate:
                from examples.randomwalks.evaluate import evaluate_model

                info["eval"] = evaluate_model(tmp)
            info["prepare_seconds"] = round(time.time() - t0, 2)
            (tmp / "prepare.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
            old = None
            if out_dir.exists():
                old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
                os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        if progress:
            print(
                f"[randomwalks] prepared {out_dir} in {time.time() - t0:.1f}s "
                f"(final loss {info['final_loss']:.4f}, floor {info['entropy_floor']:.4f})",
                flush=True,
            )
            if evaluate:
                print(f"[randomwalks] eval {json.dumps(info['eval'])}", flush=True)
    return out_dir


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help=f"model directory (default: ${ENV_VAR} or .cache/randomwalks/model)")
    ap.add_argument("--seed", type=int, default=0, help="training seed")
    ap.add_argument("--force", action="store_true", help="retrain even if cached")
    ap.add_argument("--eval", action="store_true", help="measure optimality of the pretrained model")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    out = prepare_model(args.out, seed=args.seed, force=args.force, progress=not args.quiet, evaluate=args.eval)
    if args.eval and not args.quiet:
        info = json.loads((out / "prepare.json").read_text())
        if "eval" not in info:  # cached model prepared without --eval
            from examples.randomwalks.evaluate import evaluate_model

            print(f"[randomwalks] eval {json.dumps(evaluate_model(out))}", flush=True)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
