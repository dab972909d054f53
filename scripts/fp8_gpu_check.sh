#!/usr/bin/env bash
# FP8 block weights on one GPU (issue 30): the FP8 tests compiled on the device, then the kernel
# benchmarks against the in-run ceilings. JSON + plots under $OUT (default /tmp/fp8_out).
#   bash scripts/fp8_gpu_check.sh            # tests + GEMM / MoE benchmarks (~5-8 min on an H100)
#   bash scripts/fp8_gpu_check.sh e2e        # + bench_e2e_vs_hf.py's ours_fp8w side (--quantization fp8 vs bf16)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/fp8_out}"
mkdir -p "$OUT"
export SGLANG_TEST_DEVICE=cuda
python3 -m pytest -q -x -p no:cacheprovider test/registered/unit/kernels/test_fp8_kernels.py \
    test/srt/test_fp8_weights.py test/registered/unit/layers/test_fp8_weight_bytes.py 2>&1 | tee "$OUT/fp8_tests.log" | tail -30
python3 -m pytest -q -x -p no:cacheprovider test/srt/test_batch_invariance.py -k fp8 2>&1 | tee -a "$OUT/fp8_tests.log" | tail -5
python3 benchmark/kernels/bench_fp8_gemm.py --sweep --out-dir "$OUT" 2>&1 | tee "$OUT/fp8_gemm.log" | tail -60
python3 benchmark/kernels/bench_fp8_moe.py --out-dir "$OUT" 2>&1 | tee "$OUT/fp8_moe.log" | tail -8
if [ "${1:-}" = "e2e" ]; then
    python benchmark/e2e/bench_e2e_vs_hf.py --sides ours,ours_fp8w --batch-sizes 1,64 --prefill-lens 4096 \
        --out-dir "$OUT" 2>&1 | tee "$OUT/fp8_e2e.log" | tail -20
fi
