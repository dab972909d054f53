#!/usr/bin/env bash
# One device call (see /work/.library/device): the GPU path of the test suites that compare with
# transformers, plus the IndexCache benchmark at real shapes. Wheels in .whl/ (transformers 5.23).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD/python:$PWD/sgl-kernel
else
  export PYTHONPATH=$PWD/python:$PWD/sgl-kernel
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
# 1) our model on cuda vs transformers on cpu (fp32)
SGLANG_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -x -p no:cacheprovider \
  test/srt/test_model_parity.py test/srt/test_indexcache.py -k "not startup and not tbo and not capacity" \
  2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
# 2) IndexCache benchmark, real DeepSeek-V3.2 shapes, bf16
timeout ${BENCH_TIMEOUT:-300} python3 benchmark/indexcache/bench_indexcache.py --shape deepseek-v32 --device cuda \
  --dtype bfloat16 --contexts ${BENCH_CONTEXTS:-4096,8192,16384} --decode-batch 4 --decode-steps 8 --repeats 1 \
  --out-dir "$OUT" 2>&1 | grep -v "it/s" | tail -20 | tee "$OUT/bench.txt"
