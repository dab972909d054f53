"""The GPU-path scripts run end to end on CPU (tiny shapes, Triton interpreter), so they are not
dead code between device runs: the attention-kernel benchmark (it checks every case against the
torch twins and exits non-zero otherwise), the end-to-end benchmark (both sides, JSON + plot),
and the sm_90 compile check of every serving kernel launch. Timings are not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[4]


def _run(args: list[str], env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    return proc


def test_attention_kernel_bench_smoke(tmp_path):
    _run([str(_ROOT / "benchmark/kernels/bench_attention_kernels.py"), "--smoke", "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "attention_kernels_smoke.json").read_text())
    kinds = {r["kernel"] for r in result["rows"]}
    assert {"sparse MLA decode", "sparse MLA prefill", "indexer scores prefill", "indexer top-k decode"} <= kinds
    scores = [r for r in result["rows"] if r["kernel"].startswith("indexer scores")]
    assert all(set(r["best_ms_by_head_sum"]) == {"dot", "sum"} for r in scores)  # both head sums timed
    assert (tmp_path / "attention_kernels_smoke.png").stat().st_size > 0


def test_e2e_bench_smoke(tmp_path):
    # the hf_eager side is the same code path as hf with another attention: not run here (~15 s)
    out = _run([str(_ROOT / "benchmark/e2e/bench_e2e_vs_hf.py"), "--smoke", "--sides", "ours,ours_sync,hf",
                "--out-dir", str(tmp_path)]).stdout
    result = json.loads((tmp_path / "e2e_deepseek-v32_3l_smoke.json").read_text())
    assert set(result["ours"]["generate"]) == set(result["hf"]["generate"]) == {"1", "2"}
    assert {"generate_bs1", "generate_bs2", "prefill_64", "overlap_step_bs1", "overlap_generate_bs2"} <= set(result["ratios"])
    assert "median_step_ms" in result["ours_sync"]["generate"]["2"] and "overlap speedup" in out
    assert "median_step_ms" in result["ours"]["generate"]["1"] and "generate bs 2 tok/s" in out
    assert (tmp_path / "e2e_deepseek-v32_3l_smoke.png").stat().st_size > 0



def test_e2e_bench_experts_and_hf_experts_implementation(tmp_path):
    """--experts overrides n_routed_experts on both sides, transformers runs the named experts
    implementation and the JSON records what it resolved to; the engine prefills in chunks."""
    _run([str(_ROOT / "benchmark/e2e/bench_e2e_vs_hf.py"), "--smoke", "--layers", "2", "--experts", "4",
          "--hf-experts-implementation", "eager", "--sides", "ours,hf", "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "e2e_deepseek-v32_2l_4e_smoke.json").read_text())
    assert result["config_overrides"] == {"n_routed_experts": 4} and result["chunked_prefill_size"] == 32
    assert result["hf_experts_implementation_requested"] == "eager"
    assert result["hf"]["implementation"]["experts_implementation"] == "eager"
    assert result["ours"]["prefill"]["64"]["tok_s"] > 0 and "prefill_64" in result["ratios"]


def test_e2e_bench_bad_experts_fail_before_running():
    proc = subprocess.run([sys.executable, str(_ROOT / "benchmark/e2e/bench_e2e_vs_hf.py"), "--experts", "12"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--experts 12" in proc.stderr and "--experts 16" in proc.stderr


def test_memory_fit_smoke(tmp_path):
    """benchmark/e2e/memory_fit.py (the memory plan's GPU check) on CPU: one config in its own
    process, the load-alone step and every admitted-request case, JSON written."""
    out = _run([str(_ROOT / "benchmark/e2e/memory_fit.py"), "--smoke", "--server-configs", "2x4",
                "--out-dir", str(tmp_path)]).stdout
    result = json.loads((tmp_path / "memory_fit_smoke.json").read_text())
    cfg, srv = result["configs"]["2x4"], result["configs"]["server:2x4"]
    assert cfg["load_alone"]["param_bytes"] > 0 and cfg["plan"] is None  # CPU: no device plan
    names = {"max_prefill_one_prompt", "max_prefill_4_prompts", "long_prompt", "prompt_logprobs",
             "decode_256_requests"}
    assert set(cfg["cases"]) == set(srv["cases"]) == names
    assert all(c["ok"] for r in (cfg, srv) for c in r["cases"].values())
    assert cfg["cases"]["long_prompt"]["tokens"] == 96 and srv["cases"]["decode_256_requests"]["status"] == 200
    assert "every config fits" in out

def test_every_serving_kernel_compiles_for_sm90():
    """The interpreter never runs Triton's compiler: this builds each launch of the serving path at
    real V3.2 shapes for the H200 and checks shared memory, with no GPU -- the MLA at the backend's
    decode tiles (narrow, wide, deterministic) and extend tile, over bf16 and FP8 KV rows (the FP8
    rows at the 3-stage tiles once needed 279 KB of shared memory: a launch failure on the GPU)."""
    out = _run([str(_ROOT / "scripts/compile_sm90.py")], env={"TRITON_INTERPRET": "0"}).stdout
    assert " 0 failed" in out and "_mla_fwd_kernel" in out and "_gate_up_kernel" in out
    assert "'BLOCK_H': 64" in out and "'BLOCK_H': 32" in out and "'FP8': True" in out


def test_cp_bench_smoke(tmp_path):
    """benchmark/cp (issue 12's prefill-vs-length run) on CPU: cp 1 and 2 over gloo, JSON + plot."""
    _run([str(_ROOT / "benchmark/cp/bench_cp.py"), "--cp-sizes", "1,2", "--lens", "48,96", "--repeats", "1",
          "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "cp_prefill_cpu.json").read_text())
    assert {(r["cp"], r["len"]) for r in result["rows"]} == {(1, 48), (1, 96), (2, 48), (2, 96)}
    assert all(r["narrow_gather_elems"] > 0 for r in result["rows"] if r["cp"] == 2)
    assert (tmp_path / "cp_prefill_cpu.png").stat().st_size > 0


def test_hicache_bench_smoke(tmp_path):
    """bench_hicache.py on CPU: every backend x layout x map round-trips exactly, each op's phases are
    stamped (hand-off, plan on the copy thread, enqueue, copy wait, wake), the deep op (`--copy-layers`)
    runs on its own pool, the goals block is written."""
    _run([str(_ROOT / "benchmark/hicache/bench_hicache.py"), "--smoke", "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "hicache_cpu.json").read_text())
    rows = result["copy"]["rows"]
    assert rows and all(r["round_trip_exact"] for r in rows)
    deep = result["copy_deep"]  # one op at a model's depth on a pool of the engine's rows
    assert deep["layers"] == 5 and deep["layers"] != result["copy"]["layers"]
    assert deep["bytes"] > result["copy"]["bytes"] and all(r["round_trip_exact"] for r in deep["rows"])
    assert result["goals"]["copy_layers"] == 5 and result["goals"]["copy_ratio_min_engine_layers"] > 0
    for kind in ("backup", "load"):
        for phase in ("handoff", "plan", "enqueue", "copy_wait", "wake"):
            assert all(r[f"{kind}_{phase}_us"] >= 0 for r in rows), (kind, phase)
    assert {"copy_ratio_min", "host_hit_speedup", "backup_overhead", "reload_exact", "met"} <= set(result["goals"])


def test_hicache_handoff_bench_smoke(tmp_path):
    """bench_handoff.py: both modes timed (the load's start after submit, the load() call), JSON, plot, table."""
    out = _run([str(_ROOT / "benchmark/hicache/bench_handoff.py"), "--smoke", "--out-dir", str(tmp_path)]).stdout
    res = json.loads((tmp_path / "handoff_smoke.json").read_text())
    for mode in ("on", "off"):
        assert res[mode]["start_after_submit_us"] > 0 and res[mode]["load_call_us"] > 0
    assert res["start_delay_ratio_off_over_on"] > 0 and "hand-over on" in out
    assert (tmp_path / "handoff_smoke.png").stat().st_size > 0


def test_overlap_step_bench_smoke_eagle_hot_vocab(tmp_path):
    """bench_overlap_step's eagle mode with an FR-Spec draft head (--hot-vocab): the map is written
    and served, the speculative step timed, the JSON records the head's size."""
    out = _run([str(_ROOT / "benchmark/overlap/bench_overlap_step.py"), "--smoke", "--modes", "eagle",
                "--hot-vocab", "64", "--batch-sizes", "1", "--out-dir", str(tmp_path)]).stdout
    result = json.loads((tmp_path / "overlap_deepseek-v32_2l_smoke.json").read_text())
    assert result["hot_vocab"] == 64 and result["modes"]["eagle"]["1"]["step_ms"] > 0
    assert (tmp_path / "hot_64.pt").exists() and "eagle" in out
