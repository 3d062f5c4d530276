"""Generation time of one chunk of groups with ``generation.prefill_once`` on and off, on SmolLM2-135M
(examples/sentiments' model): ``--prompts`` distinct prompts of about ``--prompt-tokens`` tokens, each
repeated G = ``--group`` times (one chunk of prompts x G rows), sampled as in training (temperature 1,
no top-k/top-p) for each of ``--new-tokens``.

Both settings run in this one process through the HF engine (``rallyrl.rollout.HFEngine``, the rollout step's own
generation call, stop handling and decoding included), alternating off / on ``--pairs`` times with the
same seed in each pair, after one warm-up call of each. The ratio is the median of the per-pair ratios
off / on (> 1: prefilling once is faster).

    .venv/bin/python benchmarks/group_prefill.py [--group 8] [--prompts 4] [--new-tokens 32 64]
        [--pairs 5] [--threads 2] [--out runs/bench/group_prefill.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ENV, machine  # noqa: E402

# Four openings of ordinary English text; each prompt is one of them cut to about --prompt-tokens tokens.
TEXTS = [
    "The old lighthouse stood at the end of the harbour wall, and every evening the keeper climbed its "
    "winding stairs to light the lamp. Fishermen coming home in the dark steered by it, and children on "
    "the beach counted the seconds between its flashes. One winter a storm broke the great lens, and for "
    "a week the town argued about who should pay for a new one, while the boats stayed in port and the "
    "keeper polished brass that no longer had any light to carry across the water.",
    "Our team spent the spring rewriting the billing service. The old code had grown for ten years "
    "without tests, and every change to an invoice template risked breaking the tax rules of some other "
    "country. We started by writing down what the service actually did, case by case, then built a "
    "small set of examples that any new version had to reproduce exactly, down to the last cent and the "
    "order of the lines on the page, before anyone was allowed to touch the database schema.",
    "To make a good loaf of bread you need only flour, water, salt and yeast, but the way you combine "
    "them matters more than the ingredients. Mix the flour and water first and let them rest for half "
    "an hour, so the flour can absorb the water on its own. Then add the salt and the yeast, knead the "
    "dough until it is smooth and elastic, and leave it somewhere warm until it has doubled in size, "
    "which can take anything from one hour to three depending on the kitchen.",
    "The committee met on Tuesday to review the proposal for the new cycling lanes along the river. "
    "Several residents spoke in favour, pointing out that the current road is dangerous for children "
    "riding to school, while the owners of two shops worried that removing parking spaces would drive "
    "their customers away. After a long discussion the committee asked the engineers to prepare a "
    "second plan that keeps some parking on the north side and to count the traffic for a month.",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--new-tokens", type=int, nargs="+", default=[32, 64])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/bench/group_prefill.json")
    args = p.parse_args()
    import os

    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    import torch

    from examples.sentiments.prepare import smollm2_dir
    from rallyrl.config import GenerationConfig, ModelConfig
    from rallyrl.models import load_models
    from rallyrl.rollout import HFEngine, SamplingSpec, run_episodes

    torch.set_num_threads(args.threads)
    m = load_models(ModelConfig(path=str(smollm2_dir())), seed=0, reference=False)
    tok = m.tokenizer
    # prompts of slightly different lengths, so the chunk is left-padded as in training
    prompts = [tok(TEXTS[i % len(TEXTS)]).input_ids[: args.prompt_tokens - 2 * i] for i in range(args.prompts)]
    rows = [q for q in prompts for _ in range(args.group)]  # a group's G members are consecutive
    cpu = torch.device("cpu")
    results = []
    for new in args.new_tokens:
        gens = {on: GenerationConfig(max_new_tokens=new, prefill_once=on) for on in (False, True)}

        def run(on: bool, seed: int) -> tuple[float, int]:
            torch.manual_seed(seed)
            t0 = time.perf_counter()
            g = run_episodes(HFEngine(m.policy, tok, cpu, on), tok, rows, SamplingSpec.of(gens[on], True, tok))
            return time.perf_counter() - t0, sum(len(r) for r in g.response_lists)

        run(False, 0), run(True, 0)  # warm-up
        times: dict[bool, list[float]] = {False: [], True: []}
        tokens: dict[bool, list[int]] = {False: [], True: []}
        for pair in range(args.pairs):
            for on in (False, True):
                s, n = run(on, 1 + pair)
                times[on].append(s)
                tokens[on].append(n)
            print(f"new tokens {new}, pair {pair}: off {times[False][-1]:.2f} s, on {times[True][-1]:.2f} s",
                  flush=True)
        ratio = statistics.median(a / b for a, b in zip(times[False], times[True]))
        results.append({"new_tokens": new, "off_s": times[False], "on_s": times[True],
                        "off_median_s": statistics.median(times[False]), "on_median_s": statistics.median(times[True]),
                        "tokens_off": tokens[False], "tokens_on": tokens[True], "speedup": ratio})
        print(f"new tokens {new}: off {results[-1]['off_median_s']:.2f} s, on {results[-1]['on_median_s']:.2f} s, "
              f"speedup {ratio:.2f}x (median of {args.pairs} per-pair ratios)", flush=True)
    out = {"settings": vars(args) | {"model": "SmolLM2-135M-Instruct", "dtype": "float32",
                                     "prompt_lengths": [len(q) for q in prompts], "rows": len(rows)},
           "machine": machine(), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
