#!/usr/bin/env bash
# Issue 28's CPU rows in one quiet run: bash benchmarks/cpu_issue28.sh [PART ...]
#
# Parts (default: packing generate step): packing (benchmarks/packing.py: the GRPO and PPO update phases,
# padded / packed in bins / packed in one row / token budget, uneven and uniform), generate
# (benchmarks/uneven_generate.py on the tiny GPT-2: 32 rows, and 256 rows with 32 slots), step
# (benchmarks/bench_step.py: the uneven tiny GPT-2 GRPO, RLOO and PPO steps, switches off and on, against TRL),
# smollm2 (the same GRPO and RLOO steps at SmolLM2-135M's shape: about 25 minutes), real (the real check's
# step, benchmarks/real_switches.py: about 10 minutes), smollm2_generate (the uneven rollout at SmolLM2-135M's
# shape, 64 and 256 rows, with the roofline ratio, and the decode step's cost per batch size from 1 to 64 rows:
# about 15 minutes). Run it with nothing else on the machine; the
# 1-minute load average is printed before each part, and each script records its own. JSON goes to
# benchmarks/results/ (the names benchmarks/RESULTS.md cites), logs to $LOGS (default /tmp/issue28_cpu).
set -u
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
LOGS=${LOGS:-/tmp/issue28_cpu}
R=benchmarks/results
mkdir -p "$LOGS"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(packing generate step)
for part in "${parts[@]}"; do
    echo "=== $part $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    case $part in
    packing)
        $PY benchmarks/packing.py --model standard --rows 64 --budget 256 | tee "$R/packing_standard.jsonl" ;;
    generate)
        $PY benchmarks/uneven_generate.py --model gpt2 --batch 32 --budget 128 \
            --out "$R/uneven_generate_gpt2.json" | tee "$LOGS/generate32.log"
        $PY benchmarks/uneven_generate.py --model gpt2 --batch 256 --budget 128 --max-num-seqs 32 --runs 3 \
            --out "$R/uneven_generate_gpt2_256.json" | tee "$LOGS/generate256.log" ;;
    step)
        $PY benchmarks/bench_step.py --lengths uneven --switches both --mode interleaved --steps 3 --no-bf16 \
            --out "$R/bench_step_uneven.json" 2>&1 | tee "$LOGS/step.log" ;;
    smollm2)
        $PY benchmarks/bench_step.py --workload smollm2 --lengths uneven --switches both --mode interleaved \
            --steps 3 --no-bf16 --out "$R/bench_step_smollm2_uneven.json" 2>&1 | tee "$LOGS/smollm2.log" ;;
    real)
        $PY benchmarks/real_switches.py --steps 3 --seeds 0 --overrides num_prompts_per_step=4 cpu_threads=2 \
            max_val_samples=32 --out "$R/real_switches_math.json" 2>&1 | tee "$LOGS/real.log" ;;
    smollm2_generate)
        $PY benchmarks/uneven_generate.py --model smollm2 --batch 64 --budget 256 --runs 2 --floor --skip-off \
            --out "$R/uneven_generate_smollm2_64.json" | tee "$LOGS/smollm2_generate64.log"
        $PY benchmarks/uneven_generate.py --model smollm2 --batch 256 --budget 256 --runs 1 --floor --skip-off \
            --out "$R/uneven_generate_smollm2_256.json" | tee "$LOGS/smollm2_generate256.log"
        $PY benchmarks/bench_decode.py --batch-sizes 1,2,4,8,16,32,64 --impls rlbits --new-tokens 64 --runs 2 \
            --out "$R/bench_decode_rows.json" | tee "$LOGS/decode_rows.log" ;;
    *) echo "unknown part: $part" ;;
    esac
done
echo "=== done $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
