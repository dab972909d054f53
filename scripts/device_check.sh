#!/usr/bin/env bash
# GPU check for any machine with an NVIDIA GPU and a CUDA build of torch (H100 / H200 class for the
# benchmarks' shapes). From the repository root:
#   bash scripts/device_check.sh [--install] [STEP...]        (default steps: parity bench-v32)
#   --install          first `pip install -e "./python[test]" -e ./sgl-kernel` from the package index
#                      (keeps the machine's CUDA torch: the package only asks for torch>=2.11)
#   WHEEL_DIR=DIR      instead, install the wheels in DIR without network (default: .whl/ if it has any)
#   OUT=DIR            where the step outputs go (default ./device_check_out)
# Steps:
#   gpu-tests: kernel tests compiled, the Triton model path + CUDA graphs + no-sync guard, parity vs transformers,
#              and the overlap, speculative, HiCache and PD suites on CUDA
#   parity: our model on cuda vs transformers on cpu;  server: the HTTP server on the GPU vs the offline Engine
#   bench-kernels / bench-attn: MLA / indexer / top-k / fused MoE kernels vs the GPU's copy and matmul ceilings
#   bench-e2e: engine vs transformers generate (V3.2 and GLM-5 shapes);  bench-v32 / bench-glm: IndexCache
#   pd: prefill + decode servers on this GPU (cuda_ipc) vs one combined server under a mixed load
#   spec-tests: speculative (EAGLE/NextN), overlap-scheduler, HiCache and PD suites on the GPU (graphs on)
#   bench-overlap: scheduler step wall time vs GPU busy time, overlap vs sync vs deterministic
#   memplan: the memory plan's tests + 2/3-layer V3.2 shapes that must start and prefill on this card;
#   bench-dense: single-prompt prefill at 1K / 2K / 4K, dense MHA for short prompts vs the sparse path
#   memplan-bench: the same through the HTTP server (2 x 256), bench_e2e_vs_hf.py --layers 2 (32K prefill, --experts)
# Everything runs on builtin tiny models or random weights of the real shapes: no download, no checkpoint.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ "${1:-}" = "--install" ]; then
  shift
  python3 -m pip install -e "./python[test]" -e ./sgl-kernel || { echo "install failed" >&2; exit 1; }
