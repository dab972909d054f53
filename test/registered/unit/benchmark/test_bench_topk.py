"""benchmark/kernels/bench_topk.py --smoke end to end on CPU (Triton interpreter, tiny shapes): it
checks every case bit-exact against the torch twin (it exits non-zero otherwise), writes JSON and a
plot, and reports every variant against the torch baselines. Timings are not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_BENCH = Path(__file__).resolve().parents[4] / "benchmark" / "kernels" / "bench_topk.py"


def test_bench_topk_cpu_smoke(tmp_path):
    cmd = [sys.executable, str(_BENCH), "--smoke", "--reps", "1", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bit-exact" in proc.stdout
    result = json.loads((tmp_path / "topk_cpu_smoke.json").read_text())
    assert (tmp_path / "topk_cpu_smoke.png").stat().st_size > 0
    assert result["k"] == 16 and len(result["rows"]) == 3
    variants = {"auto:b128", "s3:r8:b128"}
    for row in result["rows"]:
        assert set(row["ms"]) == variants | {"torch", "torch_masked"}
        assert all(ms > 0 for ms in row["ms"].values()) and set(row["speedup_vs_torch"]) == variants
    prefill = result["rows"][-1]
    assert prefill["causal"] and prefill["bytes"] == 4 * sum(r * 384 // 12 + 1 for r in range(12))
