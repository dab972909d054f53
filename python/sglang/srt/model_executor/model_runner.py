"""ModelRunner: owns the model, its KV pool, the attention backend and the decode CUDA graphs;
runs one forward.

Memory is planned once for everything that holds KV: a runner either plans it (the target: its own
bytes per token plus `extra_kv_bytes_per_token` of runners that will share its request slots, e.g. a
draft model) and creates the `ReqToTokenPool` + allocator, or receives them (a draft runner, with
the planned `max_total_num_tokens`) and sizes only its own KV pool to match."""

from __future__ import annotations

import dataclasses
import logging

import psutil
import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.parallel_state import SINGLE_GROUP, GroupCoordinator
from sglang.srt.layers.attention.attention_registry import create_hybrid_backend
from sglang.srt.layers.batch_invariant import set_deterministic_inference
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.moe.fused_moe import set_moe_runner_backend
from sglang.srt.layers.sampler import Sampler
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, NSATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
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


class ModelRunner:
    def __init__(self, model_config: ModelConfig, server_args: ServerArgs,
                 tp_group: GroupCoordinator = SINGLE_GROUP, *, req_to_token_pool: ReqToTokenPool | None = None,
                 token_to_kv_pool_allocator=None, max_total_num_tokens: int | None = None,
                 extra_kv_bytes_per_token: int = 0, graph_specs: tuple | None = None) -> None:
        """`tp_group`: all ranks of this server. Under context parallel (CP) attention runs CP over
        them with replicated weights, so the model's TP group is a single rank. `graph_specs`: the
        forwards to capture in CUDA graphs (default: decode)."""
        sa = server_args
        self.model_config, self.server_args, self.world_group = model_config, sa, tp_group
        self.cp_group = tp_group if sa.enable_nsa_prefill_context_parallel and tp_group.world_size > 1 else None
        self.tp_group = SINGLE_GROUP if self.cp_group is not None else tp_group
        self.device = sa.device
        self.page_size = sa.page_size
        # process-wide kernel choice (layers/batch_invariant.py): set from every runner, on or off
        set_deterministic_inference(sa.enable_deterministic_inference)
        parallel = {}
        if sa.ep_size > 1:
            parallel = dict(ep_group=tp_group, moe_dispatch=("local" if self.cp_group is None else
                                                             "deepep" if sa.moe_a2a_backend == "deepep" else
                                                             "all_to_all"))
        self.model = get_model(model_config, self.device, self.tp_group, sa.load_format, sa.quantization,
                               sa.dequantize_fp8_weights, sa.fp8_activation_dtype, **parallel)
        set_moe_runner_backend(self.model, sa.moe_runner_backend)
        self.sampler = Sampler()
        self.init_memory_pool(req_to_token_pool, token_to_kv_pool_allocator, max_total_num_tokens,
                              extra_kv_bytes_per_token)
        self.attn_backend = create_hybrid_backend(sa.nsa_prefill_backend, sa.nsa_decode_backend, self)
        if self.cp_group is not None:
            from sglang.srt.layers.attention.nsa.cp_backend import CommCounter, NSAContextParallelBackend

            self.attn_backend = NSAContextParallelBackend(self.attn_backend, self.token_to_kv_pool)
            self.cp_counter = CommCounter()
        self.cuda_graph_runner = None
        if self.cp_group is not None:
            logger.info("context parallel over %d ranks (%s, page size %d)",
                        self.cp_group.world_size, sa.nsa_prefill_cp_mode, self.page_size)
        from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner, cuda_graph_decision

        use_graphs, why_not = cuda_graph_decision(sa, self.attn_backend, self.model,
                                                  context_parallel=self.cp_group is not None)
        if use_graphs:
            self.cuda_graph_runner = CudaGraphRunner(self, specs=graph_specs) if graph_specs else CudaGraphRunner(self)
        else:
            logger.info(why_not)

    # -- memory ---------------------------------------------------------------------------------
    def _make_kv_pool(self, size: int):
        return make_kv_pool(self.model_config, self.server_args, size)

    def _bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model_config, self.server_args)

    def profile_max_num_tokens(self, extra_bytes_per_token: int = 0) -> int:
        per_token = self._bytes_per_token() + extra_bytes_per_token
        if self.device == "cuda":
            free, total = torch.cuda.mem_get_info()
            budget = free - total * (1 - self.server_args.mem_fraction_static)
            if budget <= 0:
                raise RuntimeError("not enough GPU memory left for the KV cache; raise --mem-fraction-static")
            return int(budget // per_token)
        budget = min(psutil.virtual_memory().available * CPU_KV_MEMORY_FRACTION, CPU_KV_BUDGET_BYTES)
        return int(budget // per_token)

    def init_memory_pool(self, req_to_token_pool: ReqToTokenPool | None = None, token_to_kv_pool_allocator=None,
                         max_total_num_tokens: int | None = None, extra_kv_bytes_per_token: int = 0) -> None:
        sa, mc = self.server_args, self.model_config
        cp = self.cp_group.world_size if self.cp_group is not None else 1
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
        tokens = sa.max_total_tokens or self.profile_max_num_tokens(extra_kv_bytes_per_token) * cp
        tokens = tokens // (self.page_size * cp) * self.page_size * cp
        if tokens < self.page_size * cp:
            raise RuntimeError(f"KV cache too small: {tokens} tokens")
        self.max_total_num_tokens = tokens
        self.max_running_requests = sa.max_running_requests or min(256, max(1, tokens // 2))
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests + 1, mc.context_len + 1, self.device)
        self.token_to_kv_pool = self._make_kv_pool(tokens // cp)
        if cp > 1:
            from sglang.srt.mem_cache.allocator import CPPagedTokenToKVPoolAllocator

            # host slots: the CP split re-lays them out on the host before the upload
            self.token_to_kv_pool_allocator = CPPagedTokenToKVPoolAllocator(tokens, self.page_size, cp,
                                                                            sa.nsa_prefill_cp_mode, "cpu")
        else:
            self.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(tokens, self.page_size, self.device)
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
        if self.cp_group is not None:
            from sglang.srt.layers.attention.nsa.cp_backend import build_cp_forward_batch

            forward_batch = build_cp_forward_batch(forward_batch, self.req_to_token_pool.req_to_token_cpu,
                                                   self.cp_group, self.server_args.nsa_prefill_cp_mode,
                                                   self.page_size, self.cp_counter)
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)

    @torch.inference_mode()
    def sample(self, logits_output: LogitsProcessorOutput, forward_batch: ForwardBatch):
        return self.sampler(logits_output.next_token_logits, forward_batch.sampling_info,
                            forward_batch.return_logprob, forward_batch.top_logprobs_nums)
