#!/usr/bin/env bash
# What a GPU must show for the GPU step loop (docs/gpu.md, "To verify on a
# GPU"), in pieces that each fit one call of a lent machine (< 10 min).
# Run on the GPU machine after the install recipe in docs/gpu.md:
#
#   ops/gpu-verify.sh tests     # the gpu-marked tests, Triton compiled
#   ops/gpu-verify.sh step      # bench step: graphs / no graphs, planned ahead, floors;
#                               # a mixed step eager / one graph / per-layer pieces
#   ops/gpu-verify.sh offline   # bench offline against transformers' continuous batching
#   ops/gpu-verify.sh ahead     # bench offline, planning ahead on / off
#   ops/gpu-verify.sh slo       # bench slo at 1.5x load, tight deadlines (SLO_REQUESTS
#                               # a cell, default 1000; SLO_POLICY, default deadline;
#                               # SLO_SEEDS, default "0 1 2")
#   ops/gpu-verify.sh serve     # bench serve: the same burst through the gRPC server
#                               # and in-process (what the front door costs the engine)
#   ops/gpu-verify.sh pieces    # steps with a prefill through per-layer graphs
#                               # (--prefill-graph-tokens, on by default): bench offline
#                               # on / off at the 512-token budget, bench slo (deadline)
#                               # with them off
#   ops/gpu-verify.sh cpu       # the host's CPU (an AVX-512/AMX Xeon on the H100 and
#                               # H200 machines lent so far): bf16 prefill attention
#                               # (fp32 tiles / dot rows / dot tiles); bench step on
#                               # 2 threads, bf16, greedy, then batch 64 sampled
#   ops/gpu-verify.sh all       # each of the above in turn, in one call: BUDGET
#                               # seconds in all (default 540), past any failure;
#                               # PHASES="step cpu" runs those only
#
# MODEL (default smollm2-shape: SmolLM2's shape, random weights, built there)
# and OUT (default bench-results) are read from the environment.
set -euo pipefail
py=${PYTHON:-python3}
model=${MODEL:-smollm2-shape}
out=${OUT:-bench-results}
mkdir -p "$out"
bench() { "$py" -m slipstream.service.cli bench "$@"; }

case "${1:-}" in
tests)
    TRITON_INTERPRET=0 "$py" -m pytest -m gpu tests/gpu -q -rs 2>&1 | tee "$out/gpu-tests.txt"
    ;;
step)
    bench step --device cuda --model "$model" --batch 1,8,64,256 --context 512 \
        --modes graphs,no-graphs,graphs-torch-ops,no-graphs-torch-ops \
        --json "$out/step-cuda.json" --plot "$out/step-cuda.png"
    # a mixed step (a 256-token chunk beside the decodes): eager, one graph, per-layer pieces
    bench step --device cuda --model "$model" --batch 1,64,256 --context 512 --prefill 256 \
        --modes graphs,pieces,layer-pieces --json "$out/step-cuda-mixed.json"
    ;;
offline)
    for n in 64 256; do
        bench offline --device cuda --model "$model" --requests "$n" --engines slipstream,hf_cb \
            --json "$out/offline-cuda-$n.json" --plot "$out/offline-cuda-$n.png"
    done
    ;;
ahead)
    for mode in on off; do
        bench offline --device cuda --model "$model" --requests 256 --engines slipstream \
            --plan-ahead "$mode" --json "$out/offline-cuda-256-ahead-$mode.json"
    done
    ;;
slo)
    # 1,000 requests a cell, as the CPU's engine runs (docs/scheduling.md): a
    # cell of 200 holds ~22 class-0 requests, where one miss is 95.5 %. Three
    # seeds (SLO_SEEDS), cv 1 and 3 each: six cells, ~20 s a seed on an H200.
    # A plot for the first seed only: a lent machine sends back 8 files a call.
    plot=(--plot "$out/slo-cuda.png")
    for seed in ${SLO_SEEDS:-0 1 2}; do
        bench slo --device cuda --model "$model" --load 1.5 --slack 4 8 16 \
            --requests "${SLO_REQUESTS:-1000}" --policy "${SLO_POLICY:-deadline}" --seed "$seed" \
            --json "$out/slo-cuda-seed$seed.json" "${plot[@]}"
        plot=()
    done
    # Each run's attainment by class, its host time a step by phase, and every
    # class-0 miss with the steps it lived through (slow steps, or many?) and
    # the steps the batch shaper held it back in.
    "$py" - "$out"/slo-cuda-seed*.json <<'PY'
