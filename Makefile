# `make run`: set up .venv if needed, fetch the embedded model if needed, run the demo.
# `make test`: set up .venv if needed, run the test suite.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvcompress-installed

VLLM_VENV ?= .venv-vllm

.PHONY: run test setup model clean vllm

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

# `make vllm`: opt-in, not part of `make test`. vLLM's CPU build pins its own torch and transformers,
# so it gets its own venv; PyPI's torchvision does not load beside the CPU torch wheel and is not used.
vllm: model
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 -e ".[vllm,dev]"
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -m pytest -q tests/test_vllm.py
	$(VLLM_VENV)/bin/python scripts/vllm_check.py --out runs/vllm_check.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) build src/*.egg-info .pytest_cache
