# `make run`: set up .venv if needed, fetch the embedded model if needed, run the demo.
# `make test`: set up .venv if needed, run the test suite.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvcompress-installed

.PHONY: run test setup model clean

$(STAMP): pyproject.toml scripts/setup.sh
	VENV=$(VENV) bash scripts/setup.sh
	touch $@

setup: $(STAMP)

model: $(STAMP)
	$(PY) -m kvcompress.cli fetch-model

run: model
	$(PY) -m kvcompress.cli demo

test: model
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
