# meshtrain: `make train` and `make test` do all set-up themselves (a .venv beside this file).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
EXTRAS ?= dev
# The CPU build here; on a GPU machine, TORCH_SPEC= keeps the torch that is already installed. The extras install
# without compiling every module to bytecode (transformers' hundreds of models, wandb, DeepSpeed: 43 s → 26 s here):
# a process compiles what it imports, and writes it for the next unless PYTHONDONTWRITEBYTECODE says not to (0.4 s
# more a process then, for meshtrain's own imports beyond torch's, which torch's install compiled).
TORCH_SPEC ?= torch==2.13.0
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: train test test-fast test-gpu lint docs venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_SPEC),$(PY) -m pip install -q "$(TORCH_SPEC)")
	$(PY) -m pip install -q --no-compile -e ".[$(EXTRAS)]"
	touch $@

# The main job: Shakespeare (shipped, no network) on every local device (2 DDP ranks on a CPU-only
# box), nanoGPT's CPU recipe; prints samples and where the run, its checkpoint and metrics are.
TRAIN_ARGS ?= preset=cpu
train: $(STAMP)
	$(VENV)/bin/meshtrain prepare shakespeare_char
	$(VENV)/bin/meshtrain launch -- python -m meshtrain train gpt $(TRAIN_ARGS)

# PYTHONDONTWRITEBYTECODE cleared: where the environment sets it, each of the suite's hundreds of processes would
# compile meshtrain's sources again (0.25 s a process here). Two pytest workers: the suite's jobs leave a core idle a
# third of the time on 2 cores (imports, rendezvous, waits for timeouts). Three were tried on 2 cores: 802 s natively
# (AVX-512) but 1314 s under slow-cpu (the AVX2-only kind), where two took 1209 s: the slow kind decides. --dist
# loadfile keeps each test file on one worker, in its order (the docs' lines build on the ones above them; a
# multi-node module loses its node last).
test: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n 2 --dist loadfile

# The unit tier alone: no test that starts a process (torchrun, mpirun, a subprocess), nothing marked slow.
test-fast: $(STAMP)
	$(PY) -m pytest tests/unit -m "not distributed and not slow"

# On a GPU machine, offline: meshtrain into the python3 that already has a CUDA build of torch (no venv, no download;
# WHEELS=DIR adds the pure-Python packages that python lacks: omegaconf, antlr4-python3-runtime, torchao), then
# tests/gpu: the test that times the GPU by itself, then the others side by side in GPU_WORKERS processes (their
# models are tiny: one GPU runs eight of them at once). docs/gpu.md says how to gather the wheels.
GPU_WORKERS ?= 8
test-gpu:
	$(if $(WHEELS),$(PYTHON) -m pip install -q --no-index --no-deps $(wildcard $(WHEELS)/*.whl))
	$(PYTHON) -m pip install -q --no-index --no-deps --no-build-isolation -e .
	$(PYTHON) -m pytest tests/gpu -m alone; alone=$$?; \
	$(PYTHON) -m pytest tests/gpu -m "not alone" -n $(GPU_WORKERS) --dist load --durations=10 && exit $$alone

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples

# The API reference: the public API, meshtrain's __all__, as HTML (open outputs/docs/api/index.html). Submodules
# are internal and left out; a warning fails the build (tests/unit/test_docs.py builds the same). PDOC_ALLOW_EXEC
# lets libraries that run a program as they are imported (h5py asks `uname -p`) do so.
docs: $(STAMP)
	rm -rf outputs/docs/api
	PDOC_ALLOW_EXEC=1 $(PY) -W error -m pdoc meshtrain '!meshtrain\.' -o outputs/docs/api

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache src/*.egg-info
