# Two entry points (see README): `make demo` and `make test`. Both install what they need first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
SITE = $(shell $(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
export DEEP_EP_PYTHON := $(abspath $(PY))
TORCH_PIN := torch==2.11.0
CUDA_PIN := cuda-toolkit[nvcc,nvvm,crt,cccl,cudart]==13.0.2
NCCL_PIN := nvidia-nccl-cu13==2.28.9
LIB := target/release/libdeep_ep.so
PYTEST_ENV := PYTHONPATH=python DEEP_EP_LIBRARY=$(abspath $(LIB))

.PHONY: demo test deps build install rust-test rust-example py-test cpp-test gpu-test compat compat-newest clean

demo: build
	$(PYTEST_ENV) $(PY) examples/moe_demo.py --ranks 4

test: build rust-test rust-example py-test cpp-test gpu-test

# Python venv with torch (the CUDA 13 wheel is PyPI's default), nvcc and NCCL from pip, and
# libclang for bindgen. Re-runs only when this Makefile changes.
deps: $(VENV)/.deps-ok
$(VENV)/.deps-ok: Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)" "$(CUDA_PIN)" "$(NCCL_PIN)" pytest numpy expecttest hypothesis setuptools wheel cmake
	@if ! ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1 && ! ls /usr/lib/x86_64-linux-gnu/libclang*.so* >/dev/null 2>&1; then \
	  echo "installing libclang-dev (bindgen)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libclang-dev) || \
	  (sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libclang-dev); fi
	touch $@

build: deps
	cargo build --release

install: deps
	$(PY) -m pip install --no-build-isolation .

rust-test: deps
	cargo test --release

# The crate's Rust API directly (examples/rank_threads.rs): 2 rank threads on the CPU backend.
rust-example: deps
	cargo run --release --example rank_threads

py-test: build
	$(PYTEST_ENV) $(PY) -m pytest tests/python -q

# C++ example (examples/cpp_server): CMake build against the venv's libtorch, then 2 processes on
# the CPU backend (HT dispatch/combine + LL decode step, checked against a reference).
CPP_BUILD := build/cpp_server
cpp-test: build
	$(VENV)/bin/cmake -S examples/cpp_server -B $(CPP_BUILD) -DCMAKE_BUILD_TYPE=Release \
	  -DTORCH_ROOT=$$($(PY) -c 'import torch,os;print(os.path.dirname(torch.__file__))') >/dev/null
	$(VENV)/bin/cmake --build $(CPP_BUILD) -j 4
	CUDA_VISIBLE_DEVICES= DEEP_EP_TIMEOUT_MS=60000 $(CPP_BUILD)/cpp_server --ranks 2 --lib $(abspath $(LIB))

# One binary across torch versions: the CPU suite runs against the SAME libdeep_ep.so (built once
# against $(TORCH_PIN)) under $(TORCH_PIN) (py-test) and under the newest torch on PyPI in a
# separate venv. COMPAT_TORCH / COMPAT_PIP_ARGS pick another torch (e.g. the CPU wheel index).
COMPAT_VENV ?= .venv-compat
COMPAT_TORCH ?= torch==2.15.0
COMPAT_PIP_ARGS ?=
compat: py-test compat-newest

compat-newest: build
	test -x $(COMPAT_VENV)/bin/python || python3 -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q $(COMPAT_PIP_ARGS) "$(COMPAT_TORCH)" pytest numpy expecttest hypothesis
	@echo "compat: $(LIB) sha256 $$(sha256sum $(LIB) | cut -c1-16) (built against $(TORCH_PIN)) under torch $$($(COMPAT_VENV)/bin/python -c 'import torch;print(torch.__version__)')"
	$(PYTEST_ENV) $(COMPAT_VENV)/bin/python -m pytest tests/python -q

# GPU tier: runs only where CUDA devices are visible (skipped with a message otherwise).
gpu-test: build
	@if $(PY) -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then \
	  $(PYTEST_ENV) $(PY) -m pytest tests/gpu -q; \
	else echo "gpu-test: no CUDA device visible, GPU tier skipped"; fi

clean:
	cargo clean
