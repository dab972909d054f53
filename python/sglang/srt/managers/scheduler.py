"""Scheduler: continuous batching over the model runner, with a prefix cache.

`step()` = `get_next_batch_to_run()` (a prefill batch of newly admitted requests -- optionally
with the running decode requests mixed in -- or one decode step of the running requests) ->
`run_batch()` (one forward + sampling, then the step's single device->host copy) ->
`process_batch_result()` (scheduler_output_processor.py; results may hold several tokens per
request). Requests that cannot get KV wait; a decode step that runs out of KV retracts requests
back to the queue. The scheduler reads only host state (the req_to_token host mirror, CPU lists).
The same class runs in-process (the offline Engine) and inside the scheduler process.
"""

from __future__ import annotations

import logging

import torch

from sglang.srt.configs.model_config import ModelConfig, model_config_from_server_args
from sglang.srt.distributed.parallel_state import SINGLE_GROUP, GroupCoordinator
from sglang.srt.managers.io_struct import (
    FlushCacheReqOutput,
    ReqOutput,
    SchedulerStats,
    TokenizedGenerateReqInput,
)
from sglang.srt.constrained.grammar_registry import create_grammar_backend
from sglang.srt.constrained.grammar_manager import GrammarManager
from sglang.srt.managers.request_limits import request_length_error
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import PrefillAdder, order_waiting_queue
from sglang.srt.managers.scheduler_metrics_mixin import SchedulerMetricsMixin
from sglang.srt.managers.scheduler_output_processor import GenerationBatchResult, SchedulerOutputProcessorMixin
from sglang.srt.mem_cache.base_prefix_cache import ChunkCache
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.custom_logit_processor import CUSTOM_LOGIT_PROCESSOR_DISABLED
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class Scheduler(SchedulerOutputProcessorMixin, SchedulerMetricsMixin):
    def __init__(self, server_args: ServerArgs, model_config: ModelConfig | None = None, tokenizer=None,
                 tp_group: GroupCoordinator = SINGLE_GROUP) -> None:
        self.server_args = server_args
        self.model_config = model_config or model_config_from_server_args(server_args)
        torch.manual_seed(server_args.random_seed)
        self.tokenizer = tokenizer
        self.model_runner = ModelRunner(self.model_config, server_args, tp_group)
        mr = self.model_runner
        self.device = server_args.device
        self.page_size = server_args.page_size
        self.req_to_token_pool = mr.req_to_token_pool
        self.allocator = mr.token_to_kv_pool_allocator
        self.max_total_num_tokens = mr.max_total_num_tokens
        self.max_running_requests = mr.max_running_requests
        self.context_len = self.model_config.context_len
        cache_cls = ChunkCache if server_args.disable_radix_cache else RadixCache
        self.tree_cache = cache_cls(self.req_to_token_pool, self.allocator, self.page_size)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.vocab_size = self.model_config.vocab_size
        # Structured outputs: no backend with --grammar-backend none, or without a tokenizer (tests).
        backend = None
        if tokenizer is not None:
            backend = create_grammar_backend(server_args, tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        self.grammar_manager = GrammarManager(backend, mr.world_group)
        self.waiting_queue: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.forward_ct = 0
        self.init_metrics()

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, recv: TokenizedGenerateReqInput) -> list[ReqOutput]:
        sp = recv.sampling_params
        if sp.max_new_tokens is None:  # upstream: bounded only by the context length
            sp.max_new_tokens = max(self.context_len - len(recv.input_ids), 0)
        req = Req(recv.rid, recv.input_ids, sp, recv.return_logprob, recv.logprob_start_len,
                  recv.top_logprobs_num, recv.stream, recv.return_hidden_states, recv.custom_logit_processor)
        req.eos_token_ids = frozenset(self.eos_token_ids)
        error = request_length_error(len(req.origin_input_ids), sp.max_new_tokens, self.context_len,
                                     self.max_total_num_tokens, self.page_size)
        if error is not None:
            req.finished_reason = FINISH_ABORT(error.message, 400)
            return [self._make_output(req, [])]
        if req.custom_logit_processor and not self.server_args.enable_custom_logit_processor:
            req.finished_reason = FINISH_ABORT(CUSTOM_LOGIT_PROCESSOR_DISABLED, 400)
            return [self._make_output(req, [])]
        if self.grammar_manager.process_req_with_grammar(req):
            return []  # compiling: it waits in the grammar queue
        if req.finished():
            return [self._make_output(req, [])]
        self.waiting_queue.append(req)
        return []

    def move_ready_grammar_requests(self) -> list[ReqOutput]:
        outs = []
        for req in self.grammar_manager.get_ready_grammar_requests():
            if req.finished():
                outs.append(self._make_output(req, []))
            else:
                self.waiting_queue.append(req)
        return outs

    def abort_request(self, rid: str) -> list[ReqOutput]:
        req = self.grammar_manager.abort_request(rid)
        if req is not None:
            req.finished_reason = FINISH_ABORT("aborted by client")
            return [self._make_output(req, [])]
        for i, req in enumerate(self.waiting_queue):
            if req.rid == rid:
                del self.waiting_queue[i]
                req.finished_reason = FINISH_ABORT("aborted by client")
                self._release_if_held(req)
                return [self._make_output(req, [])]
        for req in self.running + ([self.chunked_req] if self.chunked_req else []):
            if req.rid == rid:
                req.to_abort = "aborted by client"
        return []

    def _release_if_held(self, req: Req) -> None:
        if req.req_pool_idx is not None:
            self.tree_cache.cache_finished_req(req)

    def has_work(self) -> bool:
        return bool(self.waiting_queue or self.running or self.chunked_req or self.grammar_manager.grammar_queue)

    # -- one step -------------------------------------------------------------------------------------
    def step(self) -> list[ReqOutput]:
        outputs = self._drain_aborts()
        outputs += self.move_ready_grammar_requests()
        batch = self.get_next_batch_to_run()
        if batch is None:
            if not (self.waiting_queue or self.running or self.chunked_req):
                self.grammar_manager.wait()
            return outputs
        result = self.run_batch(batch)
        self.observe_batch(batch)  # stats logs / metrics: host counters only
        outputs += self.process_batch_result(batch, result)
        return outputs

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        batch = self._get_new_batch_prefill()
        if batch is None and self.running:
            batch = self._prepare_decode()
        return batch

    def _drain_aborts(self) -> list[ReqOutput]:
        outs = []
        for req in [r for r in self.running if r.to_abort]:
            self.running.remove(req)
            req.finished_reason = FINISH_ABORT(req.to_abort)
            self.tree_cache.cache_finished_req(req)
            outs.append(self._make_output(req, []))
        if self.chunked_req is not None and self.chunked_req.to_abort:
            req, self.chunked_req = self.chunked_req, None
            req.finished_reason = FINISH_ABORT(req.to_abort)
            self.tree_cache.cache_finished_req(req)
            outs.append(self._make_output(req, []))
        return outs

    # -- prefill admission ----------------------------------------------------------------------------
    def _reserved_for_running(self) -> int:
        return sum(int(max(r.sampling_params.max_new_tokens - len(r.output_ids), 0) * self.new_token_ratio)
                   for r in self.running)

    def _get_new_batch_prefill(self) -> ScheduleBatch | None:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        running_slots = self.max_running_requests - len(self.running)
        if running_slots <= 0 and self.chunked_req is None:
            return None
        reserved = self._reserved_for_running()
        sa = self.server_args
        adder = PrefillAdder(
            lambda: self.allocator.available_size() + self.tree_cache.evictable_size() - reserved,
            sa.max_prefill_tokens,
            sa.chunked_prefill_size if sa.chunked_prefill_size > 0 else None,
            self.page_size,
            max(running_slots, 1),
        )
        if self.chunked_req is not None:
            req = self.chunked_req
            remaining = len(req.fill_ids()) - req.kv_committed_len
            if not adder.add(req, remaining, 0):
                return None  # not even the chunk fits: let decode free memory first
            self.chunked_req = None
        self.waiting_queue = order_waiting_queue(self.waiting_queue, sa.schedule_policy, self.tree_cache)
        admitted: list[Req] = []
        for req in self.waiting_queue:
            if adder.budget_full() or len(admitted) >= self.req_to_token_pool.available_size():
                break
            fill = req.fill_ids()
            match = self.tree_cache.match_prefix(fill[: req.max_prefix_len()])
            self.tree_cache.inc_lock_ref(match.last_node)
            reserve = int(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0) * self.new_token_ratio)
            if not adder.add(req, len(fill) - len(match.device_indices), reserve):
                self.tree_cache.dec_lock_ref(match.last_node)
                break
            req.prefix_indices, req.last_node = match.device_indices, match.last_node
            req.kv_committed_len = len(match.device_indices)
            if not req.admitted:
                req.admitted = True
                req.cached_tokens = len(match.device_indices)
                self.num_prompt_tokens += len(req.origin_input_ids)
                self.num_cached_tokens += req.cached_tokens
            admitted.append(req)
        admitted_ids = {id(r) for r in admitted}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted_ids]
        if not adder.can_run:
            return None
        reqs = adder.can_run
        mode = ForwardMode.EXTEND
        if sa.enable_mixed_chunk and self.running:
            mode = ForwardMode.MIXED
        return self._prepare_extend(reqs, mode)

    def _prepare_extend(self, reqs: list[Req], mode: ForwardMode) -> ScheduleBatch | None:
        r2t = self.req_to_token_pool
        for req in reqs:
            if req.req_pool_idx is None:
                req.req_pool_idx = r2t.alloc(1)[0]
                if len(req.prefix_indices):
                    r2t.write(req.req_pool_idx, 0, req.prefix_indices)
        decode_reqs = [r for r in self.running if r.output_ids] if mode == ForwardMode.MIXED else []
        batch = ScheduleBatch(reqs + decode_reqs, mode)
        batch.prefix_lens = [r.kv_committed_len for r in reqs] + [r.kv_committed_len for r in decode_reqs]
        batch.extend_lens = [r.extend_input_len for r in reqs] + [1] * len(decode_reqs)
        if not self._alloc_batch_kv(batch):
            for req in reqs:  # cannot happen when admission is right; undo and retry later
                self._release_if_held(req)
                req.reset_for_retract()
                self.waiting_queue.insert(0, req)
            return None
        return batch

    # -- decode -----------------------------------------------------------------------------------------
    def _prepare_decode(self) -> ScheduleBatch | None:
        self._ensure_decode_memory()
        if not self.running:
            return None
        batch = ScheduleBatch(list(self.running), ForwardMode.DECODE)
        batch.prefix_lens = [r.kv_committed_len for r in batch.reqs]
        batch.extend_lens = [1] * len(batch.reqs)
        if not self._alloc_batch_kv(batch):
            raise RuntimeError("decode KV allocation failed after retraction")
        self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
        return batch

    def _decode_pages_needed(self) -> int:
        return sum(1 for r in self.running if r.kv_committed_len % self.page_size == 0) * self.page_size

    def _ensure_decode_memory(self) -> None:
        need = self._decode_pages_needed()
        if self.allocator.available_size() < need:
            self.tree_cache.evict(need - self.allocator.available_size())
        retracted = 0
        while self.running and self.allocator.available_size() < self._decode_pages_needed():
            victims = sorted(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
            victim = victims[0]
            self.running.remove(victim)
            self.tree_cache.cache_finished_req(victim)
            victim.reset_for_retract()
            self.waiting_queue.insert(0, victim)
            retracted += 1
            need = self._decode_pages_needed()
            if self.allocator.available_size() < need:
                self.tree_cache.evict(need - self.allocator.available_size())
        if retracted:
            self.new_token_ratio = INIT_NEW_TOKEN_RATIO
            logger.warning("KV cache full: retracted %d request(s) back to the queue", retracted)

    def _alloc_batch_kv(self, batch: ScheduleBatch) -> bool:
        """KV slots for the batch's new tokens, written to req_to_token in one scatter. Host-only
        (this runs every step): no per-request tensors in the decode case."""
        r2t = self.req_to_token_pool
        seq_lens = [p + e for p, e in zip(batch.prefix_lens, batch.extend_lens)]
        rows = [r.req_pool_idx for r in batch.reqs]
        last_locs = r2t.last_locs(rows, batch.prefix_lens)
        decode = batch.forward_mode.is_decode()

        def alloc():
            if decode:
                return self.allocator.alloc_decode(seq_lens, last_locs)
            return self.allocator.alloc_extend(batch.prefix_lens, seq_lens, last_locs)

        out = alloc()
        if out is None:
            self.tree_cache.evict(sum(batch.extend_lens) + self.page_size * len(batch.reqs))
            out = alloc()
            if out is None:
                return False
        ext = torch.tensor(batch.extend_lens)
        cols = torch.arange(len(out)) + (torch.tensor(batch.prefix_lens) - (torch.cumsum(ext, 0) - ext)).repeat_interleave(ext)
        r2t.write_tokens(torch.tensor(rows).repeat_interleave(ext), cols, out)
        if decode:  # the token at position p is the last generated one
            batch.input_ids = [r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1] for r in batch.reqs]
        else:
            batch.input_ids = [t for req, p, e in zip(batch.reqs, batch.prefix_lens, batch.extend_lens)
                               for t in req.fill_slice(p, p + e)]
        batch.out_cache_loc = out
        return True

    # -- run + results ----------------------------------------------------------------------------------
    def _sampling_info(self, reqs: list[Req]) -> SamplingBatchInfo:
        grammars = procs = params = None
        if any(r.grammar is not None for r in reqs):
            grammars = [r.grammar for r in reqs]
        if any(r.custom_logit_processor for r in reqs):
            procs = [r.custom_logit_processor for r in reqs]
            # Upstream passes the request itself as "__req__" (output_ids so far, prompt, ...).
            params = [{**(r.sampling_params.custom_params or {}), "__req__": r} if r.custom_logit_processor
                      else None for r in reqs]
        return SamplingBatchInfo.from_params(
            [r.sampling_params for r in reqs], self.vocab_size, self.device,
            output_ids=[r.output_ids for r in reqs], seeds_step=[len(r.output_ids) for r in reqs],
            eos_token_ids=self.eos_token_ids, grammars=grammars, custom_logit_processors=procs,
            custom_params=params)

    def run_batch(self, batch: ScheduleBatch) -> GenerationBatchResult:
        fb = batch.build_forward_batch(batch.input_ids, batch.out_cache_loc, self.device,
                                       self._sampling_info(batch.reqs))
        logits_output = self.model_runner.forward(fb)
        sample = self.model_runner.sample(logits_output, fb)
        self.forward_ct += 1
        return GenerationBatchResult.from_device(batch, fb, logits_output, sample)

    # -- maintenance ------------------------------------------------------------------------------------
    def flush_cache(self) -> FlushCacheReqOutput:
        if self.has_work():
            return FlushCacheReqOutput(False, "cannot flush the cache while requests are running or waiting")
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()
        return FlushCacheReqOutput(True, "cache flushed")

    def kv_leak_report(self) -> str | None:
        """When idle, every KV page is either free or owned by the prefix cache."""
        if self.has_work():
            return None
        free = self.allocator.available_size()
        cached = self.tree_cache.total_size()
        if free + cached != self.max_total_num_tokens:
            return f"KV leak: free {free} + cached {cached} != total {self.max_total_num_tokens}"
        if self.req_to_token_pool.available_size() != self.req_to_token_pool.size:
            return "request slot leak"
        return None

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running) + (1 if self.chunked_req else 0),
            num_waiting_reqs=len(self.waiting_queue) + len(self.grammar_manager),
            kv_total_tokens=self.max_total_num_tokens,
            kv_free_tokens=self.allocator.available_size(),
            kv_cached_tokens=self.tree_cache.total_size(),
            kv_protected_tokens=self.tree_cache.protected_size(),
            cache_hit_rate=self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            kv_leak=self.kv_leak_report(),
            num_used_tokens=self.get_token_info()[0],
            gen_throughput=self.last_gen_throughput,
        )
