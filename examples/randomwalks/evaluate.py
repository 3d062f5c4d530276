"""Measure a randomwalks policy: optimality of its walks on the eval prompts.

``python examples/randomwalks/evaluate.py [MODEL_DIR]`` prints, for sampled
(temperature 1, top_k 0, top_p 1) and greedy decoding, the mean optimality on
:func:`task.eval_prompts` (20 nodes x 10), the fraction of valid walks and the
generation time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.randomwalks import task  # noqa: E402

__all__ = ["generate_walks", "evaluate_model", "main"]


def generate_walks(model, tok, prompts: List[str], *, do_sample: bool, seed: int = 0) -> List[str]:
    """Outputs (text after the prompt, special tokens removed) for ``prompts``."""
    import torch

    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    if seed is not None:
        torch.manual_seed(seed)
    kw: Dict[str, Any] = dict(do_sample=do_sample, max_new_tokens=task.MAX_LENGTH - 1)
    if do_sample:
        kw.update(temperature=1.0, top_k=0, top_p=1.0)
    with torch.no_grad():
        out = model.generate(
            input_ids=enc.input_ids,
            attention_mask=enc.attention_mask,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            **kw,
        )
    return tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)


def _summary(graph: task.Graph, prompts: List[str], outputs: List[str], seconds: float) -> Dict[str, Any]:
    opts = [task.optimality(graph, p, o) for p, o in zip(prompts, outputs)]
    status = Counter(task.walk_status(graph, p + o) for p, o in zip(prompts, outputs))
    bad_edge = sum(v for k, v in status.items() if k in ("bad_edge", "bad_char", "after_goal", "empty"))
    return {
        "optimality": sum(opts) / len(opts),
        "valid_fraction": status["ok"] / len(opts),  # finished walks on existing edges
        "edges_ok_fraction": 1 - bad_edge / len(opts),  # only existing edges (finished or not)
        "status": dict(sorted(status.items())),
        "generate_seconds": round(seconds, 3),
    }


def evaluate_model(
    model_dir: Union[str, Path],
    *,
    n_per_node: int = 10,
    seed: int = 0,
    graph: Optional[task.Graph] = None,
) -> Dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    graph = graph or task.default_graph()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = task.eval_prompts(graph, n_per_node)
    result: Dict[str, Any] = {
        "n_prompts": len(prompts),
        "random_walker_optimality": task.expected_random_walk_optimality(graph),
    }
    for name, do_sample in (("sampled", True), ("greedy", False)):
        t0 = time.time()
        outputs = generate_walks(model, tok, prompts, do_sample=do_sample, seed=seed)
        result[name] = _summary(graph, prompts, outputs, time.time() - t0)
    return result


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir", nargs="?", default=None)
    ap.add_argument("--n-per-node", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.model_dir is None:
        from examples.randomwalks.prepare import default_model_dir

        args.model_dir = default_model_dir()
    print(json.dumps(evaluate_model(args.model_dir, n_per_node=args.n_per_node, seed=args.seed), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
