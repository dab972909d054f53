"""ModelRunner: owns the model, its KV pool, the attention backend and the decode CUDA graphs;
runs one forward.

Memory is planned once for everything that holds KV: a runner either plans it (the target: its own
bytes per token plus `extra_kv_bytes_per_token` of runners that will share its request slots, e.g. a
draft model, whose weights and CUDA graphs -- loaded after the plan -- are `extra_weight_bytes` /
`extra_reserve_bytes`) and creates the `ReqToTokenPool` + allocator, or receives them (a draft
runner, with the planned `max_total_num_tokens`) and sizes only its own KV pool to match. On a GPU
the plan is model_executor/memory_plan.py's: weights as loaded, a reserve for the largest step's
activations and the CUDA graphs, the KV pool takes the rest."""

from __future__ import annotations

import dataclasses
import gc
import importlib
import logging
from typing import Callable

import psutil
import torch
from torch import nn

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.parallel_state import SINGLE_GROUP, GroupCoordinator
from sglang.srt.layers.attention.attention_registry import create_runner_backend
from sglang.srt.layers.batch_invariant import set_deterministic_inference
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.moe.fused_moe import set_moe_runner_backend
from sglang.srt.layers.sampler import Sampler
from sglang.srt.mem_cache.allocator import make_token_allocator
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, NSATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.memory_plan import (
    DEFAULT_MAX_RUNNING_REQUESTS,
    GraphNeeds,
    MemoryPlan,
    MemoryPlanError,
    ModelShape,
    cuda_graph_bytes,
    estimate_forward_bytes,
    max_step_tokens,
    plan_memory,
)
from sglang.srt.model_loader.loader import get_model
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# CPU has no memory profiler worth trusting for a KV budget: a fixed byte budget (capped by free
# RAM) keeps tests and tiny models from allocating gigabytes of zeros, and still converts to more
# tokens when a token needs fewer bytes (IndexCache). --max-total-tokens overrides it.
CPU_KV_BUDGET_BYTES = 256 * 2**20
CPU_KV_MEMORY_FRACTION = 0.25


def make_kv_pool(model_config: ModelConfig, server_args: ServerArgs, size: int):
    """The device KV pool a model of this config needs, holding `size` tokens."""
    mc = model_config
    common = dict(size=size, page_size=server_args.page_size, dtype=mc.dtype, kv_lora_rank=mc.kv_lora_rank,
                  qk_rope_head_dim=mc.qk_rope_head_dim, layer_num=mc.num_kv_layers, device=server_args.device,
                  kv_cache_dtype=server_args.kv_cache_dtype)
    if mc.is_dsa:
        return NSATokenToKVPool(index_head_dim=mc.index_head_dim, index_k_dtype=server_args.nsa_index_k_dtype,
                                index_layer_ids=mc.kv_index_layer_ids, **common)
    return MLATokenToKVPool(**common)


def kv_bytes_per_token(model_config: ModelConfig, server_args: ServerArgs) -> int:
    """KV bytes one token takes in that model's pool (what the memory plan divides by); no model
    needs to be loaded, so a worker can plan for a draft before building it."""
    return make_kv_pool(model_config, server_args, server_args.page_size).kv_bytes_per_token()


def _device_allocated(device: str) -> int:
    """Bytes the caching allocator holds in tensors on `device` (0 on CPU: nothing to plan there)."""
    if torch.device(device).type != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


