"""Scheduler stats: upstream's periodic log lines and the numbers /metrics reports.

One hook per step (`observe_batch`, after the forward, before its results are applied) -- host counters only,
no tensor reads. Lines, at INFO, in upstream SGLang's format:

    Prefill batch. #new-seq: 2, #new-token: 96, #cached-token: 32, token usage: 0.01, #running-req: 3, #queue-req: 0,
    Decode batch. #running-req: 5, #token: 640, token usage: 0.08, cuda graph: False, gen throughput (token/s): 212.40, #queue-req: 0,

A prefill line for every batch that extends prompts, a decode line every --decode-log-interval
decode steps (rank 0 only). `#token` / `token usage` count KV held by requests (the cache's evictable pages are
free for this purpose), as upstream does; the throughput is decode tokens over the wall time
since the previous decode line. No speculative decoding runs here, so there is no accept length.
"""

from __future__ import annotations

import logging
import time

from sglang.srt.managers.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)


class SchedulerMetricsMixin:
    def init_metrics(self) -> None:
        self.decode_log_interval = self.server_args.decode_log_interval
        self.forward_ct_decode = 0
        self.num_generated_tokens = 0  # decode tokens since the last decode line
        self.last_decode_stats_tic = time.perf_counter()
        self.last_gen_throughput = 0.0
        self._logged_cached_tokens = 0  # prefill_manager.num_cached_tokens at the previous prefill line
        # Every rank schedules the same batches: rank 0 speaks for all of them.
        self._log_stats = self.tp_worker.world_group.rank == 0

    def get_token_info(self) -> tuple[int, float]:
        """(#tokens held by requests, that / KV capacity)."""
        free = self.allocator.available_size() + self.tree_cache.evictable_size()
        used = max(self.max_total_num_tokens - free, 0)
        return used, used / max(self.max_total_num_tokens, 1)

    def admission_report(self) -> str:
        """Why the first waiting request is not admitted (the admission watchdog's words)."""
        req = self.waiting_queue[0]
        sp = req.sampling_params
        need = len(req.fill_ids()) + self.decode_manager.reserve(req)
        return (f"first waiting request {req.rid!r} ({len(req.origin_input_ids)} prompt tokens, max_new_tokens "
                f"{sp.max_new_tokens}) needs ~{need} KV tokens + a page; free {self.allocator.available_size()}, "
                f"evictable {self.tree_cache.evictable_size()}, protected {self.tree_cache.protected_size()}, "
                f"reserved for running {self.decode_manager.reserved_tokens(self.running)} of "
                f"{self.max_total_num_tokens}; "
                f"{len(self.running)} running, {len(self.waiting_queue)} waiting, "
                f"{self.req_to_token_pool.available_size()} request slots free")

    def observe_batch(self, batch: ScheduleBatch) -> None:
        if batch.forward_mode.is_extend():
            # A mixed batch lists its decode requests last (one token each, fed their last output).
            n_decode = len(batch.reqs) - batch.num_extend_reqs
            self.num_generated_tokens += n_decode
            self.log_prefill_stats(batch, len(batch.reqs) - n_decode)
            return
        self.num_generated_tokens += len(batch.reqs)
        self.forward_ct_decode += 1
        if self.forward_ct_decode % self.decode_log_interval == 0:
            self.log_decode_stats(batch)

    def log_prefill_stats(self, batch: ScheduleBatch, n_new: int) -> None:
        new_tokens = sum(batch.extend_lens[:n_new])
        cached = self.prefill_manager.num_cached_tokens - self._logged_cached_tokens
        self._logged_cached_tokens = self.prefill_manager.num_cached_tokens
        if not (self._log_stats and logger.isEnabledFor(logging.INFO)):
            return
        used, usage = self.get_token_info()
        logger.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                    "#running-req: %d, #queue-req: %d, ", n_new, new_tokens, cached, usage, len(self.running),
                    len(self.waiting_queue))

    def log_decode_stats(self, batch: ScheduleBatch) -> None:
        now = time.perf_counter()
        self.last_gen_throughput = self.num_generated_tokens / max(now - self.last_decode_stats_tic, 1e-9)
        self.last_decode_stats_tic, self.num_generated_tokens = now, 0
        if not (self._log_stats and logger.isEnabledFor(logging.INFO)):
            return
        used, usage = self.get_token_info()
        graph = self.tp_worker.model_runner.last_forward_used_graph
        logger.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, cuda graph: %s, "
                    "gen throughput (token/s): %.2f, #queue-req: %d, ", len(batch.reqs), used, usage, graph,
                    self.last_gen_throughput, len(self.waiting_queue))
