# Quick start: `make demo` runs the main job end to end; `make test` runs the suite.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.cloudckpt-installed
URL    ?=

.PHONY: venv demo test test-compat lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	touch $(STAMP)

demo: venv
	$(BIN)/python examples/demo.py $(if $(URL),--url $(URL))

test: venv
	$(BIN)/python tests/servers.py install-azurite >/dev/null  # Azure emulator, from npm
	$(BIN)/python -m pytest -q --durations=15

# The Lightning tests again against the oldest Lightning we support (2.4).
LIGHTNING_MIN ?= 2.4.0
test-compat: venv
	test -d .cache/lightning-$(LIGHTNING_MIN) || $(BIN)/python -m pip install -q --no-deps \
		--target .cache/lightning-$(LIGHTNING_MIN) lightning==$(LIGHTNING_MIN)
	PYTHONPATH=.cache/lightning-$(LIGHTNING_MIN) $(BIN)/python -m pytest -q tests/lightning

lint: venv
	$(BIN)/ruff check
	$(BIN)/ruff format --check
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache .mypy_cache