fi
WHEEL_DIR=${WHEEL_DIR:-.whl}
if ls "$WHEEL_DIR"/*.whl >/dev/null 2>&1; then  # pure-Python wheels an offline GPU image lacks
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEEL_DIR"/*.whl
  export PYTHONPATH=/tmp/site:$PWD/python:$PWD/sgl-kernel
else
  export PYTHONPATH=$PWD/python:$PWD/sgl-kernel${PYTHONPATH:+:$PYTHONPATH}
fi
OUT=${OUT:-$PWD/device_check_out}; mkdir -p "$OUT"
if ! command -v nvidia-smi >/dev/null || ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "device_check needs an NVIDIA GPU (nvidia-smi) and a CUDA build of torch (torch.cuda.is_available())" >&2
  exit 2
fi
for mod in transformers fastapi uvicorn zmq openai pytest triton; do
  python3 -c "import $mod" 2>/dev/null || { echo "missing Python package '$mod': run with --install" >&2; exit 2; }
done
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
steps=${*:-parity bench-v32}
for step in $steps; do
  echo "=== $step"
  case $step in
    gpu-tests)  # compiled kernels vs their twins; the model through them (graphs on) vs transformers; the
      # suites whose GPU half differs from CPU (overlap, speculative, HiCache, PD). ~15 min on an H100:
      # split with GPU_TESTS=... across calls where a call is time-limited.
      SGLANG_TEST_DEVICE=cuda timeout ${TEST_TIMEOUT:-1200} python3 -m pytest -q -p no:cacheprovider --timeout 300 \
        ${GPU_TESTS:-test/registered/unit/kernels test/srt/test_triton_backends.py test/srt/test_model_parity.py \
          test/srt/test_overlap_schedule.py test/srt/test_speculative.py test/srt/test_hicache.py \
          test/srt/test_hicache_backup.py test/srt/test_hicache_io.py test/srt/test_disaggregation.py} \
        -k "${GPU_TESTS_K:-not server_through and not cp2}" > "$OUT/gpu-tests.log" 2>&1
      grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu-tests.log" | tail -30 | tee "$OUT/gpu-tests.txt" ;;
    spec-tests)  # the suites whose GPU half differs from CPU: graph capture, streams, pinned copies
      SGLANG_TEST_DEVICE=cuda timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider --timeout 200 \
        ${SPEC_TESTS:-test/srt/test_speculative.py test/srt/test_overlap_schedule.py test/srt/test_hicache.py test/srt/test_hicache_backup.py test/srt/test_disaggregation.py} \
        -k "${SPEC_TESTS_K:-not cp2}" > "$OUT/spec-tests.log" 2>&1
      grep -E "passed|failed|FAILED|ERROR|Error" "$OUT/spec-tests.log" | tail -40 ;;
    bench-overlap)
      timeout ${BENCH_TIMEOUT:-300} python3 benchmark/overlap/bench_overlap_step.py --out-dir "$OUT" ${OVERLAP_ARGS:-} \
        2>&1 | grep -v "it/s" | tail -60 | tee "$OUT/bench-overlap.txt" ;;
    bench-attn)
      python3 benchmark/kernels/bench_attention_kernels.py --out-dir "$OUT" 2>&1 | tail -14 | tee "$OUT/bench-attn.txt" ;;
    bench-kernels)
      python3 benchmark/kernels/bench_attention_kernels.py --out-dir "$OUT" 2>&1 | tail -14 | tee "$OUT/bench-attn.txt"
      python3 benchmark/kernels/bench_fused_moe.py --out-dir "$OUT" 2>&1 | tail -14 | tee "$OUT/bench-moe.txt"
      python3 benchmark/kernels/bench_topk.py --out-dir "$OUT" 2>&1 | tail -14 | tee "$OUT/bench-topk.txt" ;;
    bench-e2e)
      for shape in ${E2E_SHAPES:-deepseek-v32 glm-5}; do
        args=E2E_ARGS_${shape//-/_}
        timeout ${BENCH_TIMEOUT:-420} python3 benchmark/e2e/bench_e2e_vs_hf.py --shape $shape --out-dir "$OUT" \
          ${!args:-} 2>&1 | grep -v "^  " | tail -12 | tee "$OUT/e2e-$shape.txt"
      done ;;
    memplan)  # the memory plan on this card: its tests, then 2- and 3-layer V3.2 shapes (16 / 256 experts)
      # start with dummy weights and run the largest admitted prefills, a 32K prompt and a full decode batch
      SGLANG_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider -rs \
        test/registered/unit/model_executor/test_memory_plan.py test/registered/unit/model_loader/test_dummy_weights.py \
        test/srt/test_memory_plan_runner.py 2>&1 | tail -6 | tee "$OUT/memplan-tests.txt"
      timeout ${FIT_TIMEOUT:-400} python3 benchmark/e2e/memory_fit.py --configs ${MEMPLAN_CONFIGS:-2x16,2x256,3x16,3x256} \
        --out-dir "$OUT" 2>&1 | grep -v "^  " | tail -30 | tee "$OUT/memplan-fit.txt" ;;
    memplan-bench)  # the HTTP server at 2 layers x 256 experts (the same cases), then bench_e2e_vs_hf at 2 layers:
      # a 32K prefill on the server's chunked prefill, transformers' experts implementation
      timeout ${FIT_TIMEOUT:-240} python3 benchmark/e2e/memory_fit.py --configs "" --timeout 110 \
        --server-configs ${MEMPLAN_SERVER_CONFIGS:-2x256} --out-dir "$OUT/memplan-server" 2>&1 | grep -v "^  " | tail -8 \
        | tee "$OUT/memplan-server.txt"
      timeout ${BENCH_TIMEOUT:-340} python3 benchmark/e2e/bench_e2e_vs_hf.py --layers 2 --out-dir "$OUT" \
        ${MEMPLAN_E2E_ARGS:---experts 16 --hf-experts-implementation grouped_mm --sides ours,hf --batch-sizes 1,16 --prefill-lens 4096,32768} \
        2>&1 | grep -v "^  " | tail -12 | tee "$OUT/memplan-e2e.txt" ;;
    bench-dense)  # issue 31 item 4: single-prompt prefill, dense MHA for short prompts vs the sparse path
      timeout ${BENCH_TIMEOUT:-300} python3 benchmark/e2e/bench_e2e_vs_hf.py --layers ${DENSE_LAYERS:-2} --out-dir "$OUT" \
        --experts 16 --sides ours,ours_sparse --batch-sizes 1 --gen-lens 2,4 --prefill-lens 1024,2048,4096 \
        2>&1 | grep -v "^  " | tail -12 | tee "$OUT/bench-dense.txt" ;;
    parity)  # our model on cuda vs transformers on cpu (fp32)
      SGLANG_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -x -p no:cacheprovider \
        test/srt/test_model_parity.py test/srt/test_indexcache.py test/srt/test_nextn.py \
        -k "not startup and not tbo and not capacity" 2>&1 | tail -5 | tee "$OUT/parity.txt" ;;
    server)  # the HTTP server on the GPU (device auto -> cuda, page size 64) vs the offline Engine
      timeout 300 python3 -m pytest -q -x -p no:cacheprovider test/srt/test_server_openai.py 2>&1 \
        | tail -8 | tee "$OUT/server.txt" ;;
    pd)  # PD_ARGS: extra bench_pd_mixed.py flags (e.g. --long-len 8192)
      timeout ${BENCH_TIMEOUT:-540} python3 benchmark/pd/bench_pd_mixed.py --backend cuda_ipc --out-dir "$OUT" \
        ${PD_ARGS:-} 2>&1 | grep -v "it/s" | tail -60 | tee "$OUT/pd.txt" ;;
    bench-v32|bench-glm)
      shape=$([ "$step" = bench-v32 ] && echo deepseek-v32 || echo glm-5)
      timeout ${BENCH_TIMEOUT:-300} python3 benchmark/indexcache/bench_indexcache.py --shape $shape --device cuda \
        --dtype bfloat16 --contexts ${BENCH_CONTEXTS:-4096,8192,16384} --decode-batch ${BENCH_DECODE_BATCH:-4} --decode-steps ${BENCH_DECODE_STEPS:-16} \
        --repeats ${BENCH_REPEATS:-3} --out-dir "$OUT" 2>&1 | grep -v "it/s" | tail -14 | tee "$OUT/$step.txt" ;;
  esac
done
