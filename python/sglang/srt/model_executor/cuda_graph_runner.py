"""CudaGraphRunner: forwards captured once per (GraphSpec, batch-size bucket), then replayed.

A `GraphSpec` names one kind of capturable forward: its forward mode, the tokens every request
adds (decode: 1; a speculative target-verify: the draft length + 1), the extra static inputs the
model reads from the ForwardBatch (e.g. the draft's target hidden states) and the outputs the
caller gets back. Decode is the spec `DECODE_SPEC`; target-verify and draft-decode graphs are new
specs passed to the same runner, not new runners.

A captured forward's shapes depend only on its padded batch size, so each bucket (1, 2, 4, 8, 16,
24, ..., --cuda-graph-max-bs) is captured once per spec over static input buffers sized
padded_bs * tokens_per_req; a batch of size b replays the smallest bucket >= b after copying its
inputs into the buffers' first rows. Padding requests point at the padding request slot (an
all-zero req_to_token row, i.e. the padding page) with KV slot 0, positions 0..n-1 and seq_len n
(n = tokens per request), so they read and write only the padding page. The attention backend
keeps its metadata in buffers preallocated by `init_cuda_graph_state`.

Debug instrumentation that syncs (SGLANG_DEBUG_CHECKS) checks `torch.cuda.is_current_stream_capturing()`
and stays out of graphs. The graph mechanics go through `GraphBackend`, so the bookkeeping
(buckets, padding, buffer copies, output slicing) is unit-tested on CPU with a fake that re-runs
the captured function on replay.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode, SpecInput

logger = logging.getLogger(__name__)


def get_batch_sizes_to_capture(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 8)) + [max_bs]
    return sorted(set(sizes))


# -- what a graph captures ---------------------------------------------------------------------------
@dataclass(frozen=True)
class StaticInput:
    """An extra ForwardBatch input a spec's model reads, kept in a static buffer. `name`: a
    ForwardBatch attribute, or "spec.<field>" for a field of its SpecInput (the draft's inputs).

    `rows`: "token" (one row per token, padded_bs * tokens_per_req rows) or "req" (one per request).
    `shape`: the trailing shape of a row. Padding rows are filled with `pad`."""

    name: str
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    rows: str = "token"
    pad: float = 0

    def __post_init__(self) -> None:
        if self.rows not in ("token", "req"):
            raise ValueError(f"StaticInput {self.name}: rows must be 'token' or 'req', got {self.rows!r}")


@dataclass(frozen=True)
class GraphSpec:
    """One capturable forward. `extra_outputs` name LogitsProcessorOutput fields returned beside
    `next_token_logits`; every output is sliced to the real requests' rows (an output with k rows
    per request keeps bs * k rows). A batch runs from this spec's graphs when its forward mode and
    capture-hidden mode match and every request adds exactly `tokens_per_req` tokens."""

    name: str
    forward_mode: ForwardMode
    tokens_per_req: int = 1
    extra_inputs: tuple[StaticInput, ...] = ()
    extra_outputs: tuple[str, ...] = ()
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    # Batch rows per scheduled request (a decode-shaped verify runs one row per verified token):
    # the runner's buckets reach min(--cuda-graph-max-bs, max running requests) * batch_scale.
    batch_scale: int = 1

    @property
    def outputs(self) -> tuple[str, ...]:
        return ("next_token_logits", *self.extra_outputs)

    def matches(self, fb: ForwardBatch) -> bool:
        n = self.tokens_per_req
        if fb.logits_row_indices is not None or (fb.spec is not None and fb.spec.topk_indices is not None and not any(
                x.name == "spec.topk_indices" for x in self.extra_inputs)):
            return False  # inputs the captured forward would not read
        return (fb.forward_mode == self.forward_mode and int(fb.capture_hidden_mode) == int(self.capture_hidden_mode)
                and fb.num_tokens == fb.batch_size * n and all(e == n for e in fb.extend_seq_lens_cpu))


DECODE_SPEC = GraphSpec("decode", ForwardMode.DECODE)


def cuda_graph_decision(server_args, attn_backend, model: torch.nn.Module,
                        context_parallel: bool = False) -> tuple[bool, str]:
    """(enabled, reason): decode is captured only when every part its forward runs can be -- the
    attention backend, each MoE layer's expert runner and its token dispatcher. `reason` is the
    start-up message naming the part and the flag to change ("" when enabled)."""
    from sglang.srt.layers.moe.fused_moe import FusedMoE
    from sglang.srt.layers.moe.moe_registry import get_moe_runner

    sa = server_args
    eager = "decode runs eagerly: "
    if sa.device != "cuda":
        return False, eager + f"CUDA graphs need a CUDA device (--device {sa.device})"
    if sa.disable_cuda_graph:
        return False, eager + "--disable-cuda-graph"
    if context_parallel:
        return False, eager + ("context parallel (--enable-nsa-prefill-context-parallel) cannot be captured in "
                               "CUDA graphs (collectives and host-planned views every step)")
    if not attn_backend.supports_cuda_graph:
        return False, eager + (f"--nsa-decode-backend {sa.nsa_decode_backend} cannot be captured in CUDA graphs; "
                               "use triton")
    for m in model.modules():
        if not isinstance(m, FusedMoE):
            continue
        runner = get_moe_runner(m.runner_backend)
        if not runner.supports_cuda_graph:
            return False, eager + (f"--moe-runner-backend {runner.name} cannot be captured in CUDA graphs "
                                   f"({runner.graph_blocker}); use triton")
        if not m.dispatcher.supports_cuda_graph:
            return False, eager + (f"the {type(m.dispatcher).__name__} MoE token dispatcher (--ep-size "
                                   f"{sa.ep_size}, --moe-a2a-backend {sa.moe_a2a_backend}) cannot be captured in "
                                   "CUDA graphs (host-read split sizes); use --ep-size 1")
    return True, ""


# -- graph mechanics -----------------------------------------------------------------------------------
class GraphBackend:
    """CUDA graphs: capture `fn` once, replay it on the same buffers."""

    warmup_runs = 2  # before a capture: compile kernels, settle the allocator

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
    what a graph replay does to its static output tensors. Its capture fails where a CUDA capture
    would (testing/sync_guard.capture_guard: host syncs, pinned allocations, tensors built from host
    data), so a capture that CUDA rejects is found on CPU first."""

    warmup_runs = 0  # nothing compiles or allocates differently on a second eager run

    def __init__(self) -> None:
        self.pool = None

    def capture(self, fn):
        from sglang.srt.testing.sync_guard import capture_guard

        with capture_guard():
            return None, fn()

    def replay(self, graph, fn, out: LogitsProcessorOutput) -> None:
        new = fn()
        for f in dataclasses.fields(out):
            dst = getattr(out, f.name)
            if isinstance(dst, torch.Tensor):
                dst.copy_(getattr(new, f.name))


