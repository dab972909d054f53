"""benchmark/indexcache/bench_indexcache.py end to end on CPU at a tiny size: it runs, writes JSON
and a plot, uses the one IndexCache rule for its schedules, reports medians of interleaved repeats,
and its memory figures follow the pool's formula (freq 4 drops the index-K bytes of every shared
layer). Timings are not asserted."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from sglang.srt.configs.index_layers import resolve_index_layer_schedule

_BENCH = Path(__file__).resolve().parents[4] / "benchmark" / "indexcache" / "bench_indexcache.py"


def test_bench_indexcache_cpu_smoke(tmp_path):
    cmd = [sys.executable, str(_BENCH), "--cpu-small", "--smoke", "--layers", "4", "--freqs", "1,4", "--contexts", "80",
           "--decode-batch", "1", "--decode-steps", "3", "--repeats", "3", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stem = tmp_path / "indexcache_deepseek-v32_cpu_small_smoke"
    result = json.loads(stem.with_suffix(".json").read_text())
    assert stem.with_suffix(".png").stat().st_size > 0
    assert result["index_topk"] == 64  # < the context: the sparse (indexer) path runs
    base, shared = result["runs"]
    assert (base["freq"], shared["freq"]) == (1, 4)
    for run in result["runs"]:
        expected = resolve_index_layer_schedule(
            4, [("flags", {"index_topk_freq": run["freq"], "index_skip_topk_offset": run["offset"]})])
        assert run["schedule"] == expected.describe() and run["full_layers"] == len(expected.full_layer_ids)
        (row,) = run["rows"]
        assert row["context"] == 80 and row["prefill_s"] > 0 and row["decode_step_s"] > 0
        assert 0 < row["prefill_indexer_share"] < 1 and 0 < row["decode_indexer_share"] < 1
        # interleaved repeats, median (what benchmark/RESULTS.md states)
        assert len(row["samples"]) == 3 and row["prefill_s"] == statistics.median(x["prefill_s"] for x in row["samples"])
    assert result["repeats"] == 3 and "interleaved" in result["method"] and "warm-up" in result["method"]
    few = subprocess.run(cmd[:-4] + ["--repeats", "2"] + cmd[-2:], capture_output=True, text=True, timeout=120)
    assert few.returncode == 2 and "--repeats must be >= 3" in few.stderr
    assert shared["schedule"] == "FFSS"
    per_layer = base["index_bytes_per_token"]
    assert base["kv_bytes_per_token"] - shared["kv_bytes_per_token"] == 2 * per_layer  # two shared layers
    assert abs(shared["kv_saved_vs_freq1"] - 2 * per_layer / base["kv_bytes_per_token"]) < 1e-9
