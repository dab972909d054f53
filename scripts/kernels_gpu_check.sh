#!/usr/bin/env bash
# Issue 31 items 1 and 3-decode on one GPU (H100 / H200, ~5 min): the sparse MLA / indexer / top-k
# kernel tests compiled, then the kernel benchmarks at the V3.2 shapes against the in-run ceilings
# (copy GB/s, bf16 and FP8 matmul). JSON, plots and logs under $OUT (default /tmp/kernels_out);
# a short summary last.
#   OUT=/tmp/out bash scripts/kernels_gpu_check.sh
# Each benchmark times the serving tile beside the tile before issue 31 ("v1") and 2-3 candidates
# (MLA tiles, fixed split sizes; top-k splits), so one call picks the configs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kernels_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 SGLANG_TEST_DEVICE=cuda
if ls .whl/*.whl >/dev/null 2>&1; then  # pure-Python wheels an offline GPU image lacks (as device_check.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD/python:$PWD/sgl-kernel
else
  export PYTHONPATH=$PWD/python:$PWD/sgl-kernel${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

echo "=== tests (compiled)"
timeout 240 python3 -m pytest -q -p no:cacheprovider test/registered/unit/kernels/test_attention_kernels.py \
  test/registered/unit/kernels/test_topk.py > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | tail -12

echo "=== bench_attention_kernels (MLA decode / prefill, indexer scores + top-k)"
timeout 210 python3 benchmark/kernels/bench_attention_kernels.py --out-dir "$OUT" > "$OUT/bench_attention.log" 2>&1
echo "bench_attention rc=$?"
grep -E "^ceilings|^kernel|^sparse|^indexer|^  sparse MLA decode|^  indexer top-k decode|Error|error" \
  "$OUT/bench_attention.log" | tail -40

echo "=== bench_topk (eager and CUDA-graph; auto vs fixed splits)"
timeout 150 python3 benchmark/kernels/bench_topk.py --dists bf16,fp32 --variants auto,s16,s32,s64 \
  --out-dir "$OUT" > "$OUT/bench_topk.log" 2>&1
echo "bench_topk rc=$?"; grep -E "decode R=(1|64) W=32768|MISMATCH|Error" "$OUT/bench_topk.log" | tail -20

echo "=== bench_fp8_kv (sparse MLA over FP8 vs bf16 KV, serving tiles)"
timeout 90 python3 benchmark/kernels/bench_fp8_kv.py --repeats 3 --out-dir "$OUT" > "$OUT/bench_fp8_kv.log" 2>&1
echo "bench_fp8_kv rc=$?"; tail -12 "$OUT/bench_fp8_kv.log"
ls "$OUT"
