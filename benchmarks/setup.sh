#!/usr/bin/env bash
# Create .venv-bench/: rallyrl (editable) + trl 1.12.0, kept apart from the project's .venv.
# torch is pinned and installed FIRST: 2.13.0 is a local CPU build here; an unpinned torch (or one
# pulled in by trl) would be a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-bench}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
# trl 1.12.0 is the last release with PPOTrainer (trl.experimental.ppo); its PPO module needs requests.
"$VENV/bin/pip" install -q -e . 'trl==1.12.0' requests
if ! "$VENV/bin/pip" list 2>/dev/null | grep -E '^torch +2\.13\.0\+cpu$' >/dev/null; then
    echo "setup.sh: torch was replaced; expected torch 2.13.0+cpu:" >&2
    "$VENV/bin/pip" list 2>/dev/null | grep -i torch >&2
    exit 1
fi
"$VENV/bin/pip" list 2>/dev/null | grep -E '^(torch|transformers|accelerate|trl|datasets) '
