# recxla: the two commands of the README are `make run` and `make test`; both set everything up
# first (idempotent), so they work on a fresh clone.
SHELL := /bin/bash
PYTHON_SYSTEM ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMPS := .stamps
# FBGEMM's CUDA build cannot be imported without an NVIDIA driver (libnvidia-ml.so.1); its CPU
# variant is FBGEMM's own build for such machines.
HAVE_NVIDIA_DRIVER := $(shell ldconfig -p 2>/dev/null | grep -q 'libnvidia-ml.so.1' && echo 1)
FBGEMM := $(if $(HAVE_NVIDIA_DRIVER),fbgemm-gpu==1.9.0,fbgemm-gpu-cpu==1.9.0)
export MAX_JOBS ?= $(shell nproc)
NPROC ?= 2

# `make run`: the trainer on NPROC ranks, recxla then two TorchRec baselines on the same model and
# data, each planned by TorchRec's own planner: fp32 as shipped, and its strongest configuration
# (bf16 comms and DDP's bf16 compress hook); then the three side by side, with recxla's ratio to
# the faster baseline (figures and chart under RUN_DIR).
RUN_DIR ?= build/run
RUN_ARGS ?= --steps 50 --warmup-steps 10 --batch-size 1024 --eval-batches 4
TORCHRUN := $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC)

.PHONY: setup build run demo test bench bench-cluster gpu-campaign gpu-campaign-dry-run clean

$(STAMPS)/venv:
	mkdir -p $(STAMPS)
	$(PYTHON_SYSTEM) -m venv $(VENV)
	touch $@

$(STAMPS)/deps: $(STAMPS)/venv requirements/base.txt requirements/test.txt requirements/ray.txt \
		requirements/iceberg.txt
	$(PIP) install -q -r requirements/base.txt -r requirements/test.txt -r requirements/ray.txt \
		-r requirements/iceberg.txt
	# torchrec names fbgemm-gpu as a dependency: install it alone, next to the FBGEMM variant
	# this machine can load.
	$(PIP) install -q --no-deps $(FBGEMM) torchrec==1.9.2
	touch $@

# An editable install (recxla imports from this tree, triton_kernels/ as recxla.triton_kernels)
# of the package alone: pip would compile the extension in a temporary folder it deletes, and
# the build below would compile every unit again.
$(STAMPS)/install: $(STAMPS)/deps setup.py pyproject.toml
	RECXLA_SKIP_EXTENSION=1 flock .build.lock $(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

# The one compile of the extension, in place; later source changes rebuild only what changed
# (ninja keeps the objects under build/).
$(STAMPS)/build: $(STAMPS)/install setup.py $(shell find csrc -type f 2>/dev/null)
	flock .build.lock $(PY) setup.py -q build_ext --inplace
	$(PY) -c "import recxla._C"
	touch $@

setup: $(STAMPS)/build

build: setup

run: setup
	mkdir -p $(RUN_DIR)
	$(TORCHRUN) -m recxla.train $(RUN_ARGS) --metrics $(RUN_DIR)/recxla.json
	$(TORCHRUN) -m recxla.train $(RUN_ARGS) --baseline torchrec --metrics $(RUN_DIR)/torchrec.json
	$(TORCHRUN) -m recxla.train $(RUN_ARGS) --baseline torchrec --baseline-comms bf16 \
	  --dense-allreduce bf16 --label "torchrec bf16+AR" --metrics $(RUN_DIR)/torchrec_bf16.json
	$(PY) -m recxla.train --compare $(RUN_DIR)/torchrec.json $(RUN_DIR)/torchrec_bf16.json \
	  $(RUN_DIR)/recxla.json \
	  --chart $(RUN_DIR)/compare.png

# The quantized all-to-all alone on 2 gloo ranks (recxla/demo.py).
demo: setup
	$(PY) -m recxla.demo

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) -m pytest -q bench --benchmark-only --benchmark-columns=min,median,mean,rounds

bench-cluster: setup
	$(PY) -m bench.cluster.run_a2a

# The GPU campaign (docs/gpu.md), on a GPU machine with its own python3 and torch (no venv: the
# campaign builds recxla against that torch): build, GPU tests on both backends, sanitizers,
# kernel variants and benchmarks, the trainer on one GPU; report in bench/results/gpu.md, logs
# in $OUT (else build/gpu_campaign). Without a GPU it runs, then fails at its env stage.
GPU_PYTHON ?= python3
gpu-campaign:
	$(GPU_PYTHON) -m bench.gpu_campaign

# The campaign's dry run here: every stage that needs no GPU (tests/test_gpu_campaign.py).
gpu-campaign-dry-run: setup
	$(PY) -m bench.gpu_campaign --dry-run

clean:
	rm -rf build $(STAMPS) recxla/_C*.so *.egg-info
