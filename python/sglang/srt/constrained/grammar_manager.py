"""The scheduler's grammar queue (upstream's GrammarManager): requests whose grammar is still
compiling wait here, in arrival order, off the waiting queue, so they delay nobody.

Rules: `process_req_with_grammar` never blocks (a cache hit attaches a fresh matcher at once; a
miss queues the request with the compile's future); `get_ready_grammar_requests` never blocks on
rank 0, and under TP the other ranks take rank 0's list (waiting for the same compile if theirs is
slower), so every rank admits the same requests in the same step. Under TP every grammar request
goes through the queue, cache hit or not: each rank has its own cache, and a compile that already
finished on one rank may still run on another, so "hit" is not the same decision on every rank. A grammar that did not compile
(or not within GRAMMAR_TIMEOUT_S) finishes its request with a 400 abort naming the field. A request
that thinks first (`sampling_params.think_end_ids`) gets its matcher wrapped in a
ReasonerGrammarObject: unconstrained until the end of its think block.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

from sglang.srt.constrained import STRUCTURED_OUTPUTS_DISABLED
from sglang.srt.constrained.base_grammar_backend import BaseGrammarBackend, InvalidGrammar, grammar_key
from sglang.srt.constrained.reasoner_grammar_backend import maybe_reasoner

GRAMMAR_TIMEOUT_S = 300.0  # upstream's SGLANG_GRAMMAR_TIMEOUT default
GRAMMAR_POLL_S = 0.02  # how long an otherwise idle scheduler waits for a compiling grammar


class GrammarManager:
    def __init__(self, backend: BaseGrammarBackend | None, world_group) -> None:
        self.grammar_backend = backend
        self.world_group = world_group
        self.grammar_queue: list = []  # Req, each with req.grammar = a Future

    def __len__(self) -> int:
        return len(self.grammar_queue)

    def process_req_with_grammar(self, req) -> bool:
        """Attach the request's grammar. True: it was queued (compiling). False: it goes on now
        (to the waiting queue, or -- with req.finished_reason set -- straight back as an abort)."""
        key = grammar_key(req.sampling_params)
        if key is None:
            return False
        if self.grammar_backend is None:
            req.set_finish_with_abort(STRUCTURED_OUTPUTS_DISABLED)
            return False
        req.grammar_key = key
        value, cache_hit = self.grammar_backend.get_cached_or_future_value(key)
        if cache_hit and not self.world_group.is_single:
            value, cache_hit = _done(value), False  # rank 0's ready list admits it (see the module doc)
        if not cache_hit:
            req.grammar, req.grammar_wait_start = value, time.monotonic()
            self.grammar_queue.append(req)
            return True
        if isinstance(value, InvalidGrammar):
            req.set_finish_with_abort(value.error_message())
        else:
            req.grammar = maybe_reasoner(value, req.sampling_params)
        return False

    def get_ready_grammar_requests(self) -> list:
        """Requests leaving the queue this step, in arrival order: with a matcher attached, or
        finished (req.finished_reason set) when their grammar did not compile."""
        if not self.grammar_queue:
            return []
        now = time.monotonic()
        ready = [i for i, r in enumerate(self.grammar_queue)
                 if r.grammar.done() or now - r.grammar_wait_start > GRAMMAR_TIMEOUT_S]
        single = self.world_group.is_single
        if not single:  # rank 0 decides; over the gloo cpu_group (a host list, no device trip)
            ready = self.world_group.broadcast_object(ready)
        out = []
        for i in ready:
            req = self.grammar_queue[i]
            if req.grammar.done() or not single:
                value = req.grammar.result(GRAMMAR_TIMEOUT_S)
            else:
                req.grammar.cancel()
                value = InvalidGrammar(req.grammar_key[0], f"did not compile within {GRAMMAR_TIMEOUT_S:.0f}s")
            if isinstance(value, InvalidGrammar):
                req.grammar = None
                req.set_finish_with_abort(value.error_message())
            else:
                req.grammar = maybe_reasoner(value, req.sampling_params)
            out.append(req)
        taken = set(ready)
        self.grammar_queue = [r for i, r in enumerate(self.grammar_queue) if i not in taken]
        return out

    def abort_request(self, rid: str):
        """Remove and return the queued request `rid` (its matcher dropped), or None."""
        for i, req in enumerate(self.grammar_queue):
            if req.rid == rid:
                del self.grammar_queue[i]
                req.grammar.cancel()  # only this waiter: the compile still fills the cache
                req.grammar = None
                return req
        return None

    def wait(self, timeout: float = GRAMMAR_POLL_S) -> None:
        """Nothing else to do: wait a little for the oldest compile (no busy loop)."""
        if self.grammar_queue:
            try:
                self.grammar_queue[0].grammar.exception(timeout=timeout)
            except Exception:  # TimeoutError / CancelledError: poll again next step
                pass


def _done(value) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut
