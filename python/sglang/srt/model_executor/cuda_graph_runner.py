"""CudaGraphRunner: decode forwards captured once per batch-size bucket, then replayed.

A decode step's shapes depend only on its batch size, so each bucket (1, 2, 4, 8, 16, 24, ...,
--cuda-graph-max-bs) is captured once over static input buffers; a batch of size b replays the
smallest bucket >= b after copying its inputs into the buffers' first b rows. Padding rows point
at the padding request slot (an all-zero req_to_token row, i.e. the padding page), with seq_len 1
and KV slot 0, so they read and write only the padding page. The attention backend keeps its
decode metadata in buffers preallocated by `init_cuda_graph_state`.

Debug instrumentation that syncs (SGLANG_DEBUG_CHECKS) checks `torch.cuda.is_current_stream_capturing()`
and stays out of graphs. The graph mechanics go through `GraphBackend`, so the bookkeeping
(buckets, padding, buffer copies, output slicing) is unit-tested on CPU with a fake that re-runs
the captured function on replay.
"""

from __future__ import annotations

import bisect
import logging
from typing import Callable

import torch

from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


def get_batch_sizes_to_capture(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 8)) + [max_bs]
    return sorted(set(sizes))


class GraphBackend:
    """CUDA graphs: capture `fn` once, replay it on the same buffers."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], LogitsProcessorOutput]) -> tuple[object, LogitsProcessorOutput]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph, out

    def replay(self, graph, fn, out: LogitsProcessorOutput) -> None:
        graph.replay()


class EagerGraphBackend(GraphBackend):
    """The CPU stand-in: replay re-runs the function and writes into the captured outputs, which is
    what a graph replay does to its static output tensors."""

    def __init__(self) -> None:
        self.pool = None

    def capture(self, fn):
        return None, fn()

    def replay(self, graph, fn, out: LogitsProcessorOutput) -> None:
        out.next_token_logits.copy_(fn().next_token_logits)


class CudaGraphRunner:
    def __init__(self, model_runner, graph_backend: GraphBackend | None = None) -> None:
        self.model_runner = mr = model_runner
        self.graph_backend = graph_backend or GraphBackend()
        self.max_bs = min(mr.server_args.cuda_graph_max_bs, mr.max_running_requests)
        self.capture_bs = get_batch_sizes_to_capture(self.max_bs)
        dev = mr.device
        n = self.max_bs
        self.padding_slot = mr.req_to_token_pool.padding_slot
        self.buffers = {
            "input_ids": torch.zeros(n, dtype=torch.int64, device=dev),
            "positions": torch.zeros(n, dtype=torch.int64, device=dev),
            "req_pool_indices": torch.full((n,), self.padding_slot, dtype=torch.int64, device=dev),
            "seq_lens": torch.ones(n, dtype=torch.int64, device=dev),
            "out_cache_loc": torch.zeros(n, dtype=torch.int64, device=dev),
        }
        self.arange = torch.arange(n, dtype=torch.int64, device=dev)
        self.ones = torch.ones(n, dtype=torch.int64, device=dev)
        self.zeros = torch.zeros(n, dtype=torch.int64, device=dev)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, LogitsProcessorOutput] = {}
        self.static_batches: dict[int, ForwardBatch] = {}
        mr.attn_backend.init_cuda_graph_state(self.max_bs)
        self.capture()

    def _static_batch(self, bs: int) -> ForwardBatch:
        b = self.buffers
        mr = self.model_runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=b["input_ids"][:bs],
            positions=b["positions"][:bs], req_pool_indices=b["req_pool_indices"][:bs], seq_lens=b["seq_lens"][:bs],
            out_cache_loc=b["out_cache_loc"][:bs], extend_seq_lens=self.ones[:bs], extend_prefix_lens=self.zeros[:bs],
            extend_start_loc=self.arange[:bs], token_to_req=self.arange[:bs], seq_lens_cpu=[1] * bs,
            extend_seq_lens_cpu=[1] * bs, extend_prefix_lens_cpu=[0] * bs,
            req_to_token_pool=mr.req_to_token_pool, token_to_kv_pool=mr.token_to_kv_pool,
            attn_backend=mr.attn_backend)

    def _run(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        return self.model_runner.model.forward(fb.input_ids, fb.positions, fb)

    @torch.inference_mode()
    def capture(self) -> None:
        backend = self.model_runner.attn_backend
        for bs in reversed(self.capture_bs):  # largest first: later graphs reuse its memory
            fb = self._static_batch(bs)
            backend.init_forward_metadata_capture_cuda_graph(fb)
            for _ in range(2):  # warm up: compile kernels, settle the allocator
                self._run(fb)
            self.graphs[bs], self.outputs[bs] = self.graph_backend.capture(lambda fb=fb: self._run(fb))
            self.static_batches[bs] = fb
        logger.info("captured decode CUDA graphs for batch sizes %s", self.capture_bs)

    def can_run(self, fb: ForwardBatch) -> bool:
        return (fb.forward_mode.is_decode() and 0 < fb.batch_size <= self.max_bs and not fb.return_all_logits
                and int(fb.capture_hidden_mode) == 0)

    @torch.inference_mode()
    def replay(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        bs = fb.batch_size
        pbs = self.capture_bs[bisect.bisect_left(self.capture_bs, bs)]
        b = self.buffers
        for name in b:
            b[name][:bs].copy_(getattr(fb, name))
        if pbs > bs:
            b["input_ids"][bs:pbs].zero_()
            b["positions"][bs:pbs].zero_()
            b["req_pool_indices"][bs:pbs].fill_(self.padding_slot)
            b["seq_lens"][bs:pbs].fill_(1)
            b["out_cache_loc"][bs:pbs].zero_()
        static = self.static_batches[pbs]
        self.model_runner.attn_backend.init_forward_metadata_replay_cuda_graph(static)
        out = self.outputs[pbs]
        self.graph_backend.replay(self.graphs[pbs], lambda: self._run(static), out)
        return LogitsProcessorOutput(next_token_logits=out.next_token_logits[:bs])
