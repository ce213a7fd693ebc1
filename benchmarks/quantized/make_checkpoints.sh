#!/usr/bin/env bash
# The checkpoints of docs/features/quantization.md's speed table, made offline: random bfloat16 weights at the
# shapes of ops/configs (the shipped tokenizer), quantized by llmcompressor's round-to-nearest modifier, and a
# GPTQ checkpoint in gptqmodel's layout (tests/quantized_models.py's packing, which the suite holds to
# gptqmodel's bytes).
#   bash benchmarks/quantized/make_checkpoints.sh OUT_DIR LLMCOMPRESSOR_VENV
# The llmcompressor venv: python3 -m venv V && V/bin/pip install torch==2.13.0 && V/bin/pip install llmcompressor
set -euo pipefail
OUT=$1
LLMC=$2
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
mkdir -p "$OUT"
for shape in llama-12l-768-bf16 sweep-1024-gqa8-bf16 sweep-2048-gqa2-bf16 sweep-1280-qwen3-hd80-bf16; do
    [ -d "$OUT/$shape" ] || "$PY" "$ROOT/benchmarks/quantized/random_checkpoint.py" "$ROOT/ops/configs/$shape" "$OUT/$shape"
done
quantize() {  # SHAPE SCHEME NAME [GROUP]
    [ -d "$OUT/$3" ] || "$LLMC/bin/python" "$ROOT/benchmarks/quantized/llmcompressor_rtn.py" "$OUT/$1" "$2" "$OUT/$3" ${4:-}
}
quantize llama-12l-768-bf16 W8A8 llama-12l-768-w8a8
quantize llama-12l-768-bf16 W4A16 llama-12l-768-w4a16
quantize sweep-1024-gqa8-bf16 W8A8 sweep-1024-gqa8-w8a8
quantize sweep-2048-gqa2-bf16 W8A8 sweep-2048-gqa2-w8a8
quantize sweep-1280-qwen3-hd80-bf16 W4A16 sweep-1280-qwen3-hd80-w4a16
quantize sweep-1024-gqa8-bf16 W4A16 sweep-1024-gqa8-w4a16-g64 64   # 2,752 wide: groups of 128 do not divide it
[ -d "$OUT/llama-12l-768-gptq" ] || (cd "$ROOT" && "$PY" -c "
import shutil, sys
from tests.quantized_models import write_gptq_or_awq
_, dense = write_gptq_or_awq(sys.argv[1], 'gptq', sys.argv[2])
shutil.rmtree(dense)" "$OUT/llama-12l-768-bf16" "$OUT/llama-12l-768-gptq")
ls "$OUT"
