"""benchmark/hicache/bench_handoff.py runs (smoke sizes): both modes timed, JSON, plot and table written."""

import json
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[4]


def test_bench_handoff_smoke(tmp_path):
    cmd = [sys.executable, str(_ROOT / "benchmark/hicache/bench_handoff.py"), "--smoke", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "handoff_smoke.json").read_text())
    for mode in ("on", "off"):
        assert res[mode]["start_after_submit_us"] > 0 and res[mode]["load_call_us"] > 0
    assert res["start_delay_ratio_off_over_on"] > 0 and "hand-over on" in proc.stdout
    assert (tmp_path / "handoff_smoke.png").stat().st_size > 0
