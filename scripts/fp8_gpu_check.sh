#!/usr/bin/env bash
# FP8 block weights on one GPU (issue 30): the FP8 tests compiled on the device, the tile tuner (its
# tables written into sgl-kernel/sgl_kernel/configs/ of this copy and under $OUT/), then the kernel
# benchmarks with those tables against the in-run ceilings. JSON + plots under $OUT (default /tmp/fp8_out).
#   bash scripts/fp8_gpu_check.sh            # ~8-9 min on an H100 (tests <= 210 s, tuner ~170-210 s, benches ~120 s)
#   bash scripts/fp8_gpu_check.sh e2e        # + bench_e2e_vs_hf.py's ours_fp8w side (--quantization fp8 vs bf16)
#   TUNE_BUDGET_S=120 ...                    # the tuner starts no new case after this many seconds
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/fp8_out}"
mkdir -p "$OUT"
export SGLANG_TEST_DEVICE=cuda
t0=$(date +%s)
stamp() { echo "[fp8_gpu_check] $1 at +$(( $(date +%s) - t0 )) s" | tee -a "$OUT/fp8_timeline.log"; }
stamp "tests"
timeout 170 python3 -m pytest -q -p no:cacheprovider test/registered/unit/kernels/test_fp8_kernels.py \
    test/registered/unit/kernels/test_fp8_tuner.py test/registered/unit/layers/test_fp8_weight_bytes.py \
    test/srt/test_fp8_weights.py 2>&1 | tee "$OUT/fp8_tests.log" | tail -12
timeout 40 python3 -m pytest -q -p no:cacheprovider test/srt/test_batch_invariance.py -k fp8 2>&1 \
    | tee -a "$OUT/fp8_tests.log" | tail -5
stamp "tuner"
python3 benchmark/kernels/tune_fp8.py --budget-s "${TUNE_BUDGET_S:-170}" --out-dir "$OUT" 2>&1 \
    | tee "$OUT/tune_fp8.log" | grep -v "it/s\]" | tail -25
stamp "gemm bench"
python3 benchmark/kernels/bench_fp8_gemm.py --sweep --out-dir "$OUT" 2>&1 | tee "$OUT/fp8_gemm.log" | grep -v "(heuristic)\|(fixed)\|it/s\]" | tail -22
stamp "moe bench"
python3 benchmark/kernels/bench_fp8_moe.py --out-dir "$OUT" 2>&1 | tee "$OUT/fp8_moe.log" | tail -8
if [ "${1:-}" = "e2e" ]; then
    python benchmark/e2e/bench_e2e_vs_hf.py --sides ours,ours_fp8w --batch-sizes 1,64 --prefill-lens 4096 \
        --out-dir "$OUT" 2>&1 | tee "$OUT/fp8_e2e.log" | tail -20
fi
stamp "done"
