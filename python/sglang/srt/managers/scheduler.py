"""Scheduler: continuous batching over a model worker, with a prefix cache.

`step()` = `get_next_batch_to_run()` (a prefill batch of newly admitted requests -- optionally
with the running decode requests mixed in -- or one decode step of the running requests) ->
`run_batch()` (the worker launches forward + sampling and queues the step's device->host copy) ->
`process_batch_result()` (scheduler_output_processor.py; results may hold 0..N tokens per request
and say which KV rows to commit). With overlap (the default) step n+1 is prepared and launched
before step n's results are processed; decode input ids come from the worker's device token table,
so nothing waits for step n's tokens to reach the host. Steps whose sampling needs the previous
step's host state (grammars, penalties, custom processors) wait for it first.

Requests that cannot get KV wait; a decode step that runs out of KV retracts requests back to the
queue. The scheduler reads only host state (the req_to_token host mirror, CPU lists). The same
class runs in-process (the offline Engine) and inside the scheduler process.

Lifecycle hooks, each called from one place: `tree_cache.check_events()` once per iteration,
`tree_cache.prepare_batch(batch)` before a launch, `tree_cache.on_batch_done(batch)` after its
results are applied, `on_prefill_finished(req)` when a request's prompt is complete (the default
policy starts decoding it); KV allocation (`alloc_kv`) is separate from building a batch.
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
from sglang.srt.managers.admission_watchdog import AdmissionWatchdog
from sglang.srt.managers.cache_factory import create_tree_cache
from sglang.srt.managers.request_limits import max_new_tokens_limit, request_length_error
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import PrefillAdder, order_waiting_queue
from sglang.srt.managers.scheduler_metrics_mixin import SchedulerMetricsMixin
from sglang.srt.managers.scheduler_output_processor import GenerationBatchResult, SchedulerOutputProcessorMixin
from sglang.srt.managers.overlap_utils import FUTURE_TOKEN, Pending
from sglang.srt.managers.tp_worker import BaseTpWorker, TpModelWorker
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.utils.common import cdiv
from sglang.srt.sampling.custom_logit_processor import CUSTOM_LOGIT_PROCESSOR_DISABLED
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# A step that made no progress while requests wait (none fits): the loop waits this long on its
# sockets (a message ends the wait) instead of stepping again at once. Short: nothing else wakes it.
STALL_POLL_MS = 2
IDLE_POLL_MS = 1000  # idle: only a message wakes it
EVENT_POLL_MS = 2  # idle, but HiCache copies are still to be acknowledged (poll_idle)
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


def create_worker(server_args: ServerArgs, model_config: ModelConfig,
                  tp_group: GroupCoordinator = SINGLE_GROUP) -> BaseTpWorker:
    """The worker the server's flags ask for: plain, or speculative (EAGLE / NEXTN). Here, beside the
    scheduler that builds it: tp_worker.py (the contract) then imports no worker of its own."""
    if server_args.speculative_algorithm is not None:
        from sglang.srt.speculative.eagle_worker import EAGLEWorker

        return EAGLEWorker(server_args, model_config, tp_group)
    return TpModelWorker(server_args, model_config, tp_group)


class Scheduler(SchedulerOutputProcessorMixin, SchedulerMetricsMixin):
    def __init__(self, server_args: ServerArgs, model_config: ModelConfig | None = None, tokenizer=None,
                 tp_group: GroupCoordinator = SINGLE_GROUP) -> None:
        self.server_args = server_args
        self.model_config = model_config or model_config_from_server_args(server_args)
        torch.manual_seed(server_args.random_seed)
        self.tokenizer = tokenizer
        self.tp_worker: BaseTpWorker = create_worker(server_args, self.model_config, tp_group)
        worker = self.tp_worker
        self.device = server_args.device
        self.page_size = server_args.page_size
        self.req_to_token_pool = worker.req_to_token_pool
        self.allocator = worker.token_to_kv_pool_allocator
        self.max_total_num_tokens = worker.max_total_num_tokens
        self.max_running_requests = worker.max_running_requests
        self.enable_overlap = not server_args.disable_overlap_schedule
        # The launched step whose results are not processed yet (overlap), as (batch, pending).
        self.in_flight: tuple[ScheduleBatch, Pending] | None = None
        self.context_len = self.model_config.context_len
        self.tree_cache = create_tree_cache(server_args, worker, self.page_size)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.vocab_size = self.model_config.vocab_size
        # Structured outputs: no backend with --grammar-backend none, or without a tokenizer (tests).
        backend = None
        if tokenizer is not None:
            backend = create_grammar_backend(server_args, tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        self.grammar_manager = GrammarManager(backend, worker.world_group)
        self.waiting_queue: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.num_retracted_reqs = 0  # since start: decode steps that ran out of KV
        self.forward_ct = 0
        self.admission_watchdog = AdmissionWatchdog()
        self.last_step_progressed = False  # else the event loop waits briefly on its sockets: no spinning
        self.init_metrics()

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, recv: TokenizedGenerateReqInput) -> list[ReqOutput]:
        sp = recv.sampling_params
        if sp.max_new_tokens is None:  # upstream: bounded only by the context length
            sp.max_new_tokens = max(self.context_len - len(recv.input_ids), 0)
        req = Req(recv.rid, recv.input_ids, sp, recv.return_logprob, recv.logprob_start_len,
                  recv.top_logprobs_num, recv.stream, recv.return_hidden_states, recv.custom_logit_processor)
        req.eos_token_ids = frozenset(self.eos_token_ids)
        n_input, per_step = len(req.origin_input_ids), self.tp_worker.num_tokens_per_req
        error = request_length_error(n_input, sp.max_new_tokens, self.context_len, self.max_total_num_tokens,
                                     self.page_size, tokens_per_step=per_step)
        if error is not None:
            req.finished_reason = FINISH_ABORT(error.message, 400)
            return [self._make_output(req, [])]
        sp.max_new_tokens = min(sp.max_new_tokens,
                                max_new_tokens_limit(n_input, self.max_total_num_tokens, self.page_size, per_step))
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
        # Running, between chunks, or in the step in flight (its prefill rows are in no queue).
        in_flight = self.in_flight[0].reqs if self.in_flight is not None else []
        for req in self.running + ([self.chunked_req] if self.chunked_req else []) + in_flight:
            if req.rid == rid:
                req.to_abort = "aborted by client"
        return []

    def _release_if_held(self, req: Req) -> None:
        if req.req_pool_idx is not None:
            self.release_req(req)

    def release_req(self, req: Req) -> None:
        """Hand a request's KV to the prefix cache and free what it does not keep: the one place a
        request's slots are released (finish, abort, retraction, prefill-only). Callers make sure
        no step that writes them is in flight, or that its result will be dropped (retraction)."""
        self.free_uncommitted_kv(req)
        self.tree_cache.cache_finished_req(req)

    def free_uncommitted_kv(self, req: Req, keep: int | None = None) -> None:
        """Free the pages wholly past `keep` (default kv_committed_len): rows of a step that were not
        accepted, or of a step whose request finished; the tail page keeps its free slots. A
        speculative step in flight under overlap keeps its window (`keep` past the committed KV)."""
        keep = req.kv_committed_len if keep is None else min(keep, req.kv_allocated_len)
        start = cdiv(keep, self.page_size) * self.page_size
        if req.kv_allocated_len > start:
            self.allocator.free(self.req_to_token_pool.read(req.req_pool_idx, req.kv_allocated_len)[start:])
        req.kv_allocated_len = keep

    def has_work(self) -> bool:
        return bool(self.waiting_queue or self.running or self.chunked_req or self.grammar_manager.grammar_queue
                    or self.in_flight is not None)

    def wake_sources(self) -> list:
        """ZMQ sockets / file descriptors (rank 0's) whose input can unblock an idle or stalled
        scheduler, besides the tokenizer's socket: the event loop sleeps on all of them together."""
        return []

    def stall_timeout_ms(self) -> int:
        """How long the loop may wait after a step that made no progress while work remains
        (`last_step_progressed`): a scheduler whose wake sources cover what it waits for sleeps longer."""
        return STALL_POLL_MS

    def poll_timeout_ms(self, busy: bool) -> int:
        """How long the event loop may sleep on its sockets: stalled (busy) its stall timeout, idle
        long, and briefly while HiCache copies are still to be acknowledged (`poll_idle`)."""
        timeout = self.stall_timeout_ms() if busy else IDLE_POLL_MS
        return min(timeout, EVENT_POLL_MS) if self.tree_cache.has_pending_events() else timeout

    def poll_idle(self) -> None:
        """An iteration with nothing to step: a HiCache backup that ended after the last step commits
        now, not at the next request."""
        if self.tree_cache.has_pending_events():
            self.tree_cache.check_events()

    # -- one step -------------------------------------------------------------------------------------
    def step(self) -> list[ReqOutput]:
        """One scheduler iteration: launch the next step, process the previous one's results (with
        overlap the two run concurrently; without, the step launched here is processed here)."""
        outputs = self.move_ready_grammar_requests()
        had_in_flight = self.in_flight is not None
        self.tree_cache.check_events()
        if self.in_flight is not None and not self._can_prepare_while_in_flight():
            outputs += self._process_in_flight()
        # After the results the next batch needs: a processed prefill chunk hands its request back
        # as `chunked_req`, and the next batch would continue an aborted one to the prompt's end.
        outputs += self._drain_aborts()
        batch = self.get_next_batch_to_run()
        launched = (batch, self.run_batch(batch)) if batch is not None else None
        if self.in_flight is not None:
            outputs += self._process_in_flight()
        self.in_flight = launched
        if launched is not None and not self._overlap_active():
            outputs += self._process_in_flight()
        self.last_step_progressed = launched is not None or had_in_flight
        self.admission_watchdog.observe(launched is None and self.in_flight is None and bool(self.waiting_queue),
                                        self.admission_report)
        if batch is None and self.in_flight is None and not (self.waiting_queue or self.running or self.chunked_req):
            self.grammar_manager.wait()
        return outputs

    def finish_idle_step(self) -> list[ReqOutput]:
        """Process the step in flight when no request waits or runs: under overlap a speculative
        step may be launched for requests that the step before it then finished (its acceptance
        was unknown at launch); the offline Engine calls this once its requests are done, so an
        idle scheduler holds no uncommitted KV. (The server's loop steps while `has_work()`.)"""
        if self.in_flight is not None and not (self.waiting_queue or self.running or self.chunked_req):
            return self._process_in_flight()
        return []

    def _overlap_active(self) -> bool:
        return self.enable_overlap and self.tp_worker.supports_overlap

    def _can_prepare_while_in_flight(self) -> bool:
        """The next step may be built before the in-flight step's results are applied unless a
        request that will run next needs those results on the host to be sampled, or a prefill
        chunk is in flight (its request continues next, and only one request is chunked at a time)."""
        if not self._overlap_active() or any(r.is_chunked for r in self.in_flight[0].reqs):
            return False
        return not any(r.needs_host_sampling_state() or self.tp_worker.needs_host_state(r) for r in self.running)

    def _process_in_flight(self) -> list[ReqOutput]:
        batch, pending = self.in_flight
        self.in_flight = None
        result = pending.result().to_host()
        self.observe_batch(batch)  # stats logs / metrics: host counters only
        outputs = self.process_batch_result(batch, result)
        self.tree_cache.on_batch_done(batch)
        return outputs

    def on_prefill_finished(self, req: Req) -> None:
        """Policy for a request whose prompt is complete and that goes on: decode it here. (A
        prefill server of PD disaggregation sends its KV instead.)"""
        self.running.append(req)

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
            if req.inflight == 0:  # else processing the step in flight releases it
                self.release_req(req)
            outs.append(self._make_output(req, []))
        if self.chunked_req is not None and self.chunked_req.to_abort:
            req, self.chunked_req = self.chunked_req, None
            req.finished_reason = FINISH_ABORT(req.to_abort)
            self.release_req(req)
            outs.append(self._make_output(req, []))
        return outs

    # -- prefill admission ----------------------------------------------------------------------------
    def _reserved_for_running(self) -> int:
        return sum(int(max(r.sampling_params.max_new_tokens - len(r.output_ids), 0) * self.new_token_ratio)
                   for r in self.running)

    def _get_new_batch_prefill(self) -> ScheduleBatch | None:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        # Requests whose prefill is in flight (overlap) join `running` when it is processed.
        in_flight_new = self.in_flight[0].num_extend_reqs if self.in_flight is not None else 0
        running_slots = self.max_running_requests - len(self.running) - in_flight_new
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
            match = self.tree_cache.match_for_admission(fill[: req.max_prefix_len()])
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
                req.kv_allocated_len = req.kv_committed_len
        decode_reqs = [r for r in self.running if not self._reaches_length(r)] if mode == ForwardMode.MIXED else []
        prefix_lens = [r.kv_committed_len for r in reqs] + [r.kv_allocated_len for r in decode_reqs]
        extend_lens = [r.extend_input_len for r in reqs] + [1] * len(decode_reqs)
        out = self.alloc_kv(reqs + decode_reqs, prefix_lens, extend_lens, decode=False)
        if out is None:
            for req in reqs:  # cannot happen when admission is right; undo and retry later
                self._release_if_held(req)
                req.reset_for_retract()
                self.waiting_queue.insert(0, req)
            return None
        batch = ScheduleBatch(reqs + decode_reqs, mode, num_extend_reqs=len(reqs))
        batch.prefix_lens, batch.extend_lens, batch.out_cache_loc = prefix_lens, extend_lens, out
        batch.input_ids = [t for req, p, e in zip(reqs, prefix_lens, extend_lens) for t in req.fill_slice(p, p + e)]
        batch.input_ids += [FUTURE_TOKEN] * len(decode_reqs)
        return batch

    # -- decode -----------------------------------------------------------------------------------------
    def _prepare_decode(self) -> ScheduleBatch | None:
        n = self.tp_worker.num_tokens_per_req
        self._ensure_decode_memory(n)
        reqs = [r for r in self.running if not self._reaches_length(r)]
        if not reqs:
            return None
        prefix_lens = [r.kv_allocated_len for r in reqs]  # past any step still in flight
        out = self.alloc_kv(reqs, prefix_lens, [n] * len(reqs), decode=True)
        if out is None:
            raise RuntimeError("decode KV allocation failed after retraction")
        batch = ScheduleBatch(reqs, ForwardMode.DECODE)
        batch.prefix_lens, batch.extend_lens, batch.out_cache_loc = prefix_lens, [n] * len(reqs), out
        batch.input_ids = [FUTURE_TOKEN] * (n * len(reqs))  # each request's last token, on the device
        self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
        return batch

    @staticmethod
    def _reaches_length(req: Req) -> bool:
        """The step in flight gives the request its last allowed token: no step after it."""
        return req.inflight > 0 and len(req.output_ids) + req.inflight >= req.sampling_params.max_new_tokens

    def _decode_pages_needed(self, n: int) -> int:
        p = self.page_size
        return sum(cdiv(r.kv_allocated_len + n, p) - cdiv(r.kv_allocated_len, p) for r in self.running) * p

    def _ensure_decode_memory(self, n: int) -> None:
        need = self._decode_pages_needed(n)
        if self.allocator.available_size() < need:
            self.tree_cache.evict(need - self.allocator.available_size())
        retracted = 0
        while self.running and self.allocator.available_size() < self._decode_pages_needed(n):
            victims = sorted(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
            victim = victims[0]
            self.running.remove(victim)
            # A step in flight still writes the victim's old slots: it runs before any step that
            # could reuse them (one device queue / one worker thread), and its result is dropped.
            self.release_req(victim)
            victim.reset_for_retract()
            self.waiting_queue.insert(0, victim)
            retracted += 1
            need = self._decode_pages_needed(n)
            if self.allocator.available_size() < need:
                self.tree_cache.evict(need - self.allocator.available_size())
        if retracted:
            self.num_retracted_reqs += retracted
            self.new_token_ratio = INIT_NEW_TOKEN_RATIO
            logger.warning("KV cache full: retracted %d request(s) back to the queue", retracted)

    def alloc_kv(self, reqs: list[Req], prefix_lens: list[int], extend_lens: list[int],
                 decode: bool) -> torch.Tensor | None:
        """KV slots for positions [prefix, prefix + extend) of each request, written to req_to_token
        in one scatter; sets kv_allocated_len. Evicts from the prefix cache once if needed; None
        (nothing allocated) when it still does not fit. Host-only: this runs every step."""
        r2t = self.req_to_token_pool
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        rows = [r.req_pool_idx for r in reqs]
        last_locs = r2t.last_locs(rows, prefix_lens)
        one_each = decode and all(e == 1 for e in extend_lens)

        def alloc():
            if one_each:
                return self.allocator.alloc_decode(seq_lens, last_locs)
            return self.allocator.alloc_extend(prefix_lens, seq_lens, last_locs)

        out = alloc()
        if out is None:
            self.tree_cache.evict(sum(extend_lens) + self.page_size * len(reqs))
            out = alloc()
            if out is None:
                return None
        ext = torch.tensor(extend_lens)
        cols = torch.arange(len(out)) + (torch.tensor(prefix_lens) - (torch.cumsum(ext, 0) - ext)).repeat_interleave(ext)
        r2t.write_tokens(torch.tensor(rows).repeat_interleave(ext), cols, out)
        for r, sl in zip(reqs, seq_lens):
            r.kv_allocated_len = sl
        return out

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
        # A step in flight adds one token to each of its requests (only requests whose sampling
        # needs no host state of that step are prepared meanwhile): the seed step counts it.
        return SamplingBatchInfo.from_params(
            [r.sampling_params for r in reqs], self.vocab_size, self.device,
            output_ids=[r.output_ids for r in reqs], seeds_step=[len(r.output_ids) + r.inflight for r in reqs],
            eos_token_ids=self.eos_token_ids, grammars=grammars, custom_logit_processors=procs,
            custom_params=params)

    def run_batch(self, batch: ScheduleBatch) -> Pending:
        """Launch the batch on the worker; its results are processed later (process_batch_result)."""
        batch.sampling_info = self._sampling_info(batch.reqs)
        batch.req_epochs = [r.epoch for r in batch.reqs]
        for r in batch.reqs:
            r.inflight += 1
        self.tree_cache.prepare_batch(batch)
        self.forward_ct += 1
        return self.tp_worker.forward_batch_generation(batch)

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
        return self.tree_cache.host_leak_report()  # HiCache: host free + host cached == host total

    def _num_running_reqs(self) -> int:
        """Requests being computed: running, between chunks, or prefilling in the step in flight
        (under overlap a prefill's request is in no list until its step is processed)."""
        in_flight = self.in_flight[0].reqs if self.in_flight is not None else []
        reqs = {id(r): r for r in [*self.running, *([self.chunked_req] if self.chunked_req else []), *in_flight]}
        return sum(1 for r in reqs.values() if not r.finished())

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=self._num_running_reqs(),
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
            avg_spec_accept_length=self.tp_worker.avg_accept_length,
            num_grammar_queue_reqs=len(self.grammar_manager),
            num_retracted_reqs=self.num_retracted_reqs,
            host_cached_tokens=self.tree_cache.host_total_size(),
            admission_stall=self.admission_watchdog.reason if self.waiting_queue else None,
        )
