"""benchmark/kernels/bench_fused_moe.py --smoke on CPU (Triton interpreter, tiny shapes): it runs, its
correctness / determinism / batch-invariance checks pass, and it writes JSON and a plot. Timings are
not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from sgl_kernel.moe import get_moe_config

_BENCH = Path(__file__).resolve().parents[4] / "benchmark" / "kernels" / "bench_fused_moe.py"


def test_bench_fused_moe_cpu_smoke(tmp_path):
    proc = subprocess.run([sys.executable, str(_BENCH), "--smoke", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    stem = tmp_path / "fused_moe_cpu_smoke"
    result = json.loads(stem.with_suffix(".json").read_text())
    assert stem.with_suffix(".png").stat().st_size > 0
    checks = result["checks"]
    assert checks["deterministic"] and checks["batch_invariant_same_config"]
    assert checks["batch_invariant_decode_vs_prefill_config"]
    assert checks["decode_rel_err_vs_fp32"] < 2e-2 and checks["prefill_rel_err_vs_bf16_ref"] < 5e-2
    assert [(r["kind"], r["tokens"]) for r in result["rows"]] == [("decode", 1), ("decode", 4), ("prefill", 24)]
    for row in result["rows"]:
        assert row["ms"] > 0 and row["gbps"] > 0 and row["tflops"] > 0
        assert row["config"] == list(vars(get_moe_config(row["tokens"], 2, 8, 64, 48, torch.bfloat16)).values())
    assert "decode" in proc.stdout and "prefill" in proc.stdout  # the table
