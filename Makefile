# Two entry points for a fresh machine: `make demo` (the local cluster on the tiny checkpoint) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
ARTIFACTS ?= artifacts

.PHONY: venv test lint proto demo tiny clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: on CPU machines 2.13.0 is the local CPU wheel; GPU images already ship >= 2.11.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. \
		proto/inkling_epd/v1/*.proto

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q -ra --timeout=900

tiny: $(STAMP)
	$(VENV)/bin/inkling-epd make-tiny $(ARTIFACTS)/tiny --nvfp4 --seed 0

demo: $(STAMP)
	$(PY) -m tools.demo --workdir $(ARTIFACTS)

clean:
	rm -rf $(ARTIFACTS) .pytest_cache
