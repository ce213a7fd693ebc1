#!/usr/bin/env bash
# docs/features/quantization.md's speed table: pagedserve against vLLM at its best (as it starts and with its
# worker on every core, the better per repetition) on the same quantized checkpoints, and against pagedserve on
# the bfloat16 checkpoint of the same shape, A/B interleaved, 3 repetitions (benchmarks/peer_bench.py).
#   bash benchmarks/quantized/sitting.sh CHECKPOINTS VLLM_VENV [REPEATS]
set -euo pipefail
DIR=$1
VLLM=$2
REPEATS=${3:-3}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
RESULTS=$ROOT/benchmarks/results/quantized
mkdir -p "$RESULTS"
run() {  # NAME MODEL BASELINE SCENARIOS
    "$PY" "$ROOT/benchmarks/peer_bench.py" --vllm-venv "$VLLM" --vllm-all-cores --interleave --repeats "$REPEATS" \
        --dtype bfloat16 --model "$DIR/$2" --baseline-model "$DIR/$3" --scenarios "$4" --out "$RESULTS/$1.json" \
        2>&1 | tail -30
}
run llama-12l-w8a8 llama-12l-768-w8a8 llama-12l-768-bf16 mid_c16,mid_c1,decode_c32,prefill_1k
run sweep-1024-gqa8-w8a8 sweep-1024-gqa8-w8a8 sweep-1024-gqa8-bf16 mid_c16,mid_c1,decode_c32,prefill_1k
run sweep-2048-gqa2-w8a8 sweep-2048-gqa2-w8a8 sweep-2048-gqa2-bf16 mid_c16,mid_c1,decode_c32,prefill_1k
run llama-12l-w4a16 llama-12l-768-w4a16 llama-12l-768-bf16 mid_c1,mid_c16
run sweep-1280-qwen3-w4a16 sweep-1280-qwen3-hd80-w4a16 sweep-1280-qwen3-hd80-bf16 mid_c1,mid_c16
run sweep-1024-gqa8-w4a16-g64 sweep-1024-gqa8-w4a16-g64 sweep-1024-gqa8-bf16 mid_c1,mid_c16
run llama-12l-gptq llama-12l-768-gptq llama-12l-768-bf16 mid_c1,mid_c16
