# The two commands a new user needs: `make demo` and `make test`. Both install what is
# missing first (scripts/setup_env.sh: Open MPI, torch only if absent, DeepSpeed, the package).
SHELL := /bin/bash
VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python
export PATH := $(VENV)/bin:$(PATH)
export DS_ACCELERATOR ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || echo cpu)
export OMP_NUM_THREADS ?= 1

.PHONY: install demo adapt-demo test test-fast clean

install:
	VENV="$(VENV)" bash scripts/setup_env.sh

demo: install
	$(PY) examples/demo.py

# the language-adaptation walkthrough (docs/adaptation.md): adapt, train embeddings, LEP, generate
adapt-demo: install
	$(PY) examples/adapt_language.py

test: install
	$(PY) -m pytest tests

# the edit-test loop: everything not marked slow (no tools run end to end, no ranks, no schedulers);
# under 3 minutes on 2 cores (tests/conftest.py checks it)
test-fast: install
	$(PY) -m pytest -m "not slow" tests

clean:
	rm -rf build *.egg-info megatron_ru/data/_helpers*.so megatron_ru/data/preprocess/_jsonl*.so demo_out adapt_demo_out
