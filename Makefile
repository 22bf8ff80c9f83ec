# make run      set up (once) and train GRPO on the built-in task: no downloads, a few minutes on a CPU
# make test     set up (once) and run the tests (GPU tests skip without CUDA)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch for CPU machines; on a GPU machine install with TORCH="" to keep the CUDA torch you have
# (then create the venv with --system-site-packages: make install VENV_FLAGS=--system-site-packages TORCH=).
TORCH ?= torch==2.13.0
VENV_FLAGS ?=

.PHONY: install run test clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q -r requirements.txt
	touch $@

run: install
	$(PY) grpo.py

test: install
	$(PY) -m pytest -q tests

clean:
	rm -rf runs .pytest_cache
