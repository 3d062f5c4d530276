# Both targets create .venv if missing. torch is pinned and installed first: 2.13.0 is a local CPU
# build on our machines; an unpinned torch would pull a multi-GB CUDA build.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean-venv

$(PY):
	python3 -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,server]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/randomwalks/run.py

test: $(STAMP)
	$(PY) -m pytest -q tests

clean-venv:
	rm -rf $(VENV)
