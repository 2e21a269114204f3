# Every target creates .venv and installs into it first, so each works on a
# fresh machine. torch is pinned to the CPU wheel these machines carry.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
BACKENDS ?= tensorflow jax torch
PYTEST_ARGS ?=
KERAS_HUB := keras-hub>=0.32,<0.33
TORCH_CPU := torch==2.13.0+cpu
INSTALL = $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) \
	$${PIP_FIND_LINKS:+--find-links $$PIP_FIND_LINKS}

.PHONY: venv demo test test-compat lint bench fuzz clean slurm

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# uv installs the same versions as pip did (compared: the same list but
	# for newer patch releases), in parallel, bytecode compiled as pip does:
	# 45 s here where pip took 150.
	$(PY) -m pip install -q --upgrade pip uv
	# The CPU build first, by its local version: asked for as plain
	# torch==2.13.0, the resolver, once it backtracks over s3fs and
	# aiobotocore, settles on PyPI's CUDA build (3.4 GB of nvidia-* and
	# triton). These machines carry the CPU wheel (pip's find-links, which
	# uv is handed); elsewhere, PyTorch's CPU index
	# (UV_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu) has it.
	$(INSTALL) "$(TORCH_CPU)"
	# The backends' CPU builds, named here: the package's extras leave the
	# build to the user.
	$(INSTALL) tensorflow-cpu "jax[cpu]"
	$(INSTALL) -e ".[test]"
	$(PY) -c 'import torch, sys; sys.exit(torch.version.cuda and "a CUDA build of torch was installed: see the Makefile")'
	# KerasHub for the workload tests, without tensorflow-text (the full
	# tensorflow wheel) and kagglehub: models built from configs need neither.
	$(INSTALL) --no-deps "$(KERAS_HUB)"
	touch $(STAMP)

venv: $(STAMP)

# Debian's SLURM and munge for tests/test_slurm.py (a real controller and node
# on 127.0.0.1), where this machine can install them (root, apt-get); the
# tests say why they are skipped where it cannot.
slurm:
	@command -v slurmctld >/dev/null || test -x /usr/sbin/slurmctld || { \
	  test "$$(id -u)" = 0 && command -v apt-get >/dev/null && \
	  apt-get update -qq >/dev/null && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge \
	    >/dev/null; } || echo "SLURM not installed: tests/test_slurm.py is skipped"

demo: venv
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m keras_ft.demo

lint: venv
	$(VENV)/bin/ruff check keras_ft tests benchmarks examples
	$(VENV)/bin/ruff format --check keras_ft tests benchmarks examples

# Each backend's test files in PARTS pytest processes of about equal time
# (Keras fixes its backend at import time), LANES at a time, the longest
# first: each keeps about one core busy (see .ci/suites). Each process's log
# is printed whole when it ends, and the failures again at the end, so the
# tail of the output says what failed. EXTRA_JOBS=compat runs test-compat in
# a lane too (CI does). PARTS=1 where PYTEST_ARGS names test files.
LANES ?= 2
PARTS ?= 3
EXTRA_JOBS ?=
test: venv lint slurm
	PY=$(PY) JOBS="$(BACKENDS) $(EXTRA_JOBS)" LANES=$(LANES) PARTS=$(PARTS) \
		PYTEST_ARGS="$(PYTEST_ARGS)" bash .ci/suites

# The core subset on the oldest Keras pyproject.toml declares and on
# keras-nightly, every backend (see .ci/compat).
test-compat: venv
	bash .ci/compat

bench: venv
	$(PY) benchmarks/save_cost.py
	$(PY) benchmarks/accelerator.py --quick  # On a GPU machine: without --quick.
	$(PY) benchmarks/fit_split.py --quick  # On a GPU machine: without --quick.
	$(PY) benchmarks/recycling.py  # Whether reusing retired checkpoints pays.
	$(PY) benchmarks/batch_ends.py  # Between saves: Keras' dispatch ahead kept.
	$(PY) benchmarks/cluster_saves.py  # 2 JAX processes: each one's time held up.
	$(PY) benchmarks/cluster_saves.py --backend tensorflow
	$(PY) -m pip install -q obstore  # Only to compare against s3fs.
	$(PY) benchmarks/object_storage.py
	$(PY) -m pip install -q orbax-checkpoint  # Keras' OrbaxCheckpoint, the peer.
	$(PY) benchmarks/orbax_peer.py
	$(PY) benchmarks/orbax_peer.py --every-epoch --epochs 3 --batches 4 --rounds 1
	$(PY) benchmarks/sharded.py --units 4096  # 1, 2, 4 JAX processes, ModelParallel, 19M.
	$(PY) benchmarks/sharded.py --bucket  # Into a local S3 server, beside Orbax; a local tier.
	$(PY) benchmarks/scaling.py  # 5M to 200M parameters (cold restores need root).
	$(PY) benchmarks/failures.py  # Detection, torchrun relaunch, goodput under kills.
	$(PY) benchmarks/recovery.py  # Relaunch to the batch killed: 3 inputs, 3 kill points.

# SIGKILL at random moments, keras-ft vs Keras' own callback: `make fuzz BACKEND=jax`.
BACKEND ?= tensorflow
fuzz: venv
	$(PY) benchmarks/kill_fuzz.py --trials 200 --keras-trials 40 --backend $(BACKEND)

clean:
	rm -rf $(VENV) .venv-keras-* .venv-lowest-* build *.egg-info .pytest_cache .ruff_cache
