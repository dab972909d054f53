"""ChunkCache (--disable-radix-cache): no reuse across requests; a request's KV is freed when it
finishes; chunked prefill keeps the request's own KV as its prefix. CPU, fast."""

from __future__ import annotations


import pytest


import torch

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator import KVAllocatorError, PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, ChunkCache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.sampling.sampling_params import SamplingParams


class Env:
    def __init__(self, p: int, num_pages: int = 16) -> None:
        self.p, self.capacity = p, num_pages * p
        self.alloc = PagedTokenToKVPoolAllocator(self.capacity, p)
        self.r2t = ReqToTokenPool(4, 128)
        self.cache = ChunkCache(self.r2t, self.alloc, p)

    def admit(self, tokens: list[int]) -> Req:
        req = Req("r", tokens, SamplingParams())
        m = self.cache.match_prefix(tokens)
        self.cache.inc_lock_ref(m.last_node)
        req.prefix_indices, req.last_node = m.device_indices, m.last_node
        req.kv_committed_len = len(m.device_indices)
        req.req_pool_idx = self.r2t.alloc(1)[0]
        return req

    def extend(self, req: Req, new_len: int) -> torch.Tensor:
        pl = req.kv_committed_len
        last = int(self.r2t.req_to_token[req.req_pool_idx, pl - 1]) if pl else -1
        out = self.alloc.alloc_extend([pl], [new_len], [last])
        assert out is not None
        self.r2t.write(req.req_pool_idx, pl, out)
        req.kv_committed_len = new_len
        return out


def test_chunk_cache_is_a_prefix_cache():
    env = Env(1)
    assert isinstance(env.cache, BasePrefixCache)
    assert env.cache.evictable_size() == 0 and env.cache.protected_size() == 0 and env.cache.total_size() == 0
    assert env.cache.evict(100) == 0
    env.cache.inc_lock_ref(None)
    env.cache.dec_lock_ref(None)
    env.cache.reset()


@pytest.mark.parametrize("p", [1, 4])
def test_chunk_cache_never_matches(p):
    env = Env(p)
    req = env.admit(list(range(3 * p)))
    env.extend(req, 3 * p)
    env.cache.cache_finished_req(req)
    m = env.cache.match_prefix(list(range(3 * p)))
    assert m.device_indices.numel() == 0 and m.device_indices.dtype == torch.int64 and m.last_node is None


@pytest.mark.parametrize("p", [1, 4])
def test_chunk_cache_finished_frees_everything(p):
    env = Env(p)
    n = 2 * p + 1  # unaligned: the partial last page is freed too
    req = env.admit(list(range(n)))
    slots = env.extend(req, n)
    assert env.alloc.available_size() == env.capacity - (n + p - 1) // p * p
    idx = req.req_pool_idx
    env.cache.cache_finished_req(req)
    assert env.alloc.available_size() == env.capacity
    assert env.r2t.available_size() == env.r2t.size
    assert req.req_pool_idx is None and req.prefix_indices.numel() == 0
    with pytest.raises(KVAllocatorError):
        env.alloc.free(slots)  # really freed: a second free is a double free
    with pytest.raises(RuntimeError):
        env.r2t.free(idx)


@pytest.mark.parametrize("p", [1, 4])
def test_chunk_cache_finished_with_decode_tokens(p):
    env = Env(p)
    req = env.admit(list(range(p + 1)))
    env.extend(req, p + 1)
    req.output_ids.append(9)
    for step in range(p + 1):  # the last output has no KV yet
        env.extend(req, req.kv_committed_len + 1)
        req.output_ids.append(10 + step)
    assert req.kv_committed_len == len(req.kv_token_ids()) - 1
    env.cache.cache_finished_req(req)
    assert env.alloc.available_size() == env.capacity


@pytest.mark.parametrize("p", [1, 4])
def test_chunk_cache_unfinished_keeps_own_kv(p):
    env = Env(p)
    prompt = list(range(4 * p + 2))
    req = env.admit(prompt)
    first = env.extend(req, 2 * p + 1)  # unaligned chunk
    avail = env.alloc.available_size()
    env.cache.cache_unfinished_req(req)
    assert env.alloc.available_size() == avail  # nothing freed, nothing shared
    assert torch.equal(req.prefix_indices, first)
    assert env.cache.total_size() == 0
    second = env.extend(req, len(prompt))  # continues the partial page
    row = env.r2t.req_to_token[req.req_pool_idx, : len(prompt)]
    assert torch.equal(row, torch.cat([first, second]))
    for pos, slot in enumerate(row.tolist()):
        assert slot % p == pos % p
    env.cache.cache_unfinished_req(req)
    assert torch.equal(req.prefix_indices, row)
    env.cache.cache_finished_req(req)
    assert env.alloc.available_size() == env.capacity and env.r2t.available_size() == env.r2t.size


@pytest.mark.parametrize("p", [1, 4])
def test_chunk_cache_same_prompt_twice_no_sharing(p):
    env = Env(p)
    prompt = list(range(2 * p))
    a, b = env.admit(prompt), env.admit(prompt)
    sa, sb = env.extend(a, 2 * p), env.extend(b, 2 * p)
    assert not set(sa.tolist()) & set(sb.tolist())
    assert a.req_pool_idx != b.req_pool_idx
    env.cache.cache_finished_req(a)
    assert env.alloc.available_size() == env.capacity - 2 * p  # b's KV untouched
    assert torch.equal(env.r2t.req_to_token[b.req_pool_idx, : 2 * p], sb)
    env.cache.cache_finished_req(b)
    assert env.alloc.available_size() == env.capacity


def test_chunk_cache_release_without_kv():
    """A request released right after admission (no KV computed)."""
    env = Env(4)
    req = env.admit([1, 2, 3])
    env.cache.cache_finished_req(req)
    assert env.alloc.available_size() == env.capacity and env.r2t.available_size() == env.r2t.size
