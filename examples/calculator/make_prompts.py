"""Write the calculator example's prompt files from the seeded generator (``task.py``).

    python examples/calculator/make_prompts.py [--n-train 512] [--n-eval 100] [--seed 0] [--out-dir DIR]

Each problem becomes one conversational prompt: the system message, the worked example
(``task.EXAMPLE``) and the question. Rows: ``{"prompt": messages, "question": ..., "answer": int}``;
``answer`` reaches the reward and metric functions as a metadata column. Deterministic: the shipped files
are what this script writes with its defaults (a unit test checks them).
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

from examples.calculator import task  # noqa: E402

HERE = Path(__file__).resolve().parent


def rows(problems: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"prompt": [{"role": "system", "content": task.SYSTEM}, *task.EXAMPLE,
                        {"role": "user", "content": p["question"]}],
             "question": p["question"], "answer": p["answer"]} for p in problems]


def write(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-train", type=int, default=512)
    ap.add_argument("--n-eval", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=HERE)
    args = ap.parse_args(argv)
    train, held_out = task.train_and_eval(args.n_train, args.n_eval, args.seed)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write(args.out_dir / "prompts.jsonl", rows(train))
    write(args.out_dir / "eval_prompts.jsonl", rows(held_out))


if __name__ == "__main__":
    main()
