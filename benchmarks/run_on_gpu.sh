#!/usr/bin/env bash
# What a session with a lent GPU runs, from the repository root; logs and results go to $OUT.
#   bash benchmarks/run_on_gpu.sh checks           compiled Triton kernel tests, the three processes
#                                                  on CUDA, the kernel benchmarks (paged attention, LoRA,
#                                                  quantized products at 8B shapes against float16, and
#                                                  their tile plans compared)
#   bash benchmarks/run_on_gpu.sh fig12 POLICIES RATES [NUM_PROMPTS]   (context $MAX_MODEL_LEN, default 2048 as OPT)
#                                                  Figure 12 on a dummy-weight OPT-13B
#   bash benchmarks/run_on_gpu.sh graphs8b [CONCURRENCY]   a dummy Llama-3.1-8B in float16 served with CUDA
#                                                  graphs and with --enforce-eager, alternating
# Wheels the GPU image lacks (pyzmq, starlette, uvicorn) are installed from .whl/ when it exists.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

# OPT-13B in float16 on the KV budget the paper's OPT-13B had on one A100-40GB: about 12 GB,
# 915 blocks of 16 tokens at 819,200 bytes of K and V per token.
OPT13B_FLAGS="--device cuda --dtype float16 --load-format dummy --tokenizer ops/models/tiny-python"

case "${1:-checks}" in
checks)
    nvidia-smi -L
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"
    timeout 300 python3 -m pytest -q -p no:cacheprovider --basetemp=/tmp/pt tests/test_kernels.py tests/test_gpu.py \
        2>&1 | tee "$OUT/tests.log" | tail -25
    timeout 120 python3 benchmarks/quant_gpu_bench.py 2>&1 | tee "$OUT/quant_gpu_bench.log"
    cp benchmarks/results/quant_gpu_bench.json "$OUT/" 2>/dev/null
    timeout 120 python3 benchmarks/quant_tile_sweep.py 2>&1 | tee "$OUT/quant_tile_sweep.log"
    cp benchmarks/results/quant_tile_sweep.json "$OUT/" 2>/dev/null
    timeout 120 python3 benchmarks/kernel_bench.py 2>&1 | tee "$OUT/kernel_bench.log"
    cp benchmarks/results/kernel_bench.json "$OUT/" 2>/dev/null
    timeout 60 python3 benchmarks/lora_kernel_bench.py 2>&1 | tee "$OUT/lora_kernel_bench.log"
    cp benchmarks/results/lora_kernel_bench.json "$OUT/" 2>/dev/null
    find /tmp/pt -name 'server-*.log' -print0 2>/dev/null | tar czf "$OUT/server_logs.tgz" --null -T - 2>/dev/null
    ;;
fig12)
    mkdir -p /tmp/bench-logs
    BENCH_LOG_DIR=/tmp/bench-logs timeout "${FIG12_TIMEOUT:-560}" python3 benchmarks/fig12_latency_vs_rate.py \
        --model ops/configs/opt-13b --server-args "$OPT13B_FLAGS" --max-model-len "${MAX_MODEL_LEN:-2048}" --num-blocks 915 \
        --policies "$2" --rates "$3" --num-prompts "${4:-100}" --tag "${FIG12_TAG:-_opt13b_h100}" \
        --out-dir "$OUT" --plot-dir "$OUT" 2>&1 | tee "$OUT/fig12.log"
    tar czf "$OUT/bench_logs.tgz" -C /tmp bench-logs 2>/dev/null
    ;;
graphs8b)
    mkdir -p /tmp/bench-logs
    BENCH_LOG_DIR=/tmp/bench-logs timeout "${GRAPHS_TIMEOUT:-560}" python3 benchmarks/cuda_graphs_bench.py \
        --concurrency "${2:-1,16,64}" --out "$OUT/cuda_graphs_8b.json" 2>&1 | tee "$OUT/cuda_graphs.log"
    tar czf "$OUT/bench_logs.tgz" -C /tmp bench-logs 2>/dev/null
    ;;
esac
