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


def test_shared_target_plain_side_is_plain_decoding():
    """--shared-target: plain calls run on the speculative engine's own target worker (no verify
    step, the EAGLE worker back in place after each call) and give a plain engine's tokens."""
    sys.path.insert(0, str(_ROOT / "benchmark/speculative"))
    from bench_speculative import TargetAsPlain

    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.model_executor.cuda_graph_runner import DECODE_SPEC, CudaGraphRunner, EagerGraphBackend
    from sglang.srt.speculative.eagle_worker import target_verify_spec

    common = dict(model_path="builtin:tiny-deepseek-v32-mtp", device="cpu", random_seed=0, disable_radix_cache=True,
                  max_total_tokens=4096, dtype="float32", nsa_index_k_dtype="float32",
                  max_running_requests=4, cuda_graph_max_bs=2,  # few captures: the interpreter is slow
                  # capturable backends (under the interpreter on CPU), as on a GPU
                  nsa_prefill_backend="triton", nsa_decode_backend="triton", moe_runner_backend="triton")
    prompts = [[5 + (7 * i + j) % 900 for j in range(9 + 4 * i)] for i in range(3)]
    sp = {"temperature": 0, "max_new_tokens": 9, "ignore_eos": True}
    ref = Engine(**common).generate(input_ids=prompts, sampling_params=sp)
    spec = Engine(**common, speculative_algorithm="EAGLE", speculative_num_steps=3)
    worker = spec.scheduler.tp_worker
    mr = worker.target.model_runner
    # the target's verify graphs, as on a GPU, through the CPU stand-in (it re-runs the captured call)
    mr.cuda_graph_runner = CudaGraphRunner(mr, EagerGraphBackend(), specs=(target_verify_spec(mr.model_config, 4),))
    plain = TargetAsPlain(spec)
    assert plain.target is worker.target and plain.target.num_tokens_per_req == 1
    assert DECODE_SPEC in mr.cuda_graph_runner.specs and len(mr.cuda_graph_runner.specs) == 2
    replayed = []
    replay = mr.cuda_graph_runner.replay
    mr.cuda_graph_runner.replay = lambda fb: replayed.append(mr.cuda_graph_runner.spec_for(fb)) or replay(fb)
    verifies = worker.num_verify_steps
    got = plain.generate(input_ids=prompts, sampling_params=sp)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    assert replayed and set(replayed) == {DECODE_SPEC}  # plain decode steps replay the added graphs
    assert worker.num_verify_steps == verifies and spec.scheduler.tp_worker is worker
    spec.generate(input_ids=prompts, sampling_params=sp)  # the speculative side still verifies
    assert worker.num_verify_steps > verifies and spec.scheduler.kv_leak_report() is None


def test_bench_speculative_smoke_shared_target(tmp_path):
    cmd = [sys.executable, str(_ROOT / "benchmark/speculative/bench_speculative.py"), "--smoke", "--shared-target",
           "--batch-sizes", "2", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "speculative_cpu_smoke.json").read_text())
    assert result["plain_side"] == "the speculative engine's target worker"
    row = result["batches"]["2"]
    assert row["accept_length"]["right"] == result["num_steps"] + 1 and row["decode_tok_s"]["plain"] > 0