class ModelRunner:
    def __init__(self, model_config: ModelConfig, server_args: ServerArgs,
                 tp_group: GroupCoordinator = SINGLE_GROUP, *, req_to_token_pool: ReqToTokenPool | None = None,
                 token_to_kv_pool_allocator=None, max_total_num_tokens: int | None = None,
                 extra_kv_bytes_per_token: int = 0, graph_specs: tuple | None = None,
                 extra_weight_bytes: int = 0, extra_reserve_bytes: int = 0,
                 model_hook: Callable[[nn.Module], None] | None = None) -> None:
        """`tp_group`: all ranks of this server. Under context parallel (CP) attention runs CP over
        them with replicated weights, so the model's TP group is a single rank. `graph_specs`: the
        forwards to capture in CUDA graphs (default: decode). `model_hook(model)`: runs once the
        weights are loaded, before memory is planned and graphs are captured (a draft's hot-token
        head)."""
        sa = server_args
        self.model_config, self.server_args, self.world_group = model_config, sa, tp_group
        # CP: attention over every rank of the server, weights replicated (the model's TP is one rank);
        # the capacity is logical (the server's): each rank stores 1 / cp_size of the pages.
        self.cp_size = tp_group.world_size if sa.enable_nsa_prefill_context_parallel else 1
        self.cp_group = tp_group if self.cp_size > 1 else None
        self.tp_group = SINGLE_GROUP if self.cp_size > 1 else tp_group
        self.last_forward_used_graph = False  # the decode stats log says so
        self.device = sa.device
        self.page_size = sa.page_size
        # process-wide kernel choice (layers/batch_invariant.py): set from every runner, on or off
        set_deterministic_inference(sa.enable_deterministic_inference)
        self.graph_specs = graph_specs
        self.memory_plan: MemoryPlan | None = None
        loaded_before = _device_allocated(self.device)
        parallel = {}
        if sa.ep_size > 1:  # tokens move to their experts only where ranks hold different tokens (CP)
            parallel = dict(ep_group=tp_group, moe_dispatch=("local" if self.cp_size == 1 else
                                                             "deepep" if sa.moe_a2a_backend == "deepep" else
                                                             "all_to_all"))
        self.model = get_model(model_config, self.device, self.tp_group, sa.load_format, sa.quantization,
                               sa.dequantize_fp8_weights, sa.fp8_activation_dtype, **parallel)
        set_moe_runner_backend(self.model, sa.moe_runner_backend)
        if model_hook is not None:
            model_hook(self.model)
        self.weight_bytes = _device_allocated(self.device) - loaded_before  # as loaded: any dtype
        self.sampler = Sampler()
        self.init_memory_pool(req_to_token_pool, token_to_kv_pool_allocator, max_total_num_tokens,
                              extra_kv_bytes_per_token, extra_weight_bytes, extra_reserve_bytes)
        self.attn_backend = create_runner_backend(self)  # under CP: re-lays each batch out (prepare_batch)
        self.cuda_graph_runner = None
        from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner, cuda_graph_decision

        use_graphs, why_not = cuda_graph_decision(sa, self.attn_backend, self.model, context_parallel=self.cp_size > 1)
        if use_graphs:
            self.cuda_graph_runner = CudaGraphRunner(self, specs=graph_specs) if graph_specs else CudaGraphRunner(self)
        else:
            logger.info(why_not)

    # -- memory ---------------------------------------------------------------------------------
    def _make_kv_pool(self, size: int):
        return make_kv_pool(self.model_config, self.server_args, size)

    def _bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model_config, self.server_args)

    def profile_max_num_tokens(self, extra_bytes_per_token: int = 0, extra_weight_bytes: int = 0,
                               extra_reserve_bytes: int = 0) -> int:
        """KV tokens of this rank's pool. GPU: the memory plan (self.memory_plan); CPU: a fixed
        byte budget (CPU_KV_BUDGET_BYTES, capped by free RAM)."""
        per_token = self._bytes_per_token() + extra_bytes_per_token
        if self.device == "cuda":
            self.memory_plan = self.plan_device_memory(per_token, extra_weight_bytes, extra_reserve_bytes)
            logger.info(self.memory_plan.describe())
            return self.memory_plan.kv_tokens
        budget = min(psutil.virtual_memory().available * CPU_KV_MEMORY_FRACTION, CPU_KV_BUDGET_BYTES)
        return int(budget // per_token)

    def _plan_on_every_rank(self, make: Callable[[], MemoryPlan]) -> MemoryPlan:
        """`make()`, failing on every rank when it fails on one: the profile forward that follows
        runs collectives, where the other ranks would wait for the failed one until --dist-timeout."""
        try:
            made, error = make(), None
        except MemoryPlanError as e:
            made, error = None, e
        if not self.world_group.is_single:
            ok = self.world_group.all_reduce_host(torch.tensor([0 if error else 1], dtype=torch.int64), "min")
            if error is None and not int(ok.item()):
                error = MemoryPlanError("the memory plan of another rank does not fit (its log names the flags to "
                                        "change): lower --chunked-prefill-size / --max-prefill-tokens or "
                                        "--cuda-graph-max-bs, or free that GPU")
        if error is not None:
            raise error
        return made

    def _agree_on_capacity(self, tokens: int) -> int:
        """The least KV capacity of all ranks: each rank schedules the same batches on its own
        allocator, so they must all hold the same tokens (free memory differs a little per rank)."""
        if self.world_group.is_single:
            return tokens
        least = int(self.world_group.all_reduce_host(torch.tensor([tokens], dtype=torch.int64), "min").item())
        if self.memory_plan is not None and least != tokens:
            # the plan counts one rank's tokens
            self.memory_plan = dataclasses.replace(self.memory_plan, kv_tokens=least // self.cp_size)
            logger.info("KV capacity %d tokens: the least of the %d ranks (this one could hold %d)", least,
                        self.world_group.world_size, tokens)
        return least

    # -- the GPU memory plan (memory_plan.py) ------------------------------------------------------
    def _model_shape(self) -> ModelShape:
        sa = self.server_args
        return ModelShape.from_model_config(self.model_config, sa.tp_size, sa.ep_size,
                                            attn_tp_size=self.tp_group.world_size)

    def _planned_graph_bytes(self, shape: ModelShape, max_running: int) -> int:
        """The CUDA graphs' pool, when graphs will be captured (cuda_graph_decision's conditions
        that are known before the attention backend exists)."""
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang.srt.layers.moe.moe_registry import get_moe_runner
        from sglang.srt.model_executor.cuda_graph_runner import DECODE_SPEC

        sa = self.server_args
        module, cls = ATTENTION_BACKENDS[sa.nsa_decode_backend].split(":")
        if (sa.disable_cuda_graph or self.cp_size > 1
                or not getattr(importlib.import_module(module), cls).supports_cuda_graph
                or not get_moe_runner(sa.moe_runner_backend).supports_cuda_graph):
            return 0
        specs = self.graph_specs or (DECODE_SPEC,)
        needs = tuple(GraphNeeds(s.tokens_per_req, s.batch_scale, "hidden_states" in s.extra_outputs,
                                 "topk_indices" in s.extra_outputs) for s in specs)
        return cuda_graph_bytes(shape, self.model_config.context_len, min(sa.cuda_graph_max_bs, max_running), needs)

    def plan_device_memory(self, kv_bytes_per_token: int, extra_weight_bytes: int = 0,
                           extra_reserve_bytes: int = 0) -> MemoryPlan:
        """The plan from the device's own numbers: free memory after the weights (the allocator's
        cache emptied first: loading leaves temporaries reserved), the activations of the largest
        step (max of the arithmetic and, outside CP, a profile forward), the graphs."""
        from sglang.srt.layers.attention.nsa.triton_backend import CUDA_SCORE_BUDGET_MAX

        sa, mc = self.server_args, self.model_config
        cp = self.cp_size
        ctx = mc.context_len
        max_running = sa.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
        step = max_step_tokens(sa, ctx)
        shape = self._model_shape()
        est = estimate_forward_bytes(shape, step, ctx, min(max_running, step), score_budget=CUDA_SCORE_BUDGET_MAX)
        graphs = self._planned_graph_bytes(shape, max_running) + extra_reserve_bytes
        req_to_token = (max_running + 2) * (ctx + 1) * 4

        def plan(activations: int) -> MemoryPlan:
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            return plan_memory(total_bytes=total, free_bytes=free - extra_weight_bytes,
                               weight_bytes=self.weight_bytes + extra_weight_bytes,
                               kv_bytes_per_token=kv_bytes_per_token, activation_bytes=activations,
                               graph_bytes=graphs, req_to_token_bytes=req_to_token, step_tokens=step,
                               page_size=self.page_size, mem_fraction_static=sa.mem_fraction_static,
                               max_total_tokens=sa.max_total_tokens // cp if sa.max_total_tokens else None)

        first = self._plan_on_every_rank(lambda: plan(est.peak))  # fails before a profile that could not fit
        logger.info("activations of a %d-token step (KV width %d), from the config: %.2f GiB (peak in %s)",
                    step, ctx, est.peak / 2**30, est.peak_phase)
        if cp > 1:  # the profile forward runs an unsplit batch: under CP the arithmetic alone
            return first
        from sglang.srt.model_executor.memory_profile import profile_step_peak

        try:
            measured = profile_step_peak(self, step, ctx)
        except torch.OutOfMemoryError:
            raise MemoryPlanError(f"the profile forward of the largest step ({step} tokens) ran out of GPU memory "
                                  f"beside {self.weight_bytes / 2**30:.2f} GiB of weights: lower "
                                  "--chunked-prefill-size / --max-prefill-tokens (or turn chunked prefill on), or "
                                  "load fewer weights") from None
        logger.info("activations of a %d-token step, measured by a profile forward: %.2f GiB", step,
                    measured / 2**30)
        self.profiled_activation_bytes = measured
        return self._plan_on_every_rank(lambda: plan(max(est.peak, measured)))  # on every rank: a collective

    def init_memory_pool(self, req_to_token_pool: ReqToTokenPool | None = None, token_to_kv_pool_allocator=None,
                         max_total_num_tokens: int | None = None, extra_kv_bytes_per_token: int = 0,
                         extra_weight_bytes: int = 0, extra_reserve_bytes: int = 0) -> None:
        sa, mc = self.server_args, self.model_config
        cp = self.cp_size
        if req_to_token_pool is not None:  # a runner sharing another runner's slots (a draft)
            if token_to_kv_pool_allocator is None or max_total_num_tokens is None:
                raise ValueError("a shared ReqToTokenPool needs its allocator and max_total_num_tokens")
            self.max_total_num_tokens = max_total_num_tokens
            self.max_running_requests = req_to_token_pool.size - 1
            self.req_to_token_pool = req_to_token_pool
            self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
            self.token_to_kv_pool = self._make_kv_pool(max_total_num_tokens // cp)
            return
        # Under CP the capacity is logical (the server's): each rank stores 1/cp of the pages.
        if self.device == "cuda":  # the plan checks an explicit --max-total-tokens too
            tokens = self.profile_max_num_tokens(extra_kv_bytes_per_token, extra_weight_bytes,
                                                 extra_reserve_bytes) * cp
        else:
            tokens = sa.max_total_tokens or self.profile_max_num_tokens(extra_kv_bytes_per_token) * cp
        tokens = self._agree_on_capacity(tokens // (self.page_size * cp) * self.page_size * cp)
        if tokens < self.page_size * cp:
            raise RuntimeError(f"KV cache too small: {tokens} tokens")
        self.max_total_num_tokens = tokens
        self.max_running_requests = sa.max_running_requests or min(256, max(1, tokens // 2))
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests + 1, mc.context_len + 1, self.device)
        self.token_to_kv_pool = self._make_kv_pool(tokens // cp)
        self.token_to_kv_pool_allocator = make_token_allocator(tokens, self.page_size, cp, sa.nsa_prefill_cp_mode,
                                                               self.device)
        kv_gib = self.token_to_kv_pool.get_kv_size_bytes() / 2**30
        logger.info("KV cache: %d tokens (page size %d, %.3f GiB, %d B/token, kv cache dtype %s), "
                    "max running requests %d", tokens, self.page_size, kv_gib,
                    self.token_to_kv_pool.kv_bytes_per_token(), sa.kv_cache_dtype, self.max_running_requests)
        if sa.kv_cache_dtype != "auto" and not sa.max_total_tokens:
            auto = kv_bytes_per_token(mc, dataclasses.replace(sa, kv_cache_dtype="auto"))
            logger.info("FP8 KV cache (%s): %d vs %d B/token in %s: %.2fx the tokens in the same memory",
                        sa.kv_cache_dtype, self.token_to_kv_pool.kv_bytes_per_token(), auto, mc.dtype,
                        auto / self.token_to_kv_pool.kv_bytes_per_token())
        sched = mc.index_layer_schedule
        if sched is not None and sched.shares and not mc.is_draft_model:
            pool = self.token_to_kv_pool
            saved = (sched.num_layers - len(sched.full_layer_ids)) * pool.index_bytes_per_token
            logger.info("IndexCache %s (%d of %d layers run the indexer): index K kept for full layers only, "
                        "%d B/token saved (%.1f%% of the KV bytes per token it would take)", sched.describe(),
                        len(sched.full_layer_ids), sched.num_layers, saved,
                        100.0 * saved / (pool.kv_bytes_per_token() + saved))

    # -- forward ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        # Host-side bound (the rope table and req_to_token are sized by the context length), so
        # no layer has to read positions back to check them.
        if forward_batch.max_seq_len > self.model_config.context_len:
            raise ValueError(f"sequence length {forward_batch.max_seq_len} exceeds the context length "
                             f"{self.model_config.context_len}")
        self.req_to_token_pool.flush_writes()
        forward_batch.req_to_token_pool = self.req_to_token_pool
        forward_batch.token_to_kv_pool = self.token_to_kv_pool
        forward_batch.attn_backend = self.attn_backend
        self.last_forward_used_graph = (self.cuda_graph_runner is not None
                                        and self.cuda_graph_runner.can_run(forward_batch))
        if self.last_forward_used_graph:
            return self.cuda_graph_runner.replay(forward_batch)
        forward_batch = self.attn_backend.prepare_batch(forward_batch)  # CP: this rank's share
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)

    @torch.inference_mode()
    def sample(self, logits_output: LogitsProcessorOutput, forward_batch: ForwardBatch):
        return self.sampler(logits_output.next_token_logits, forward_batch.sampling_info,
                            forward_batch.return_logprob, forward_batch.top_logprobs_nums)
