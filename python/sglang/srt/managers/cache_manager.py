"""A request's KV slots (mini-sglang's cache manager): the rows of a step allocated and written to
req_to_token in one scatter, and their release into the prefix cache. Prefill admission, decode
steps and PD preallocation allocate here; finish, abort, retraction and prefill-only release here.
Host-only: the scheduler calls it every step."""

from __future__ import annotations

import torch

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglang.srt.utils.common import cdiv


class CacheManager:
    def __init__(self, req_to_token_pool, allocator, tree_cache: BasePrefixCache, page_size: int) -> None:
        self.req_to_token_pool, self.allocator = req_to_token_pool, allocator
        self.tree_cache, self.page_size = tree_cache, page_size

    def alloc_kv(self, reqs: list[Req], prefix_lens: list[int], extend_lens: list[int],
                 decode: bool) -> torch.Tensor | None:
        """KV slots for positions [prefix, prefix + extend) of each request, written to req_to_token
        in one scatter; sets kv_allocated_len. Evicts from the prefix cache once if needed; None
        (nothing allocated) when it still does not fit."""
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
        starts = torch.tensor(prefix_lens) - (torch.cumsum(ext, 0) - ext)  # column of each row's first slot
        cols = torch.arange(len(out)) + starts.repeat_interleave(ext)
        r2t.write_tokens(torch.tensor(rows).repeat_interleave(ext), cols, out)
        for r, sl in zip(reqs, seq_lens):
            r.kv_allocated_len = sl
        return out

    def release_req(self, req: Req) -> None:
        """Hand a request's KV to the prefix cache and free what it does not keep: the one place a
        request's slots are released (finish, abort, retraction, prefill-only). Callers make sure
        no step that writes them is in flight, or that its result will be dropped (retraction)."""
        self.free_uncommitted_kv(req)
        self.tree_cache.cache_finished_req(req)

    def release_if_held(self, req: Req) -> None:
        if req.req_pool_idx is not None:
            self.release_req(req)

    def free_uncommitted_kv(self, req: Req, keep: int | None = None) -> None:
        """Free the pages wholly past `keep` (default kv_committed_len): rows of a step that were not
        accepted, or of a step whose request finished; the tail page keeps its free slots. A
        speculative step in flight under overlap keeps its window (`keep` past the committed KV)."""
        keep = req.kv_committed_len if keep is None else min(keep, req.kv_allocated_len)
        start = cdiv(keep, self.page_size) * self.page_size
        if req.kv_allocated_len > start:
            self.allocator.free(self.req_to_token_pool.read(req.req_pool_idx, req.kv_allocated_len)[start:])
        req.kv_allocated_len = keep