# -- static buffers of one spec ------------------------------------------------------------------------
# ForwardBatch fields copied from the batch on every replay: input_ids, positions, out_cache_loc
# (one row per token) and these, one row per request.
_REQ_INPUTS = ("req_pool_indices", "seq_lens", "extend_prefix_lens")


class _SpecBuffers:
    """Static inputs of one spec for the largest bucket, and their padding values."""

    def __init__(self, spec: GraphSpec, max_bs: int, padding_slot: int, device) -> None:
        self.spec = spec
        n = spec.tokens_per_req
        t = max_bs * n
        i64 = dict(dtype=torch.int64, device=device)
        tok = torch.arange(t, **i64)
        self.inputs: dict[str, torch.Tensor] = {
            "input_ids": torch.zeros(t, **i64),
            "positions": tok % n,
            "out_cache_loc": torch.zeros(t, **i64),
            "req_pool_indices": torch.full((max_bs,), padding_slot, **i64),
            "seq_lens": torch.full((max_bs,), n, **i64),
            "extend_prefix_lens": torch.zeros(max_bs, **i64),
        }
        # padding values: a padding request is a fresh n-token request in the padding slot
        self.pad: dict[str, torch.Tensor] = {name: buf.clone() for name, buf in self.inputs.items()}
        self.per_req = set(_REQ_INPUTS)
        for x in spec.extra_inputs:
            rows = t if x.rows == "token" else max_bs
            self.inputs[x.name] = torch.full((rows, *x.shape), x.pad, dtype=x.dtype, device=device)
            self.pad[x.name] = self.inputs[x.name].clone()
            if x.rows == "req":
                self.per_req.add(x.name)
        # never copied: the same for every batch of this spec
        self.extend_seq_lens = torch.full((max_bs,), n, **i64)
        self.extend_start_loc = torch.arange(max_bs, **i64) * n
        self.token_to_req = tok // n

    def rows(self, name: str, bs: int) -> int:
        return bs if name in self.per_req else bs * self.spec.tokens_per_req

    def load(self, fb: ForwardBatch, bs: int, pbs: int) -> None:
        """Copy `fb`'s inputs into the first rows; padding values into the rest of the bucket."""
        for name, buf in self.inputs.items():
            r, pr = self.rows(name, bs), self.rows(name, pbs)
            buf[:r].copy_(_read_input(fb, name))
            if pr > r:
                buf[r:pr].copy_(self.pad[name][r:pr])


def _read_input(fb: ForwardBatch, name: str) -> torch.Tensor:
    """A StaticInput's tensor of `fb` ("spec.hidden_states": fb.spec.hidden_states)."""
    if name.startswith("spec."):
        return getattr(fb.spec, name.removeprefix("spec."))
    return getattr(fb, name)


