# Two entry points for a fresh machine: `make demo` (the local cluster on the tiny checkpoint) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
ARTIFACTS ?= artifacts

.PHONY: venv test lint proto demo tiny clean

$(STAMP): pyproject.toml deploy/constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned (TORCH_VERSION, as in deploy/Dockerfile): on CPU machines the local CPU wheel; GPU
	# images already ship >= 2.11. Everything else at the versions of deploy/constraints.txt, as in the images.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==$(TORCH_VERSION)"
	$(PIP) install -q -c deploy/constraints.txt -e ".[test]"
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
