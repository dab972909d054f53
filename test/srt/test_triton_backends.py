"""The GPU serving path, on CPU under Triton's interpreter: the model through the Triton backends
(attention, indexer, top-k, KV stores, fused MoE) against transformers; a forward with no host
syncs; the decode CUDA-graph runner's bookkeeping with a stand-in graph; start-up errors.
(SGLANG_TEST_DEVICE=cuda runs the same on a GPU, compiled, with real CUDA graphs.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from sglang.srt.entrypoints.engine import Engine
from sglang.srt.model_executor.cuda_graph_runner import (
    DECODE_SPEC,
    CudaGraphRunner,
    EagerGraphBackend,
    get_batch_sizes_to_capture,
)
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.testing.reference import hf_greedy_generate, hf_prefill_logits, load_hf_reference
from sglang.srt.testing.runner_utils import prefill_all_logits
from sglang.srt.testing.sync_guard import HostSyncError, no_host_sync

DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
LOGIT_ATOL = 1e-4  # as test_model_parity: fp32 weights, exact index K
TRITON = dict(nsa_prefill_backend="triton", nsa_decode_backend="triton", moe_runner_backend="triton")
PROMPT_LENS = [5, 45, 70]  # index_topk 32: two of three prompts select sparsely
NEW_TOKENS = 6


def _prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 1000, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _engine(path: str, page_size: int = 1, **kw) -> Engine:
    args = dict(model_path=path, dtype="float32", device=DEVICE, page_size=page_size, max_total_tokens=2048,
                nsa_index_k_dtype="float32", random_seed=0, disable_cuda_graph=True, **TRITON)
    args.update(kw)
    return Engine(**args)


@pytest.mark.parametrize("name,page_size", [("tiny-deepseek-v32", 64), ("tiny-glm-moe-dsa-shared", 1),
                                            ("tiny-deepseek-v3", 1)])
def test_triton_path_matches_transformers(name, page_size, builtin_path):
    """Prefill logits and greedy decode through every Triton kernel equal the reference's
    (V3.2 with paged FP8-layout pools; GLM-5 with IndexCache sharing; V3 dense MLA)."""
    path = builtin_path(name)
    hf = load_hf_reference(path)
    engine = _engine(path, page_size)
    prompts = _prompts()
    for prompt, ours in zip(prompts, prefill_all_logits(engine.scheduler.tp_worker.model_runner, prompts)):
        err = (ours - hf_prefill_logits(hf, prompt)).abs().max().item()
        assert err < LOGIT_ATOL, (name, len(prompt), err)
    outs = engine.generate(input_ids=prompts,
                           sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True})
    for prompt, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy_generate(hf, prompt, NEW_TOKENS), (name, len(prompt))
    assert engine.scheduler.kv_leak_report() is None


def _decode_batch(engine: Engine, prompts: list[list[int]]) -> ForwardBatch:
    """Prefill `prompts` through the scheduler, then build (without running) their first decode batch."""
    sched = engine.scheduler
    for p in prompts:
        engine._submit(None, p, {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}, False, -1, 0)
    while sched.waiting_queue or sched.chunked_req or sched.overlap.launched:
        sched.step()
    batch = sched.get_next_batch_to_run()
    assert batch.forward_mode == ForwardMode.DECODE and len(batch.reqs) == len(prompts)
    fb = sched.tp_worker.build_forward_batch(batch)
    sched.tp_worker.resolve_input_ids(fb)  # decode ids come from the device token table
    return fb


@pytest.mark.parametrize("attn", ["triton", "torch"])
def test_forward_makes_no_host_sync(attn, builtin_path):
    """A decode step and a prefill run without any device->host read in the forward (on a GPU:
    CUDA sync debug mode "error"). The torch attention backend keeps the rule too; MoE is Triton
    (the torch MoE reference loops over experts on the host)."""
    engine = _engine(builtin_path("tiny-deepseek-v32"), 1, nsa_prefill_backend=attn, nsa_decode_backend=attn,
                     nsa_index_k_dtype="fp8_e4m3")
    mr = engine.scheduler.tp_worker.model_runner
    fb = _decode_batch(engine, _prompts())
    with no_host_sync():
        mr.forward(fb)
    sched = engine.scheduler
    for p in _prompts(2):
        engine._submit(None, p, {"max_new_tokens": 1}, False, -1, 0)
    batch = sched.get_next_batch_to_run()
    assert batch.forward_mode == ForwardMode.EXTEND
    fb = sched.tp_worker.build_forward_batch(batch)
    with no_host_sync():
        mr.forward(fb)
    # the guard is real: our code reading a value back inside it fails (the debug checks do)
    from sglang.srt.debug.checks import assert_topk_matches_batch

    with pytest.raises(HostSyncError), no_host_sync():
        assert_topk_matches_batch(torch.zeros(fb.num_tokens, 4, dtype=torch.int32, device=fb.positions.device),
                                  fb, 0)


def test_capture_sizes():
    assert get_batch_sizes_to_capture(160)[:6] == [1, 2, 4, 8, 16, 24] and get_batch_sizes_to_capture(160)[-1] == 160
    assert get_batch_sizes_to_capture(5) == [1, 2, 4, 5] and get_batch_sizes_to_capture(1) == [1]


def test_graph_runner_replays_padded_batches_like_eager(builtin_path):
    """The runner copies a batch into its bucket's static buffers, pads the rest with the padding
    request (padding page), replays, and returns the first bs rows: equal to the eager forward."""
    engine = _engine(builtin_path("tiny-deepseek-v32"), 1, cuda_graph_max_bs=4, max_running_requests=4)
    mr = engine.scheduler.tp_worker.model_runner
    # KV-pool layer-end hooks see eager forwards only: none during capture or replay
    layer_ends = []
    mr.token_to_kv_pool.register_layer_end_callback(layer_ends.append)
    runner = CudaGraphRunner(mr, EagerGraphBackend())
    assert runner.capture_bs == [1, 2, 4] and layer_ends == []
    fb = _decode_batch(engine, _prompts())  # bs 3 -> bucket 4
    assert runner.can_run(fb)
    layer_ends.clear()
    eager = mr.forward(fb).next_token_logits.clone()
    assert layer_ends == list(range(mr.model_config.num_kv_layers))
    layer_ends.clear()
    got = runner.replay(fb).next_token_logits
    assert layer_ends == []
    assert got.shape == eager.shape and torch.allclose(got, eager, atol=1e-5)
    buffers = runner.buffers[DECODE_SPEC].inputs
    pad = buffers["req_pool_indices"][3].item()
    assert pad == mr.req_to_token_pool.padding_slot and mr.req_to_token_pool.req_to_token[pad].eq(0).all()
    assert buffers["out_cache_loc"][3].item() == 0  # padding rows write the padding page only


def test_triton_backend_without_a_gpu_is_a_startup_error(builtin_path):
    code = ("from sglang.srt.server_args import ServerArgs;"
            "ServerArgs.from_kwargs(model_path='builtin:tiny-deepseek-v32', device='cpu', "
            "nsa_decode_backend='triton').resolve()")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0 and "--nsa-decode-backend: triton needs a CUDA device" in proc.stderr


def test_server_through_triton_backends_matches_transformers(builtin_path):
    """The HTTP server with every Triton backend forced (prefill, decode, MoE) serves concurrent
    requests whose greedy tokens equal transformers'."""
    import requests
    from concurrent.futures import ThreadPoolExecutor

    from sglang.srt.testing.server import ServerProcess

    path = builtin_path("tiny-deepseek-v32")
    hf = load_hf_reference(path)
    prompts = _prompts(3)
    args = ("--nsa-prefill-backend", "triton", "--nsa-decode-backend", "triton", "--moe-runner-backend", "triton",
            "--nsa-index-k-dtype", "float32", "--max-total-tokens", "2048", "--random-seed", "0")

    def gen(url, ids):
        return requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}, timeout=600).json()

    with ServerProcess("builtin:tiny-deepseek-v32", *args, timeout=600) as server:
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda p: gen(server.base_url, p), prompts))
        st = server.wait_idle()
    for prompt, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy_generate(hf, prompt, NEW_TOKENS), len(prompt)
    assert st["kv_leak"] is None


