"""benchmark/speculative/bench_speculative.py runs (smoke sizes) and writes its JSON, plot and table;
its forced modes accept what they force (the script itself checks outputs equal plain decoding)."""

import json
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[4]


def test_bench_speculative_smoke(tmp_path):
    cmd = [sys.executable, str(_ROOT / "benchmark/speculative/bench_speculative.py"), "--smoke", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "speculative_cpu_smoke.json").read_text())
    for row in result["batches"].values():
        assert row["accept_length"]["right"] == result["num_steps"] + 1 and row["accept_length"]["wrong"] == 1.0
        assert set(row["speedup"]) == set(row["decode_speedup"]) == {"natural", "wrong", "right"}
        assert all(v > 0 for v in row["decode_tok_s"].values()) and row["prefill_seconds"]["spec"] > 0
    assert (tmp_path / "speculative_cpu_smoke.png").stat().st_size > 0 and "right tok/s" in proc.stdout
    assert "decode only: plain" in proc.stdout
