# Two entry points (see README): `make demo` and `make test`. Both install what they need first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
SITE = $(shell $(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
export DEEP_EP_PYTHON := $(abspath $(PY))
TORCH_PIN := torch==2.11.0
CUDA_PIN := cuda-toolkit[nvcc,nvvm,crt,cccl,cudart]==13.0.2
NCCL_PIN := nvidia-nccl-cu13==2.28.9
# bindgen's libclang from PyPI (self-contained clang/native/libclang.so): no system package, no root.
CLANG_PIN := libclang==18.1.1
TEST_PIPS := pytest numpy expecttest hypothesis
LIB := target/release/libdeep_ep.so
PYTEST_ENV := PYTHONPATH=python DEEP_EP_LIBRARY=$(abspath $(LIB))
MODELS := build/models
TCH_DIR := examples/tch_server

.PHONY: demo test deps build install wheel wheel-test lint rust-test rust-example rust-model-test py-test cpp-test gpu-test compat compat-newest scale-cpu clean

demo: build
	$(PYTEST_ENV) $(PY) examples/moe_demo.py --ranks 4

test: build rust-test rust-example py-test cpp-test rust-model-test gpu-test

# Python venv with torch (the CUDA 13 wheel is PyPI's default), nvcc, NCCL and libclang (bindgen),
# all from PyPI: nothing outside the venv, no root. Re-runs only when this Makefile changes.
deps: $(VENV)/.deps-ok
$(VENV)/.deps-ok: Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)" "$(CUDA_PIN)" "$(NCCL_PIN)" "$(CLANG_PIN)" $(TEST_PIPS) setuptools wheel cmake
	touch $@

build: deps
	cargo build --release

install: deps
	$(PY) -m pip install --no-build-isolation .

# dist/deep_ep_rs-*.whl: the Python package with libdeep_ep.so inside (built with this venv's torch).
wheel: deps
	rm -rf dist
	$(PY) -m pip wheel -q --no-build-isolation --no-deps -w dist .

# The installed wheel, not the source tree: a new venv holding only torch (and the test tools), the
# wheel installed into it, the CPU suite run with no PYTHONPATH or DEEP_EP_LIBRARY
# (DEEP_EP_TEST_INSTALLED=1 makes conftest check that deep_ep_rs comes from site-packages).
WHEEL_VENV ?= .venv-wheel
WHEEL_TORCH ?= $(TORCH_PIN)
WHEEL_PIP_ARGS ?=
wheel-test: wheel
	rm -rf $(WHEEL_VENV) && python3 -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q $(WHEEL_PIP_ARGS) "$(WHEEL_TORCH)" $(TEST_PIPS)
	$(WHEEL_VENV)/bin/python -m pip install -q --no-deps dist/deep_ep_rs-*.whl
	cd /tmp && env -u PYTHONPATH -u DEEP_EP_LIBRARY $(abspath $(WHEEL_VENV))/bin/python -c \
	  'import deep_ep_rs, torch; print("wheel:", deep_ep_rs.__file__, deep_ep_rs.library_path(), "torch", torch.__version__)'
	env -u PYTHONPATH -u DEEP_EP_LIBRARY DEEP_EP_TEST_INSTALLED=1 $(WHEEL_VENV)/bin/python -m pytest tests/python -q

# No import circles between files of src/ and no broken layer rule (scripts/import_graph.py: window/ and sys/
# never import backend/, api/ never a backend type), cargo fmt and clippy (clippy runs build.rs, so it needs the venv; the dev profile keeps its
# build-script outputs apart from the release build's, so the two do not rebuild each other).
lint: deps
	python3 scripts/import_graph.py --check
	@# Files <= 800 lines (STYLE): every tracked file but the measurement records under bench/results.
	@git ls-files -z | grep -zv '^bench/results/' | xargs -0 wc -l | awk '$$2 != "total" && $$1 > 800 {print "over 800 lines:", $$2; bad = 1} END {exit bad}'
	cargo fmt --check
	cargo fmt --check --manifest-path $(TCH_DIR)/Cargo.toml
	cargo clippy --all-targets -- -D warnings

rust-test: deps
	cargo test --release

# The crate's Rust API directly (examples/rank_threads.rs): 2 rank threads on the CPU backend.
rust-example: deps
	cargo run --release --example rank_threads

py-test: build
	$(PYTEST_ENV) $(PY) -m pytest tests/python -q

# C++ examples (examples/cpp_server): CMake build against the venv's libtorch, then 2 processes on
# the CPU backend (HT dispatch/combine + LL decode step, checked against a reference), then
# model_server: a TorchScript model and an AOTInductor package made by a Python process, loaded
# and run with no Python against the C++ process's own buffer (slot 0), checked bit for bit.
CPP_BUILD := build/cpp_server
cpp-test: build $(MODELS)/.ok
	$(VENV)/bin/cmake -S examples/cpp_server -B $(CPP_BUILD) -DCMAKE_BUILD_TYPE=Release \
	  -DTORCH_ROOT=$$($(PY) -c 'import torch,os;print(os.path.dirname(torch.__file__))') >/dev/null
	$(VENV)/bin/cmake --build $(CPP_BUILD) -j 4
	CUDA_VISIBLE_DEVICES= DEEP_EP_TIMEOUT_MS=60000 $(CPP_BUILD)/cpp_server --ranks 2 --lib $(abspath $(LIB))
	CUDA_VISIBLE_DEVICES= $(CPP_BUILD)/model_server --dir $(MODELS) --lib $(abspath $(LIB))

# Artifacts made by a Python process for the C++ and Rust servers: examples/moe_layer.py scripted,
# exported and AOT-compiled by examples/export_moe_layer.py, with its inputs and outputs.
$(MODELS)/.ok: $(LIB) examples/export_moe_layer.py examples/moe_layer.py
	rm -rf $(MODELS) && mkdir -p $(MODELS)
	CUDA_VISIBLE_DEVICES= $(PYTEST_ENV) $(PY) examples/export_moe_layer.py $(MODELS)
	touch $@

# The Rust server (examples/tch_server, its own crate: tch 0.24 + anyhow) runs the TorchScript model
# with no Python, against its own buffer bound to slot 0; tch builds against the venv's torch.
rust-model-test: build $(MODELS)/.ok
	cd $(TCH_DIR) && LIBTORCH_USE_PYTORCH=1 PATH=$(abspath $(VENV))/bin:$$PATH cargo build --release -q
	CUDA_VISIBLE_DEVICES= LD_LIBRARY_PATH=$$($(PY) -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib \
	  $(TCH_DIR)/target/release/deep_ep_tch_server --dir $(MODELS) --lib $(abspath $(LIB))

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

# CPU reference past one NVLink domain, beyond CI's 16 ranks (docs/RANKS.md): the LL backend at
# 16, 32 and 64 rank threads (also in rust-test, under a second each) and internode normal mode
# at 32 and 64 rank processes (domains of 8) against the reference. Measured on 2 cores, 24 GiB:
# 32 ranks 57 s, 64 ranks 151 s (peak about 20 GiB: one torch process per rank).
SCALE_WORLDS ?= 32 64
scale-cpu: build
	cargo test --release ranks_match_reference
	DEEP_EP_SCALE_WORLDS="$(SCALE_WORLDS)" $(PYTEST_ENV) $(PY) -m pytest tests/python/test_internode.py -q -k "full_nodes and not 16"

# GPU tier: runs only where CUDA devices are visible (skipped with a message otherwise).
gpu-test: build
	@if $(PY) -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then \
	  $(PYTEST_ENV) $(PY) -m pytest tests/gpu -q; \
	else echo "gpu-test: no CUDA device visible, GPU tier skipped"; fi

clean:
	cargo clean
