"""benchmark/kernels/tune_fp8.py end to end on CPU (--smoke: the Triton interpreter, tiny shapes, 2
configs per case): it writes tables the kernels then read, each entry the fastest candidate that
matched the twin. Cost: ~10 s on an idle 2-core CPU (a subprocess: the interpreter must be chosen
before triton is imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sgl_kernel import fp8_tables
from sgl_kernel.fp8_gemm import Fp8GemmConfig, get_gemm_config
from sgl_kernel.fp8_moe import Fp8MoEConfig, get_fp8_moe_config

REPO = Path(__file__).resolve().parents[4]
BLOCK = (128, 128)


def test_tuner_smoke_writes_tables_the_kernels_read(tmp_path, monkeypatch):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env.pop(fp8_tables.CONFIG_DIR_ENV, None)
    proc = subprocess.run([sys.executable, str(REPO / "benchmark" / "kernels" / "tune_fp8.py"), "--smoke",
                           "--out-dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "tune_fp8_cpu.json").read_text())
    gemm = json.loads((tmp_path / "fp8_gemm_cpu.json").read_text())["configs"]
    moe = json.loads((tmp_path / "fp8_moe_cpu.json").read_text())["configs"]
    assert set(gemm) == {"N=200,K=256"} and set(gemm["N=200,K=256"]) == {"1", "20"}
    assert set(moe) == {"E=8,H=256,I=128,k=2", "E=4,H=256,I=128,k=2"}
    for case in report["cases"]:
        cands = case["candidates"]
        assert len(cands) == 2 and all(c["rel_err"] < 2e-2 and c["ms"] > 0 for c in cands), case
        best = min(cands, key=lambda c: c["ms"])["config"]
        if case["kind"] == "fp8_gemm":
            assert gemm[f"N={case['n']},K={case['k']}"][str(case["m"])] == best
        else:
            assert moe[case["shape"]][str(case["tokens"])] == best
    monkeypatch.setenv(fp8_tables.CONFIG_DIR_ENV, str(tmp_path))
    fp8_tables.clear_cache()
    try:  # the kernels' config lookup now returns the tuned entries (nearest bucket)
        assert get_gemm_config(18, 200, 256, BLOCK, "cpu") == Fp8GemmConfig(**gemm["N=200,K=256"]["20"])
        assert get_fp8_moe_config(2, 2, 8, BLOCK, 256, 128, "cpu") == Fp8MoEConfig(**moe["E=8,H=256,I=128,k=2"]["1"])
    finally:
        monkeypatch.delenv(fp8_tables.CONFIG_DIR_ENV)
        fp8_tables.clear_cache()
