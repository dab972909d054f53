"""Decode steps of the running requests (mini-sglang's decode manager; upstream's
`prepare_for_decode` / `retract_decode`): KV for each request's next N rows, retraction back to the
waiting queue when the pool cannot hold them, and the new-token ratio by which admission keeps KV
free for the running requests' growth (decays every decode step, reset by a retraction). The
scheduler owns the queues and passes them in; lists are changed in place."""

from __future__ import annotations

import logging

from sglang.srt.managers.cache_manager import CacheManager
from sglang.srt.managers.overlap_utils import FUTURE_TOKEN
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.utils.common import cdiv

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class DecodeManager:
    def __init__(self, cache_manager: CacheManager, tree_cache: BasePrefixCache, allocator, page_size: int) -> None:
        self.cache_manager, self.tree_cache = cache_manager, tree_cache
        self.allocator, self.page_size = allocator, page_size
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_retracted_reqs = 0  # since start: requests a decode step that ran out of KV put back

    def reserve(self, req: Req) -> int:
        """KV tokens admission keeps free for a request's growth: its remaining tokens x the ratio."""
        return int(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0) * self.new_token_ratio)

    def reserved_tokens(self, reqs: list[Req]) -> int:
        return sum(self.reserve(r) for r in reqs)

    @staticmethod
    def reaches_length(req: Req) -> bool:
        """The step in flight gives the request its last allowed token: no step after it."""
        n = req.unprocessed_steps
        return n > 0 and len(req.output_ids) + n >= req.sampling_params.max_new_tokens

    def prepare_for_decode(self, running: list[Req], waiting_queue: list[Req], n: int) -> ScheduleBatch | None:
        """One decode step of `n` rows per running request (retracting requests until they fit)."""
        self.retract_decode(running, waiting_queue, n)
        reqs = [r for r in running if not self.reaches_length(r)]
        if not reqs:
            return None
        prefix_lens = [r.kv_allocated_len for r in reqs]  # past any step still in flight
        out = self.cache_manager.alloc_kv(reqs, prefix_lens, [n] * len(reqs), decode=True)
        if out is None:
            raise RuntimeError("decode KV allocation failed after retraction")
        batch = ScheduleBatch(reqs, ForwardMode.DECODE)
        batch.prefix_lens, batch.extend_lens, batch.out_cache_loc = prefix_lens, [n] * len(reqs), out
        batch.input_ids = [FUTURE_TOKEN] * (n * len(reqs))  # each request's last token, on the device
        self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
        return batch

    def _pages_needed(self, running: list[Req], n: int) -> int:
        p = self.page_size
        return sum(cdiv(r.kv_allocated_len + n, p) - cdiv(r.kv_allocated_len, p) for r in running) * p

    def _evict_for(self, running: list[Req], n: int) -> None:
        need = self._pages_needed(running, n)
        if self.allocator.available_size() < need:
            self.tree_cache.evict(need - self.allocator.available_size())

    def retract_decode(self, running: list[Req], waiting_queue: list[Req], n: int) -> None:
        """Make room for `n` more rows of every running request: evict from the prefix cache, then
        move requests (fewest outputs, longest prompt first) back to the front of the queue."""
        self._evict_for(running, n)
        retracted = 0
        while running and self.allocator.available_size() < self._pages_needed(running, n):
            victim = min(running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
            running.remove(victim)
            # A step in flight still writes the victim's old slots: it runs before any step that
            # could reuse them (one device queue / one worker thread), and its result is dropped.
            self.cache_manager.release_req(victim)
            victim.reset_for_retract()
            waiting_queue.insert(0, victim)
            retracted += 1
            self._evict_for(running, n)
        if retracted:
            self.num_retracted_reqs += retracted
            self.new_token_ratio = INIT_NEW_TOKEN_RATIO
            logger.warning("KV cache full: retracted %d request(s) back to the queue", retracted)