class CudaGraphRunner:
    def __init__(self, model_runner, graph_backend: GraphBackend | None = None,
                 specs: tuple[GraphSpec, ...] = (DECODE_SPEC,)) -> None:
        self.model_runner = mr = model_runner
        self.graph_backend = graph_backend or GraphBackend()
        self.specs = tuple(specs)
        if len({s.name for s in self.specs}) != len(self.specs):
            raise ValueError(f"graph specs need distinct names: {[s.name for s in self.specs]}")
        self.max_bs = min(mr.server_args.cuda_graph_max_bs, mr.max_running_requests) * max(
            s.batch_scale for s in self.specs)
        self.capture_bs = get_batch_sizes_to_capture(self.max_bs)
        self.padding_slot = mr.req_to_token_pool.padding_slot
        self.buffers: dict[GraphSpec, _SpecBuffers] = {
            s: _SpecBuffers(s, self.max_bs, self.padding_slot, mr.device) for s in self.specs}
        self.graphs: dict[tuple[GraphSpec, int], object] = {}
        self.outputs: dict[tuple[GraphSpec, int], LogitsProcessorOutput] = {}
        self.static_batches: dict[tuple[GraphSpec, int], ForwardBatch] = {}
        mr.attn_backend.init_cuda_graph_state(self.max_bs)
        self.capture()

    def _static_batch(self, spec: GraphSpec, bs: int) -> ForwardBatch:
        b = self.buffers[spec]
        mr = self.model_runner
        n, t = spec.tokens_per_req, bs * spec.tokens_per_req
        fb = ForwardBatch(
            forward_mode=spec.forward_mode, batch_size=bs, input_ids=b.inputs["input_ids"][:t],
            positions=b.inputs["positions"][:t], req_pool_indices=b.inputs["req_pool_indices"][:bs],
            seq_lens=b.inputs["seq_lens"][:bs], out_cache_loc=b.inputs["out_cache_loc"][:t],
            extend_seq_lens=b.extend_seq_lens[:bs], extend_prefix_lens=b.inputs["extend_prefix_lens"][:bs],
            extend_start_loc=b.extend_start_loc[:bs], token_to_req=b.token_to_req[:t], seq_lens_cpu=[n] * bs,
            extend_seq_lens_cpu=[n] * bs, extend_prefix_lens_cpu=[0] * bs,
            capture_hidden_mode=spec.capture_hidden_mode,
            req_to_token_pool=mr.req_to_token_pool, token_to_kv_pool=mr.token_to_kv_pool,
            attn_backend=mr.attn_backend)
        spec_inputs = {}
        for x in spec.extra_inputs:
            buf = b.inputs[x.name][:b.rows(x.name, bs)]
            if x.name.startswith("spec."):
                spec_inputs[x.name.removeprefix("spec.")] = buf
            else:
                setattr(fb, x.name, buf)
        if spec_inputs:
            fb.spec = SpecInput(**spec_inputs)
        return fb

    def _run(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        return self.model_runner.model.forward(fb.input_ids, fb.positions, fb)

    @torch.inference_mode()
    def capture(self) -> None:
        for spec in self.specs:
            for bs in reversed(self.capture_bs):  # largest first: later graphs reuse its memory
                # KV-pool layer-end hooks see eager forwards only: a replayed step runs no Python,
                # so nothing a hook does at capture time may be expected to happen per replay.
                with self.model_runner.token_to_kv_pool.suspend_layer_end_hooks():
                    self.capture_one(spec, bs)
            logger.info("captured %s CUDA graphs for batch sizes %s", spec.name, self.capture_bs)

    def capture_one(self, spec: GraphSpec, bs: int) -> None:
        """Warm up and capture the graph of (spec, bs): everything one capture runs is here, so a
        context that must enclose captures (e.g. the KV pool suspending layer-end hooks) wraps
        this call."""
        fb = self._static_batch(spec, bs)
        self.model_runner.attn_backend.init_forward_metadata_capture_cuda_graph(fb)
        for _ in range(self.graph_backend.warmup_runs):
            self._run(fb)
        key = (spec, bs)
        self.graphs[key], self.outputs[key] = self.graph_backend.capture(lambda: self._run(fb))
        self.static_batches[key] = fb

    def spec_for(self, fb: ForwardBatch) -> GraphSpec | None:
        """The spec whose graphs can run `fb`, or None (it runs eagerly)."""
        if not 0 < fb.batch_size <= self.max_bs or fb.return_all_logits:
            return None
        return next((s for s in self.specs if s.matches(fb)), None)

    def can_run(self, fb: ForwardBatch) -> bool:
        return self.spec_for(fb) is not None

    @torch.inference_mode()
    def replay(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        spec = self.spec_for(fb)
        if spec is None:
            raise ValueError(f"no captured graph runs this batch ({fb.forward_mode.name}, bs {fb.batch_size}); "
                             "check can_run first")
        bs = fb.batch_size
        pbs = self.capture_bs[bisect.bisect_left(self.capture_bs, bs)]
        self.buffers[spec].load(fb, bs, pbs)
        key = (spec, pbs)
        static = self.static_batches[key]
        self.model_runner.attn_backend.init_forward_metadata_replay_cuda_graph(static)
        out = self.outputs[key]
        with self.model_runner.token_to_kv_pool.suspend_layer_end_hooks():  # the eager stand-in re-runs Python
            self.graph_backend.replay(self.graphs[key], lambda: self._run(static), out)
        result = {}
        for name in spec.outputs:
            t = getattr(out, name)
            result[name] = t[: bs * (t.shape[0] // pbs)]
        return LogitsProcessorOutput(**result)