import json, sys
for path in sys.argv[1:]:
    for run in json.load(open(path))["runs"]:
        classes = {c: round(v["attainment"] * 100, 1) for c, v in run["classes"].items()}
        host = {k: round(v, 3) for k, v in (run.get("host_ms_per_step") or {}).items()}
        print(path, run["policy"], "cv", run["cv"], "attainment % by class", classes,
              "refused", run["overload_refusals"], "infeasible", run["early_rejections"])
        print("  host ms a step", host)
        for miss in run.get("class0_misses") or []:
            print("  missed", {k: round(v, 4) if isinstance(v, float) else v for k, v in miss.items()})
PY
    ;;
serve)
    # 256 requests at once on one stream, then the same in-process: the
    # front door's share of the GIL (docs/gpu.md, "The front door's share").
    bench serve --model "$model" --requests 256 --rate inf --warmup 4 \
        --json "$out/serve-cuda.json"
    ;;
pieces)
    for tokens in 2048 0; do
        bench offline --device cuda --model "$model" --requests 256 --engines slipstream \
            --max-num-batched-tokens 512 --prefill-graph-tokens "$tokens" \
            --json "$out/offline-cuda-256-pieces-$tokens.json"
    done
    bench slo --device cuda --model "$model" --load 1.5 --slack 4 8 16 --policy deadline \
        --prefill-graph-tokens 0 --json "$out/slo-cuda-eager.json" --plot "$out/slo-cuda-eager.png"
    ;;
cpu)
    grep -m1 "model name" /proc/cpuinfo
    grep -o -w -E "avx2|avx512f|avx512_bf16|amx_bf16" /proc/cpuinfo | sort | uniq -c
    "$py" -m slipstream.service.cli kernels build  # ~80 s on a fresh machine
    # bf16 prefill on AVX512-BF16: brgemm tiles (the AMX default, whose products run on
    # AMX tiles), fp32 tiles (the AMX default before), vdpbf16ps tiles; alternated
    for mode in brgemm tiles dot-tiles brgemm tiles; do
        "$py" -m slipstream.kernels.bench_cpu_attention --threads 2 --reps 10 --kind prefill \
            --bf16-prefill "$mode" || echo "bf16 prefill $mode: refused here"
    done
    # bf16 projections, panels against oneDNN (AMX) per row count: where the
    # panels' cut (kernels/linear.py, 4 rows with AMX) belongs on such a CPU
    "$py" -m slipstream.kernels.bench_linear --rows 1,4,8,16,32,64,128 --rounds 3 \
        --json "$out/linear-cpu.json"
    # the compiled step alone took over 70 s there (batch 256 on two cores)
    bench step --device cpu --threads 2 --model "$model" --batch 1,64,256 --context 300 \
        --modes compiled --json "$out/step-cpu.json" --plot "$out/step-cpu.png"
    # a sampled step's "other" (issue 30's temperature rows), last: the limit cuts it first
    bench step --device cpu --threads 2 --model "$model" --batch 64 --context 300 \
        --modes compiled --temperature 1 --top-k 50 --json "$out/step-cpu-sampled.json"
    ;;
all)
    # Most wanted first; each phase with its own limit, within the budget.
    budget=${BUDGET:-540}
    start=$SECONDS
    declare -A limits=([tests]=150 [slo]=120 [serve]=90 [pieces]=150 [step]=90 [cpu]=240 [offline]=150 [ahead]=90)
    for phase in ${PHASES:-tests slo serve pieces step cpu offline ahead}; do
        limit=${limits[$phase]}
        left=$((budget - (SECONDS - start)))
        if ((left < 30)); then
            echo "== $phase skipped: the budget is spent"
            continue
        fi
        ((limit > left)) && limit=$left
        echo "== $phase (limit ${limit} s) at $((SECONDS - start)) s"
        timeout -k 5 "$limit" bash "$0" "$phase" || echo "== $phase ended with status $?"
    done 2>&1 | tee "$out/all.txt"
    ;;
*)
    echo "usage: $0 tests|step|offline|ahead|slo|serve|pieces|cpu|all" >&2
    exit 2
    ;;
esac
