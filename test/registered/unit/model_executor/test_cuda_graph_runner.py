"""The graph runner by spec, on CPU with the stand-in graph backend and a fake model: a decode spec
and a 2-token spec with an extra static input and an extra output (the shape of a speculative
target-verify graph) are captured per (spec, bucket) and replay equal to the eager forward, padding
requests touching only the padding slot / page; and the start-up decision whether decode runs
from CUDA graphs (attention backend AND MoE runner AND token dispatcher). Fast."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.moe.fused_moe import FusedMoE
from sglang.srt.layers.moe.moe_registry import MOE_RUNNER_BACKENDS, MOE_RUNNERS, TOKEN_DISPATCHERS, get_dispatcher_class
from sglang.srt.model_executor.cuda_graph_runner import (
    DECODE_SPEC,
    CudaGraphRunner,
    EagerGraphBackend,
    GraphSpec,
    StaticInput,
    cuda_graph_decision,
)
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode, SpecInput
from sglang.srt.server_args import ServerArgs
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

HIDDEN, VOCAB, KV_SLOTS, PAD_SLOT = 3, 5, 64, 8
VERIFY = GraphSpec("verify2", ForwardMode.EXTEND, tokens_per_req=2,
                   extra_inputs=(StaticInput("spec.hidden_states", (HIDDEN,), torch.float32, pad=-1.0),),
                   extra_outputs=("hidden_states",))


class FakeBackend:
    supports_cuda_graph = True

    def __init__(self) -> None:
        self.calls = []

    def init_cuda_graph_state(self, max_bs):
        self.calls.append(("state", max_bs))

    def init_forward_metadata_capture_cuda_graph(self, fb):
        self.calls.append(("capture", fb.forward_mode, fb.batch_size, fb.num_tokens))

    def init_forward_metadata_replay_cuda_graph(self, fb):
        self.calls.append(("replay", fb.forward_mode, fb.batch_size))


class FakeModel:
    """Every output row depends on every per-token / per-request input, and the forward 'stores KV'
    at out_cache_loc, so a wrong copy, a wrong padding value or a wrong slice shows."""

    def __init__(self) -> None:
        self.kv = torch.zeros(KV_SLOTS)
        self.req_to_token = torch.zeros(PAD_SLOT + 1, 32, dtype=torch.int64)

    def forward(self, input_ids, positions, fb: ForwardBatch) -> LogitsProcessorOutput:
        r = fb.token_to_req
        self.kv[fb.out_cache_loc] = input_ids.float()
        read = self.kv[self.req_to_token[fb.req_pool_indices[r], positions]]  # reads the KV it may use
        row = (input_ids * 1000 + positions * 100 + fb.req_pool_indices[r] * 10 + fb.seq_lens[r]
               + fb.extend_prefix_lens[r]).float() + read
        if fb.spec is not None:
            row = row + fb.spec.hidden_states.sum(-1)
        logits = row[:, None] + torch.arange(VOCAB)
        if fb.forward_mode == ForwardMode.DECODE:  # one row per request, as the logits processor gives
            return LogitsProcessorOutput(next_token_logits=logits)
        hidden = fb.spec.hidden_states * 2 + positions[:, None]
        return LogitsProcessorOutput(next_token_logits=logits, hidden_states=hidden)  # every token's row


def _model_runner(max_bs: int = 4):
    return SimpleNamespace(server_args=SimpleNamespace(cuda_graph_max_bs=max_bs), max_running_requests=PAD_SLOT,
                           device="cpu", req_to_token_pool=SimpleNamespace(padding_slot=PAD_SLOT),
                           token_to_kv_pool=MLATokenToKVPool(4, 1, torch.float32, 4, 2, 1), attn_backend=FakeBackend(), model=FakeModel())


def _batch(mode: ForwardMode, n: int, reqs: list[int], prefix: list[int], seed: int = 0) -> ForwardBatch:
    g = torch.Generator().manual_seed(seed)
    t = n * len(reqs)
    ids = torch.randint(1, 50, (t,), generator=g)
    loc = torch.randperm(KV_SLOTS - 1, generator=g)[:t] + 1  # never the padding slot 0
    fb = ForwardBatch.build(mode, ids, reqs, prefix, [n] * len(reqs), loc)
    if n > 1:
        fb.spec = SpecInput(torch.randn(t, HIDDEN, generator=g))
    return fb


def test_specs_are_captured_per_bucket_and_replay_like_eager():
    mr = _model_runner()
    model = mr.model
    model.req_to_token[:PAD_SLOT] = torch.randint(1, KV_SLOTS, (PAD_SLOT, 32), generator=torch.Generator().manual_seed(3))
    runner = CudaGraphRunner(mr, EagerGraphBackend(), specs=(DECODE_SPEC, VERIFY))
    assert runner.capture_bs == [1, 2, 4]
    assert set(runner.graphs) == {(s, bs) for s in (DECODE_SPEC, VERIFY) for bs in (1, 2, 4)}
    captured = [c[1:] for c in mr.attn_backend.calls if c[0] == "capture"]
    assert (ForwardMode.EXTEND, 4, 8) in captured and (ForwardMode.DECODE, 4, 4) in captured
    assert mr.attn_backend.calls[0] == ("state", 4)
    assert runner.buffers[VERIFY].inputs["input_ids"].shape == (8,)  # padded_bs * tokens_per_req

    verify = _batch(ForwardMode.EXTEND, 2, [5, 1, 3], [7, 2, 9])  # bs 3 -> bucket 4
    decode = _batch(ForwardMode.DECODE, 1, [5, 1, 3], [9, 4, 11], seed=1)
    assert runner.spec_for(verify) is VERIFY and runner.spec_for(decode) is DECODE_SPEC
    for fb in (verify, decode):
        model.kv.zero_()
        eager = model.forward(fb.input_ids, fb.positions, fb)
        kv_eager = model.kv.clone()
        model.kv.zero_()
        got = runner.replay(fb)
        assert torch.equal(got.next_token_logits, eager.next_token_logits)
        if fb is verify:
            assert got.next_token_logits.shape == (6, VOCAB)  # k = 2 rows per request kept for bs 3
            assert torch.equal(got.hidden_states, eager.hidden_states)
        # the padding request wrote only the padding page (slot 0), and read only it
        assert torch.equal(model.kv[1:], kv_eager[1:])
    b = runner.buffers[VERIFY].inputs
    assert b["req_pool_indices"][3].item() == PAD_SLOT and b["seq_lens"][3].item() == 2
    assert b["out_cache_loc"][6:8].tolist() == [0, 0] and b["positions"][6:8].tolist() == [0, 1]
    assert b["spec.hidden_states"][6:8].eq(-1).all()  # the StaticInput's pad value
    assert ("replay", ForwardMode.EXTEND, 4) in mr.attn_backend.calls


def test_replay_pads_again_after_a_larger_batch():
    """A smaller batch after a larger one in the same bucket: stale rows are re-padded."""
    mr = _model_runner()
    runner = CudaGraphRunner(mr, EagerGraphBackend(), specs=(VERIFY,))
    runner.replay(_batch(ForwardMode.EXTEND, 2, [0, 1, 2, 3], [1, 1, 1, 1]))
    small = _batch(ForwardMode.EXTEND, 2, [4, 6, 7], [3, 3, 3], seed=2)
    eager = mr.model.forward(small.input_ids, small.positions, small)
    assert torch.equal(runner.replay(small).next_token_logits, eager.next_token_logits)
    assert runner.buffers[VERIFY].inputs["req_pool_indices"][3].item() == PAD_SLOT


def test_batches_no_spec_fits_run_eagerly():
    runner = CudaGraphRunner(_model_runner(), EagerGraphBackend(), specs=(DECODE_SPEC, VERIFY))
    assert not runner.can_run(ForwardBatch.build(ForwardMode.EXTEND, [1, 2, 3], [0, 1], [0, 0], [2, 1],
                                                 torch.arange(1, 4)))  # uneven tokens per request
    assert not runner.can_run(_batch(ForwardMode.EXTEND, 2, list(range(5)), [1] * 5))  # bs 5 > max 4
    assert not runner.can_run(_batch(ForwardMode.EXTEND, 3, [0], [1]))  # 3 tokens: no such spec
    fb = _batch(ForwardMode.DECODE, 1, [0, 1], [1, 1])
    fb.return_all_logits = True
    assert not runner.can_run(fb)
    with pytest.raises(ValueError, match="can_run"):
        runner.replay(fb)
    with pytest.raises(ValueError, match="distinct names"):
        CudaGraphRunner(_model_runner(), EagerGraphBackend(), specs=(VERIFY, VERIFY))


# -- whether decode runs from graphs ----------------------------------------------------------------
def _decision(attn_ok=True, runner="triton", dispatcher="local", **sa):
    args = ServerArgs(**{"model_path": "x", "device": "cuda", "nsa_decode_backend": "triton", **sa})
    moe = FusedMoE(4, 8, 8)
    moe.set_runner(runner)
    moe.dispatcher = get_dispatcher_class(dispatcher).__new__(get_dispatcher_class(dispatcher))
    return cuda_graph_decision(args, SimpleNamespace(supports_cuda_graph=attn_ok), nn.ModuleList([moe]))


def test_graphs_need_attention_moe_runner_and_dispatcher_to_be_capturable():
    assert _decision() == (True, "")
    ok, why = _decision(runner="torch", moe_runner_backend="torch")
    assert not ok and "--moe-runner-backend torch cannot be captured" in why and "host sync" in why
    assert why.startswith("decode runs eagerly: ") and why.endswith("use triton")
    ok, why = _decision(attn_ok=False, nsa_decode_backend="torch")
    assert not ok and "--nsa-decode-backend torch" in why
    ok, why = _decision(dispatcher="all_to_all", ep_size=2)
    assert not ok and "AllToAllDispatcher" in why and "--ep-size 1" in why
    ok, why = _decision(dispatcher="deepep")
    assert not ok and "DeepEPDispatcher" in why
    assert _decision(disable_cuda_graph=True) == (False, "decode runs eagerly: --disable-cuda-graph")
    assert not _decision(device="cpu")[0]
    ok, why = cuda_graph_decision(ServerArgs(model_path="x", device="cuda"), SimpleNamespace(supports_cuda_graph=True),
                                  nn.ModuleList(), context_parallel=True)
    assert not ok and "context parallel" in why


def test_registries():
    assert MOE_RUNNER_BACKENDS == ["auto", "torch", "triton"]
    assert MOE_RUNNERS["triton"].supports_cuda_graph and not MOE_RUNNERS["torch"].supports_cuda_graph
    assert {k: get_dispatcher_class(k).supports_cuda_graph for k in TOKEN_DISPATCHERS} == {
        "local": True, "all_to_all": False, "deepep": False}
    from sglang.srt.layers.moe.fused_moe_native import fused_experts_native

    assert MOE_RUNNERS["torch"].load() is fused_experts_native
    field = next(f for f in dataclasses.fields(ServerArgs) if f.name == "moe_runner_backend")
    assert field.metadata["choices"] == MOE_RUNNER_BACKENDS
