#!/usr/bin/env bash
# HiCache on one NVIDIA GPU (issue 29, items 4 and 6), in one call: the HiCache suites on CUDA
# (pinned host pools, real cudaMemcpyAsync / cudaMemcpy2DAsync, the Triton page-copy kernel through
# UVA), then bench_hicache.py on V3.2 shapes (3 layers x 16 experts, 32K) writing JSON + plot to OUT.
# From the repository root:
#   bash benchmark/hicache/gpu_check.sh OUT [bench_hicache.py flags...]
#   TEST_TIMEOUT / BENCH_TIMEOUT (s, default 300 / 270); SKIP_TESTS=1 or SKIP_BENCH=1 runs one half.
# Needs: a CUDA build of torch, triton, transformers, and the repo's deps (as scripts/device_check.sh);
# GPU memory for the default benchmark: two engines of ~9 GB of bf16 weights each, KV pools of two
# 32K prompts (~0.5 GB), one 32K prefill's activations: an estimate of 25-35 GB, not measured (the
# JSON's gpu_mem_peak_GiB records it); less with --num-layers 2 or --prefix-lens 16384 (V3.2 routing
# needs >= 16 experts: n_group 8, topk_group 4, 8 active).
# Exit status: 0 only if the tests pass and the benchmark ran (its JSON's `goals.met` says whether
# the goals were met; a miss is a measurement, not a failure).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: bash benchmark/hicache/gpu_check.sh OUT [bench_hicache.py flags...]}
shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH=$PWD/python:$PWD/sgl-kernel${PYTHONPATH:+:$PYTHONPATH}
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check.sh needs a CUDA GPU and a CUDA build of torch" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"
tests=0
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "=== HiCache tests on cuda"
  SGLANG_TEST_DEVICE=cuda timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rs \
    --junitxml "$OUT/hicache-tests.xml" \
    test/srt/test_hicache.py test/srt/test_hicache_backup.py test/srt/test_hicache_controller.py \
    test/srt/test_memory_pool_host.py test/srt/test_hicache_io.py test/registered/unit/kernels/test_page_copy.py \
    2>&1 | tail -30 | tee "$OUT/hicache-tests.txt"
  tests=${PIPESTATUS[0]}
fi
bench=0
if [ -z "${SKIP_BENCH:-}" ]; then
  echo "=== bench_hicache.py"
  timeout "${BENCH_TIMEOUT:-270}" python3 benchmark/hicache/bench_hicache.py --out-dir "$OUT" "$@" 2>&1 \
    | grep -v "it/s]" | tail -40 | tee "$OUT/bench-hicache.txt"
  bench=${PIPESTATUS[0]}
fi
echo "tests rc=$tests bench rc=$bench (JSON: $OUT/hicache_cuda.json)"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
