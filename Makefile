# `make run`: set up .venv if needed, fetch the embedded model if needed, run the demo.
# `make lint`: ruff (lint, import order, lines under 120) over the code, mypy over the cache, storage and methods.
# `make test`: set up .venv if needed, run the test suite (a worker per core, each test file on one worker so the
# files' shared models are built once; tests/conftest.py splits the cores' threads among the workers).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvcompress-installed

VLLM_VENV ?= .venv-vllm
KVPRESS_VENV ?= .venv-kvpress
QUICK := runs/kvpress-quick

.PHONY: run test test-isa lint setup model clean vllm vllm-test kvpress

$(STAMP): pyproject.toml scripts/setup.sh
	VENV=$(VENV) bash scripts/setup.sh
	touch $@

setup: $(STAMP)

model: $(STAMP)
	$(PY) -m kvcompress.cli fetch-model

run: model
	$(PY) -m kvcompress.cli demo

test: model
	$(PY) -m pytest -q -n auto --dist loadfile

# `make test-isa`: the CPU kernel's and the coded paths' tests under each CPU capability ATen dispatches to (its
# vectorized kernels differ by ISA; the kernel's own build is -march=native), as CI runs them.
ISA_TESTS := tests/test_cpu_kernel.py tests/test_codec.py

test-isa: model
	for cap in default avx2 avx512; do ATEN_CPU_CAPABILITY=$$cap $(PY) -m pytest -q $(ISA_TESTS) || exit 1; done

lint: $(STAMP)
	$(PY) -m ruff check src tests scripts
	$(PY) -m ruff format --check src tests scripts
	$(PY) -m mypy

# `make vllm`: vLLM's CPU build pins its own torch and transformers, so it gets its own venv (never a dependency of
# the package); PyPI's torchvision does not load beside the CPU torch wheel and is not used. `make vllm-test` (CI's
# second part, after `make test`) runs the vLLM tests: the plugin, `kvcompress serve` with the openai client, and one
# server's soak of 60 requests. `make vllm` runs them with a soak of 200, then the comparison with the library and the
# serving benchmark's quick setting; `.venv-vllm/bin/kvcompress serve` starts the server.
VLLM_STAMP := $(VLLM_VENV)/.kvcompress-installed
VLLM_TESTS := tests/test_vllm.py tests/test_vllm_soak.py

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 -e ".[vllm,dev]"
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $@

vllm-test: model $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q --timeout 1200 $(VLLM_TESTS)

vllm: model $(VLLM_STAMP)
	KVCOMPRESS_SOAK_REQUESTS=200 $(VLLM_VENV)/bin/python -m pytest -q --timeout 3600 $(VLLM_TESTS)
	$(VLLM_VENV)/bin/python scripts/vllm_check.py --out runs/vllm_check.json
	$(VLLM_VENV)/bin/python scripts/serve_bench.py --requests 4 --tokens 1000 --pool-prompts 2 --out runs/serve_bench_quick/serve_bench.json

# `make kvpress`: opt-in, never a dependency. kvpress (transformers < 5.3) in its own venv answers the
# question-agnostic track's questions beside kvcompress, on the same samples and weights
# (scripts/peers/kvpress_agnostic.py; docs/accuracy.md has the full commands). The quick setting: one
# 1K-token needle, budget 64. optimum-quanto: transformers' QuantizedCache under the presses (run --cache quanto:4).
kvpress: model
	test -x $(KVPRESS_VENV)/bin/python || python3 -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/pip install -q torch==2.13.0 kvpress==0.5.5 optimum-quanto==0.2.7
	$(PY) -m kvcompress.cli bench accuracy --question-agnostic --tasks niah --lengths 1000 --depths 0.5 --haystack essays \
		--methods full,kvzip:layers=global --budgets 64 --out $(QUICK)
	$(PY) scripts/peers/kvpress_agnostic.py samples --tasks niah --lengths 1000 --depths 0.5 --out $(QUICK)/samples.jsonl
	$(KVPRESS_VENV)/bin/python scripts/peers/kvpress_agnostic.py run --samples $(QUICK)/samples.jsonl --budgets 64 --out $(QUICK)/kvpress_answers.jsonl
	$(PY) scripts/peers/kvpress_agnostic.py score --samples $(QUICK)/samples.jsonl --answers $(QUICK)/kvpress_answers.jsonl --results $(QUICK)/results.jsonl
	$(PY) scripts/tables.py retained $(QUICK)/results.jsonl

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(KVPRESS_VENV) build src/*.egg-info .pytest_cache
