"""Prefill admission (mini-sglang's prefill manager; upstream's `get_new_batch_prefill`): which
waiting requests -- and the prompt chunk in progress -- the next prefill batch takes within the KV
and token budgets (`PrefillAdder`), their prefix-cache match (`tree_cache.match_for_admission`),
and the batch's KV (`prepare_for_extend`). The scheduler owns the queues and passes them in;
`waiting_queue` is changed in place."""

from __future__ import annotations

from sglang.srt.managers.cache_manager import CacheManager
from sglang.srt.managers.decode_manager import DecodeManager
from sglang.srt.managers.overlap_utils import FUTURE_TOKEN
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import PrefillAdder, order_waiting_queue
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.server_args import ServerArgs


class PrefillManager:
    def __init__(self, server_args: ServerArgs, cache_manager: CacheManager, decode_manager: DecodeManager,
                 tree_cache: BasePrefixCache) -> None:
        self.server_args, self.cache_manager, self.decode_manager = server_args, cache_manager, decode_manager
        self.tree_cache = tree_cache
        self.req_to_token_pool, self.allocator = cache_manager.req_to_token_pool, cache_manager.allocator
        self.page_size = cache_manager.page_size
        self.num_prompt_tokens = 0  # since start, of admitted requests (each counted once)
        self.num_cached_tokens = 0  # of those, prefix-cache hits at their first admission

    def get_new_batch_prefill(self, waiting_queue: list[Req], chunked_req: Req | None, running: list[Req],
                              running_slots: int) -> tuple[ScheduleBatch | None, Req | None]:
        """The next prefill batch (None: nothing fits) and the chunked request still to continue
        (None once this batch took it). `running_slots`: requests that may still start running."""
        if not waiting_queue and chunked_req is None:
            return None, chunked_req
        if running_slots <= 0 and chunked_req is None:
            return None, chunked_req
        reserved = self.decode_manager.reserved_tokens(running)
        sa = self.server_args
        adder = PrefillAdder(
            lambda: self.allocator.available_size() + self.tree_cache.evictable_size() - reserved,
            sa.max_prefill_tokens,
            sa.chunked_prefill_size if sa.chunked_prefill_size > 0 else None,
            self.page_size,
            max(running_slots, 1),
        )
        if chunked_req is not None:
            remaining = len(chunked_req.fill_ids()) - chunked_req.kv_committed_len
            if not adder.add(chunked_req, remaining, 0):
                return None, chunked_req  # not even the chunk fits: let decode free memory first
        waiting_queue[:] = order_waiting_queue(waiting_queue, sa.schedule_policy, self.tree_cache)
        admitted = self._admit(adder, waiting_queue)
        waiting_queue[:] = [r for r in waiting_queue if id(r) not in admitted]
        if not adder.can_run:
            return None, None
        mixed = sa.enable_mixed_chunk and bool(running)
        return self.prepare_for_extend(adder.can_run, running if mixed else [], waiting_queue), None

    def _admit(self, adder: PrefillAdder, waiting_queue: list[Req]) -> set[int]:
        """Admit waiting requests in order until one does not fit; the ids of those admitted."""
        admitted: set[int] = set()
        for req in waiting_queue:
            if adder.budget_full() or len(admitted) >= self.req_to_token_pool.available_size():
                break
            fill = req.fill_ids()
            match = self.tree_cache.match_for_admission(fill[: req.max_prefix_len()])
            self.tree_cache.inc_lock_ref(match.last_node)
            if not adder.add(req, len(fill) - len(match.device_indices), self.decode_manager.reserve(req)):
                self.tree_cache.dec_lock_ref(match.last_node)
                break
            req.prefix_indices, req.last_node = match.device_indices, match.last_node
            req.kv_committed_len = len(match.device_indices)
            if not req.admitted:
                req.admitted = True
                req.cached_tokens = len(match.device_indices)
                self.num_prompt_tokens += len(req.origin_input_ids)
                self.num_cached_tokens += req.cached_tokens
            admitted.add(id(req))
        return admitted

    def prepare_for_extend(self, reqs: list[Req], running: list[Req], waiting_queue: list[Req]) -> ScheduleBatch | None:
        """The batch of the admitted `reqs` (and, mixed, one decode row of each running request)."""
        r2t = self.req_to_token_pool
        for req in reqs:
            if req.req_pool_idx is None:
                req.req_pool_idx = r2t.alloc(1)[0]
                if len(req.prefix_indices):
                    r2t.write(req.req_pool_idx, 0, req.prefix_indices)
                req.kv_allocated_len = req.kv_committed_len
        decode_reqs = [r for r in running if not self.decode_manager.reaches_length(r)]
        prefix_lens = [r.kv_committed_len for r in reqs] + [r.kv_allocated_len for r in decode_reqs]
        extend_lens = [r.extend_input_len for r in reqs] + [1] * len(decode_reqs)
        out = self.cache_manager.alloc_kv(reqs + decode_reqs, prefix_lens, extend_lens, decode=False)
        if out is None:
            for req in reqs:  # cannot happen when admission is right; undo and retry later
                self.cache_manager.release_if_held(req)
                req.reset_for_retract()
                waiting_queue.insert(0, req)
            return None
        mode = ForwardMode.MIXED if running else ForwardMode.EXTEND
        batch = ScheduleBatch(reqs + decode_reqs, mode, num_extend_reqs=len(reqs))
        batch.prefix_lens, batch.extend_lens, batch.out_cache_loc = prefix_lens, extend_lens, out
        batch.input_ids = [t for req, p, e in zip(reqs, prefix_lens, extend_lens) for t in req.fill_slice(p, p + e)]
        batch.input_ids += [FUTURE_TOKEN] * len(decode_reqs)
        return batch
