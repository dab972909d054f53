"""The FP8 kernels' heuristic and deterministic configs compile for Hopper (sm_90a) without register
spills, within its shared memory and with a pipelined K loop -- checked on CPU by Triton's compiler and
ptxas (benchmark/kernels/fp8_sm90_report.py --heuristics-only; a subprocess: the report compiles, the
suite interprets). Cost: ~10 s. Without a ptxas in the triton build the report cannot run: skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]


def _ptxas() -> str | None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(90).path
    except Exception:  # noqa: BLE001
        return None


@pytest.mark.skipif(_ptxas() is None or not Path(_ptxas()).exists(), reason="no ptxas in this triton build")
def test_heuristic_and_fixed_configs_compile_for_sm90_without_spills(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(REPO / "benchmark" / "kernels" / "fp8_sm90_report.py"), "--heuristics-only",
                           "--out-dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rows = json.loads((tmp_path / "fp8_sm90_report.json").read_text())["rows"]
    assert {r["kind"] for r in rows} == {"gemm", "moe"} and any(r["label"] == "fixed" for r in rows)
    for r in rows:
        parts = r["report"].values() if r["kind"] == "moe" else [r["report"]]
        for p in parts:
            assert p["spill_bytes"] == 0 and p["pipelined"] and p["regs"] <= 255, r
    # prefill-sized tiles reach the Hopper warpgroup MMA (wgmma), not the Ampere-style mma.sync
    big = [r for r in rows if r["kind"] == "gemm" and r["config"]["block_m"] >= 64]
    assert big and all(r["report"]["mma"] == "wgmma" for r in big)
