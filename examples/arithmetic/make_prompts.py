"""Write the arithmetic example's prompt files from the seeded generator (``task.py``).

    python examples/arithmetic/make_prompts.py [--n-train 512] [--n-eval 100] [--seed 0] [--out-dir DIR]

Each problem becomes one conversational prompt, ``[{"role": "system", ...}, {"role": "user", "content":
question + instruction}]``, which rallyrl renders with the model's chat template
(``add_generation_prompt=True``; docs/reward.md, "Conversational prompts"). Rows:
``{"prompt": messages, "question": ..., "answer": int}``; ``answer`` reaches the reward and metric
functions as a metadata column. The output is deterministic: the shipped files are what this script
writes with its defaults (a unit test checks them against the generator).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.arithmetic import task  # noqa: E402

HERE = Path(__file__).resolve().parent
# A short system message: SmolLM2's template would otherwise add its 20-token default one, and shorter
# prompts make every forward pass of the run cheaper on CPU.
SYSTEM = "You are a helpful assistant."


def messages(question: str) -> list[dict[str, str]]:
    """The chat turn of one problem."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{question} {task.INSTRUCTION}"}]


def rows(problems: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"prompt": messages(p["question"]), "question": p["question"], "answer": p["answer"]} for p in problems]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-train", type=int, default=512)
    ap.add_argument("--n-eval", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-operand", type=int, default=9)
    ap.add_argument("--out-dir", type=Path, default=HERE)
    args = ap.parse_args(argv)
    train, evals = task.train_and_eval(args.n_train, args.n_eval, args.seed, max_operand=args.max_operand)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out_dir / "prompts.jsonl", rows(train))
    write_jsonl(args.out_dir / "eval_prompts.jsonl", rows(evals))
    print(f"wrote {len(train)} training and {len(evals)} eval prompts to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