def test_cuda_graph_decode_equals_eager(builtin_path):
    """Greedy tokens with decode replayed from (CUDA) graphs equal eager decoding, for batches
    that fill a bucket and batches that are padded. On CPU the stand-in graph re-runs the captured
    function over the static buffers, which checks the runner's bookkeeping end to end."""
    path = builtin_path("tiny-glm-moe-dsa")
    prompts = _prompts(4) + [[7, 8, 9], [11] * 20]  # 5 requests: replayed from the bs-8 bucket, padded
    sp = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    eager = _engine(path, 64 if DEVICE == "cuda" else 1).generate(input_ids=prompts, sampling_params=sp)
    graphs = _engine(path, 64 if DEVICE == "cuda" else 1, disable_cuda_graph=False, cuda_graph_max_bs=8)
    mr = graphs.scheduler.tp_worker.model_runner
    if DEVICE != "cuda":
        mr.cuda_graph_runner = CudaGraphRunner(mr, EagerGraphBackend())
    assert mr.cuda_graph_runner is not None
    replays = []
    original = mr.cuda_graph_runner.replay
    mr.cuda_graph_runner.replay = lambda fb: replays.append(fb.batch_size) or original(fb)
    got = graphs.generate(input_ids=prompts, sampling_params=sp)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in eager]
    assert len(replays) == NEW_TOKENS - 1 and set(replays) == {len(prompts)}  # every decode step replayed
    assert graphs.scheduler.kv_leak_report() is None
