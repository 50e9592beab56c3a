#!/usr/bin/env bash
# Issue 28's checks and figures on a lent GPU, in one call: bash benchmarks/gpu_issue28.sh [PART ...]
#
# Parts (default: gpt2_decode gpt2 checks, what issue 28 still needs from a GPU; the earlier default was
# checks decode step): checks (gpu_checks.py's switches and loops groups), decode
# (uneven_generate.py: the uneven workload in bf16 with the compiled decode, against HF generate with its
# static cache, the memory floor and peak memory), step (bench_step.py: the uneven SmolLM2-shape
# GRPO and RLOO steps, switches on, compiled decode, bf16, against TRL 1.16), step_off (the same with the
# switches off), gpt2 (the tiny GPT-2 uneven workload, switches on, against TRL 1.16), gpt2_decode (that
# workload's rollout alone, bf16 compiled, against HF's static cache, with the roofline and a profile of one
# call: launches, graph replays and host syncs per decode step).
#
# Wheels the machine lacks (tensordict, torchrl, transformers, TRL, datasets; benchmarks/RESULTS.md) are
# installed from .whl/ when present. Each part has its own time limit (T_CHECKS, T_DECODE, T_STEP, ...
# seconds), so a hang in one leaves the others' results. Logs and JSON go to $OUT (default
# benchmarks/results/gpu).
set -u
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
PY=$(command -v python3)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch, transformers, tensordict; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'tensordict', tensordict.__version__)" | tee -a "$OUT/gpu.txt"

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(gpt2_decode gpt2 checks)
step() {  # bench_step on the uneven SmolLM2-shape workload, bf16, compiled decode; $1 = out name, rest: workers
    local name=$1
    shift
    timeout "${T_STEP:-240}" $PY benchmarks/bench_step.py --device cuda --workload smollm2 --lengths uneven \
        --switches both --compile-generate 1 --mode interleaved --steps 3 --trl116-python "$PY" \
        --only "$@" --out "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
}
for part in "${parts[@]}"; do
    echo "=== $part $(date -u +%H:%M:%S)"
    case $part in
    checks)
        timeout "${T_CHECKS:-130}" $PY benchmarks/gpu_checks.py --only switches loops \
            --out "$OUT/gpu_checks_issue28.json" 2>&1 | tee "$OUT/checks.log" ;;
    decode)
        timeout "${T_DECODE:-150}" $PY benchmarks/uneven_generate.py --model smollm2 --device cuda --dtype bf16 \
            --compile --batch 16 --budget 256 --hf-static --floor --runs 3 \
            --out "$OUT/uneven_generate_smollm2_cuda_bf16.json" 2>&1 | tee "$OUT/decode.log" ;;
    step)
        step bench_step_smollm2_uneven_cuda_bf16 rlbits-grpo-on-bf16 trl-grpo-bf16 rlbits-rloo-on-bf16 \
            trl-rloo-bf16 ;;
    step_off)
        step bench_step_smollm2_uneven_cuda_bf16_off rlbits-grpo-off-bf16 rlbits-rloo-off-bf16 ;;
    gpt2)
        timeout "${T_GPT2:-200}" $PY benchmarks/bench_step.py --device cuda --workload standard --lengths uneven \
            --switches on --compile-generate 1 --mode interleaved --steps 3 --trl116-python "$PY" \
            --only rlbits-grpo-on-bf16 trl-grpo-bf16 rlbits-rloo-on-bf16 trl-rloo-bf16 \
            --out "$OUT/bench_step_uneven_cuda_bf16.json" 2>&1 | tee "$OUT/gpt2.log" ;;
    gpt2_decode)
        timeout "${T_GPT2_DECODE:-150}" $PY benchmarks/uneven_generate.py --model gpt2 --device cuda --dtype bf16 \
            --compile --batch 32 --budget 128 --hf-static --floor --runs 3 --profile "$OUT/profile_gpt2_decode.txt" \
            --out "$OUT/uneven_generate_gpt2_cuda_bf16.json" 2>&1 | tee "$OUT/gpt2_decode.log" ;;
    *) echo "unknown part: $part" ;;
    esac
done
echo "=== done $(date -u +%H:%M:%S)"
