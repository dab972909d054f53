"""Waiting-queue ordering and prefill admission (the KV budget rules)."""

from __future__ import annotations

from sglang.srt.managers.schedule_batch import Req


def order_waiting_queue(queue: list[Req], policy: str, tree_cache) -> list[Req]:
    """fcfs keeps arrival order; lpm puts the longest cached prefix first (more reuse)."""
    if policy == "lpm" and tree_cache is not None and len(queue) > 1:
        hits = {id(r): len(tree_cache.match_prefix(r.fill_ids()[: r.max_prefix_len()]).device_indices)
                for r in queue}
        return sorted(queue, key=lambda r: -hits[id(r)])
    return queue


class PrefillAdder:
    """Admits waiting requests into one prefill batch within the token budgets.

    `rem_total_tokens`: free + evictable KV, minus what running requests are expected to still
    need (their remaining max_new_tokens times `new_token_ratio`, folded into `total_budget`),
    minus what this batch already took, so admission rarely forces a later retraction. `rem_chunk_tokens`: this step's prefill token budget (chunked prefill).
    """

    def __init__(self, total_budget, rem_input_tokens: int, rem_chunk_tokens: int | None,
                 page_size: int, max_new_reqs: int) -> None:
        # `total_budget()` is re-read on every check: admitting a request locks its cached prefix,
        # which shrinks the evictable part of the budget.
        self._total_budget = total_budget
        self._consumed = 0
        self.rem_input_tokens = rem_input_tokens
        self.rem_chunk_tokens = rem_chunk_tokens
        self.page_size = page_size
        self.max_new_reqs = max_new_reqs
        self.can_run: list[Req] = []
        self.new_chunked_req: Req | None = None

    @property
    def rem_total_tokens(self) -> int:
        return self._total_budget() - self._consumed

    def budget_full(self) -> bool:
        return (len(self.can_run) >= self.max_new_reqs or self.rem_input_tokens <= 0
                or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0))

    def add(self, req: Req, extend_len: int, reserve_new_tokens: int) -> bool:
        """Try to admit `req` with `extend_len` tokens to compute. Returns False if it must wait.

        A request bigger than the chunk budget takes a page-aligned chunk and becomes the
        (single) chunked request."""
        if self.budget_full():
            return False
        need = extend_len + reserve_new_tokens + self.page_size  # +1 page: partial-page slack
        if need > self.rem_total_tokens:
            # Prefill what fits now when chunking is on and the prompt is the problem.
            if self.rem_chunk_tokens is None or extend_len + self.page_size <= self.rem_total_tokens:
                return False
        chunk = self.rem_chunk_tokens
        if chunk is not None and extend_len > chunk:
            take = chunk // self.page_size * self.page_size
            take = min(take, (self.rem_total_tokens - self.page_size) // self.page_size * self.page_size)
            if take <= 0:
                return False
            req.extend_input_len = take
            req.is_chunked = True
            self.new_chunked_req = req
            self._consume(take, 0)
            self.can_run.append(req)
            self.rem_chunk_tokens = 0  # a chunked request ends the batch
            return True
        if need > self.rem_total_tokens:
            return False
        req.extend_input_len = extend_len
        req.is_chunked = False
        self._consume(extend_len, reserve_new_tokens)
        self.can_run.append(req)
        return True

    def _consume(self, extend_len: int, reserve: int) -> None:
        self._consumed += extend_len + reserve + self.page_size
        self.rem_input_tokens -= extend_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_len
