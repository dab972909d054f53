"""Scheduler: continuous batching over a model worker, with a prefix cache.

`step()` = `get_next_batch_to_run()` (a prefill batch of newly admitted requests -- optionally
with the running decode requests mixed in -- or one decode step of the running requests) ->
`run_batch()` (the worker launches forward + sampling and queues the step's device->host copy) ->
`process_batch_result()` (scheduler_output_processor.py; results may hold 0..N tokens per request
and say which KV rows to commit). With overlap (the default) step n+1 is prepared and launched
before step n's results are processed; decode input ids come from the worker's device token table,
so nothing waits for step n's tokens to reach the host. Steps whose sampling needs the previous
step's host state (grammars, penalties, custom processors) wait for it first.

The scheduler owns the queues (`waiting_queue`, `running`, `chunked_req`); its managers do the
rest: `prefill_manager` admission, `decode_manager` decode steps and retraction (requests that
cannot get KV wait; a decode step that runs out of KV retracts requests back to the queue),
`cache_manager` a request's KV slots, `overlap` the launched step. Host state only (the
req_to_token host mirror, CPU lists). The same class runs in-process (the offline Engine) and
inside the scheduler process.

Lifecycle hooks, each called from one place: `tree_cache.check_events()` once per iteration (and
`poll_idle()` between them), `tree_cache.prepare_batch(batch)` before a launch,
`tree_cache.on_batch_done(batch)` after its results are applied, `on_prefill_finished(req)` when a
request's prompt is complete (the default policy starts decoding it).
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
from sglang.srt.managers.cache_manager import CacheManager
from sglang.srt.managers.decode_manager import DecodeManager
from sglang.srt.managers.overlap_utils import LaunchedStep, OverlapState, Pending
from sglang.srt.managers.prefill_manager import PrefillManager
from sglang.srt.managers.request_limits import max_new_tokens_limit, request_length_error
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req, ScheduleBatch
from sglang.srt.managers.scheduler_metrics_mixin import SchedulerMetricsMixin
from sglang.srt.managers.scheduler_output_processor import SchedulerOutputProcessorMixin
from sglang.srt.managers.tp_worker import BaseTpWorker, TpModelWorker
from sglang.srt.sampling.custom_logit_processor import CUSTOM_LOGIT_PROCESSOR_DISABLED
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# A step that made no progress while requests wait (none fits): the loop waits this long on its
# sockets (a message ends the wait) instead of stepping again at once. Short: nothing else wakes it.
STALL_POLL_MS = 2
IDLE_POLL_MS = 1000  # idle: only a message wakes it
EVENT_POLL_MS = 2  # idle, but HiCache copies are still to be acknowledged (poll_idle)


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
        self.overlap = OverlapState(enabled=not server_args.disable_overlap_schedule)
        self.context_len = self.model_config.context_len
        self.tree_cache = create_tree_cache(server_args, worker, self.page_size)
        self.cache_manager = CacheManager(self.req_to_token_pool, self.allocator, self.tree_cache, self.page_size)
        self.decode_manager = DecodeManager(self.cache_manager, self.tree_cache, self.allocator, self.page_size)
        self.prefill_manager = PrefillManager(server_args, self.cache_manager, self.decode_manager, self.tree_cache)
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
                self.cache_manager.release_if_held(req)
                return [self._make_output(req, [])]
        # Running, between chunks, or in the launched step (its prefill rows are in no queue).
        for req in self.running + ([self.chunked_req] if self.chunked_req else []) + self.overlap.reqs:
            if req.rid == rid:
                req.to_abort = "aborted by client"
        return []

    def has_work(self) -> bool:
        return bool(self.waiting_queue or self.running or self.chunked_req or self.grammar_manager.grammar_queue
                    or self.overlap.launched is not None)

    def _has_requests(self) -> bool:
        return bool(self.waiting_queue or self.running or self.chunked_req)

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
        had_launched = self.overlap.launched is not None
        self.tree_cache.check_events()
        if self.overlap.must_process_first(self.running, self.tp_worker):
            outputs += self._process(self.overlap.take())
        # After the results the next batch needs: a processed prefill chunk hands its request back
        # as `chunked_req`, and the next batch would continue an aborted one to the prompt's end.
        outputs += self._drain_aborts()
        batch = self.get_next_batch_to_run()
        step = LaunchedStep(batch, self.run_batch(batch)) if batch is not None else None
        for done in self.overlap.after_launch(step, self.tp_worker):
            outputs += self._process(done)
        self.last_step_progressed = step is not None or had_launched
        idle = step is None and self.overlap.launched is None
        self.admission_watchdog.observe(idle and bool(self.waiting_queue), self.admission_report)
        if idle and not self._has_requests():
            self.grammar_manager.wait()
        return outputs

    def finish_idle_step(self) -> list[ReqOutput]:
        """Process the step in flight when no request waits or runs: under overlap a speculative
        step may be launched for requests that the step before it then finished (its acceptance
        was unknown at launch); the offline Engine calls this once its requests are done, so an
        idle scheduler holds no uncommitted KV. (The server's loop steps while `has_work()`.)"""
        if self.overlap.launched is not None and not self._has_requests():
            return self._process(self.overlap.take())
        return []

    def _process(self, step: LaunchedStep) -> list[ReqOutput]:
        batch = step.batch
        result = step.pending.result().to_host()
        self.observe_batch(batch)  # stats logs / metrics: host counters only
        outputs = self.process_batch_result(batch, result)
        self.tree_cache.on_batch_done(batch)
        return outputs

    def on_prefill_finished(self, req: Req) -> None:
        """Policy for a request whose prompt is complete and that goes on: decode it here. (A
        prefill server of PD disaggregation sends its KV instead.)"""
        self.running.append(req)

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        # Requests whose prefill is in the launched step join `running` when it is processed.
        running_slots = self.max_running_requests - len(self.running) - self.overlap.num_new_running()
        batch, self.chunked_req = self.prefill_manager.get_new_batch_prefill(
            self.waiting_queue, self.chunked_req, self.running, running_slots)
        if batch is None and self.running:
            batch = self.decode_manager.prepare_for_decode(self.running, self.waiting_queue,
                                                           self.tp_worker.num_tokens_per_req)
        return batch

    def _drain_aborts(self) -> list[ReqOutput]:
        outs = []
        for req in [r for r in self.running if r.to_abort]:
            self.running.remove(req)
            req.finished_reason = FINISH_ABORT(req.to_abort)
            if req.unprocessed_steps == 0:  # else processing the launched step releases it
                self.cache_manager.release_req(req)
            outs.append(self._make_output(req, []))
        if self.chunked_req is not None and self.chunked_req.to_abort:
            req, self.chunked_req = self.chunked_req, None
            req.finished_reason = FINISH_ABORT(req.to_abort)
            self.cache_manager.release_req(req)
            outs.append(self._make_output(req, []))
        return outs

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
        # A launched step adds one token to each of its requests (only requests whose sampling
        # needs no host state of that step are prepared meanwhile): the seed step counts it.
        return SamplingBatchInfo.from_params(
            [r.sampling_params for r in reqs], self.vocab_size, self.device,
            output_ids=[r.output_ids for r in reqs],
            seeds_step=[len(r.output_ids) + r.unprocessed_steps for r in reqs],
            eos_token_ids=self.eos_token_ids, grammars=grammars, custom_logit_processors=procs,
            custom_params=params)

    def run_batch(self, batch: ScheduleBatch) -> Pending:
        """Launch the batch on the worker; its results are processed later (process_batch_result)."""
        batch.sampling_info = self._sampling_info(batch.reqs)
        batch.req_epochs = [r.epoch for r in batch.reqs]
        for r in batch.reqs:
            r.unprocessed_steps += 1
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
        """Requests being computed: running, between chunks, or prefilling in the launched step
        (under overlap a prefill's request is in no list until its step is processed)."""
        chunked = [self.chunked_req] if self.chunked_req else []
        reqs = {id(r): r for r in [*self.running, *chunked, *self.overlap.reqs]}
        return sum(1 for r in reqs.values() if not r.finished())

    def get_stats(self) -> SchedulerStats:
        admitted = self.prefill_manager
        hit_rate = admitted.num_cached_tokens / admitted.num_prompt_tokens if admitted.num_prompt_tokens else 0.0
        return SchedulerStats(
            num_running_reqs=self._num_running_reqs(),
            num_waiting_reqs=len(self.waiting_queue) + len(self.grammar_manager),
            kv_total_tokens=self.max_total_num_tokens,
            kv_free_tokens=self.allocator.available_size(),
            kv_cached_tokens=self.tree_cache.total_size(),
            kv_protected_tokens=self.tree_cache.protected_size(),
            cache_hit_rate=hit_rate,
            num_prompt_tokens=admitted.num_prompt_tokens,
            num_cached_tokens=admitted.num_cached_tokens,
            kv_leak=self.kv_leak_report(),
            num_used_tokens=self.get_token_info()[0],
            gen_throughput=self.last_gen_throughput,
            avg_spec_accept_length=self.tp_worker.avg_accept_length,
            num_grammar_queue_reqs=len(self.grammar_manager),
            num_retracted_reqs=self.decode_manager.num_retracted_reqs,
            host_cached_tokens=self.tree_cache.host_total_size(),
            admission_stall=self.admission_watchdog.reason if self.waiting_queue else None,
        )
