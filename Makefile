# Tandem: `make serve` runs the main job, `make test` runs the test suite.
# Both set up a virtual environment first (torch 2.13.0 CPU, then the project).

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tandem-installed

.PHONY: setup serve test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

node_modules/.package-lock.json: package.json
	npm install --no-audit --no-fund --loglevel=error

serve: setup
	$(VENV)/bin/tandem serve

test: setup $(if $(wildcard package.json),node_modules/.package-lock.json)
	@command -v docker-compose >/dev/null || apt-get install -y -q docker-compose >/dev/null 2>&1 \
		|| echo "note: docker-compose is not installable here; its static compose check is skipped"
	$(PY) -m ruff check .
	$(PY) -m pytest -q

bench: setup
	$(PY) -m benchmarks.offline_throughput

clean:
	rm -rf $(VENV) node_modules .pytest_cache .ruff_cache
