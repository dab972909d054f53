"""RadixCache (page-granular): match/insert/split, lock refs, size bookkeeping, LRU eviction,
cache_finished_req / cache_unfinished_req ownership (no leak, no double ownership), and a
randomized scheduler-like workload. CPU, fast."""

from __future__ import annotations

import itertools
import random

import pytest


import torch

import sglang.srt.mem_cache.radix_cache as radix_mod
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode
from sglang.srt.sampling.sampling_params import SamplingParams

MAX_CTX = 256


@pytest.fixture(autouse=True)
def fake_clock(monkeypatch):
    """Strictly increasing clock, so LRU order never depends on timer resolution."""
    ticks = itertools.count(1)

    class _T:
        @staticmethod
        def monotonic() -> float:
            return float(next(ticks))

    monkeypatch.setattr(radix_mod, "time", _T)


class FakeReq:
    """The Req fields the caches use."""

    def __init__(self, tokens: list[int]) -> None:
        self.origin_input_ids = list(tokens)
        self.output_ids: list[int] = []
        self.req_pool_idx: int | None = None
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.kv_committed_len = 0

    def kv_token_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids


class Env:
    def __init__(self, page_size: int, num_pages: int = 64, num_reqs: int = 16) -> None:
        self.p = page_size
        self.capacity = num_pages * page_size
        self.alloc = PagedTokenToKVPoolAllocator(self.capacity, page_size)
        self.r2t = ReqToTokenPool(num_reqs, MAX_CTX)
        self.tree = RadixCache(self.r2t, self.alloc, page_size)
        self.live: list = []

    # scheduler-like steps ------------------------------------------------------------------------
    def admit(self, req, max_prefix: int | None = None) -> None:
        """match -> lock -> req slot -> write prefix."""
        toks = req.kv_token_ids()
        n = len(toks) - 1 if max_prefix is None else max_prefix
        m = self.tree.match_prefix(toks[:n])
        self.tree.inc_lock_ref(m.last_node)
        req.prefix_indices, req.last_node = m.device_indices, m.last_node
        req.kv_committed_len = len(m.device_indices)
        req.req_pool_idx = self.r2t.alloc(1)[0]
        self.r2t.write(req.req_pool_idx, 0, m.device_indices)
        self.live.append(req)

    def extend(self, req, new_len: int, evict: bool = True) -> bool:
        """alloc_extend positions [kv_committed_len, new_len) and write them to req_to_token."""
        pl = req.kv_committed_len
        last = int(self.r2t.req_to_token[req.req_pool_idx, pl - 1]) if pl else -1
        out = self.alloc.alloc_extend([pl], [new_len], [last])
        if out is None and evict:
            self.tree.evict(new_len - pl + self.p)
            out = self.alloc.alloc_extend([pl], [new_len], [last])
        if out is None:
            return False
        self.r2t.write(req.req_pool_idx, pl, out)
        req.kv_committed_len = new_len
        return True

    def run(self, tokens: list[int], max_prefix: int | None = None):
        """Admit, prefill the whole prompt, return the req (still live)."""
        req = FakeReq(tokens)
        self.admit(req, max_prefix)
        assert self.extend(req, len(tokens))
        return req

    def finish(self, req) -> None:
        self.tree.cache_finished_req(req)
        self.live.remove(req)
        assert req.req_pool_idx is None and req.last_node is None and len(req.prefix_indices) == 0

    def unfinished(self, req) -> None:
        self.tree.cache_unfinished_req(req)

    # invariants ----------------------------------------------------------------------------------
    def check(self) -> None:
        check_tree(self.tree)
        p, a, tree = self.p, self.alloc, self.tree
        free = set(a.free_pages.tolist())
        assert len(free) == len(a.free_pages), "free list holds a page twice"
        vals = tree.all_values().tolist()
        assert len(vals) == len(set(vals)), "a slot owned by two tree nodes"
        tree_pages = {v // p for v in vals}
        assert len(tree_pages) * p == len(vals), "tree holds partial pages"
        assert 0 not in tree_pages
        assert not (tree_pages & free), "a tree page is also free"
        own_pages: set[int] = set()
        locks: dict[int, int] = {}
        for req in self.live:
            row = self.r2t.req_to_token[req.req_pool_idx]
            n_pre = len(req.prefix_indices)
            assert n_pre % p == 0
            # The prefix slots are the tree's; req_to_token agrees with prefix_indices.
            assert torch.equal(row[:n_pre], req.prefix_indices)
            assert set(req.prefix_indices.tolist()) <= set(vals)
            own = row[n_pre : req.kv_committed_len].tolist()
            for pos, slot in enumerate(own, start=n_pre):
                assert slot % p == pos % p
            pages = {s // p for s in own}
            assert not (pages & own_pages), "two live requests share a page"
            assert not (pages & tree_pages), "a request's own page is in the tree"
            assert not (pages & free), "a request's own page is free"
            own_pages |= pages
            node = req.last_node
            while node is not None and node is not tree.root:
                locks[id(node)] = locks.get(id(node), 0) + 1
                node = node.parent
            # The locked path spells exactly the request's prefix.
            assert path_key(tree, req.last_node) == req.kv_token_ids()[:n_pre]
        for node in tree._all_nodes():
            if node is not tree.root:
                assert node.lock_ref == locks.get(id(node), 0), "lock_ref != live requests locking it"
        assert len(free) + len(tree_pages) + len(own_pages) == a.num_pages, "pages leaked"
        if not self.live:
            assert a.available_size() + tree.total_size() == self.capacity


def path_key(tree: RadixCache, node) -> list[int]:
    parts = []
    while node is not None and node is not tree.root:
        parts.append(node.key)
        node = node.parent
    return [t for k in reversed(parts) for t in k]


def check_tree(tree: RadixCache) -> None:
    p = tree.page_size
    evictable = protected = total = 0
    for node in tree._all_nodes():
        if node is tree.root:
            assert node.key == [] and node.parent is None and node.lock_ref >= 1
        else:
            assert len(node.key) > 0 and len(node.key) % p == 0 and len(node.key) == len(node.value)
            assert node.parent.children[tuple(node.key[:p])] is node
            assert node.lock_ref >= 0
            if node.parent is not tree.root:
                assert node.parent.lock_ref >= node.lock_ref, "child locked more than its parent"
            v = node.value
            pages = (v // p).view(-1, p)
            assert (pages == pages[:, :1]).all(), "a node page spans KV pages"
            assert ((v % p).view(-1, p) == torch.arange(p)).all()
            total += len(node.key)
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        keys = [tuple(c.key[:p]) for c in node.children.values()]
        assert len(keys) == len(set(keys))
        for k, c in node.children.items():
            assert c.parent is node and k == tuple(c.key[:p])
    assert tree.total_size() == total
    assert tree.evictable_size() == evictable, (tree.evictable_size(), evictable)
    assert tree.protected_size() == protected, (tree.protected_size(), protected)


def slots(env: Env, n_tokens: int) -> torch.Tensor:
    """Fresh page-aligned slots for a direct insert."""
    s = env.alloc.alloc(n_tokens)
    assert s is not None
    return s


# -- insert / match ---------------------------------------------------------------------------------------


def test_insert_match_split_page1():
    env = Env(1)
    t = env.tree
    v = slots(env, 5)
    assert t.insert([1, 2, 3, 4, 5], v) == 0
    m = t.match_prefix([1, 2, 3, 4, 5, 6])
    assert torch.equal(m.device_indices, v) and m.last_node.key == [1, 2, 3, 4, 5]
    assert t.total_size() == 5 and t.evictable_size() == 5
    m = t.match_prefix([1, 2, 3, 9])  # partial match splits the node
    assert torch.equal(m.device_indices, v[:3])
    assert m.last_node.key == [1, 2, 3] and list(m.last_node.children.values())[0].key == [4, 5]
    assert t.total_size() == 5 and t.evictable_size() == 5
    check_tree(t)
    m = t.match_prefix([7, 8])
    assert m.device_indices.numel() == 0 and m.last_node is t.root
    assert t.match_prefix([]).device_indices.numel() == 0
    # Branch at the split point.
    w = slots(env, 3)
    assert t.insert([1, 2, 3, 7, 8, 9], torch.cat([v[:3], w])) == 3
    assert torch.equal(t.match_prefix([1, 2, 3, 7, 8, 9]).device_indices, torch.cat([v[:3], w]))
    assert torch.equal(t.match_prefix([1, 2, 3, 4, 5]).device_indices, v)
    assert t.total_size() == 8
    check_tree(t)


def test_match_is_page_aligned():
    env = Env(4)
    t = env.tree
    key = list(range(100, 112))
    v = slots(env, 12)
    assert t.insert(key, v) == 0
    for n in range(13):
        m = t.match_prefix(key[:n])
        assert torch.equal(m.device_indices, v[: n // 4 * 4])
    # Diverging inside the third page: only the first two pages match.
    m = t.match_prefix(key[:9] + [0, 0, 0])
    assert torch.equal(m.device_indices, v[:8]) and len(path_key(t, m.last_node)) == 8
    # Diverging inside the first page: nothing.
    m = t.match_prefix([100, 101, 0, 103, 104])
    assert m.device_indices.numel() == 0 and m.last_node is t.root
    assert t.total_size() == 12
    check_tree(t)
    # Every node is whole pages after the splits.
    assert sorted(len(n.key) for n in t._all_nodes() if n is not t.root) == [4, 4, 4]


def test_insert_returns_cached_length_page4():
    env = Env(4)
    t = env.tree
    a = list(range(16))
    va = slots(env, 16)
    assert t.insert(a[:8], va[:8]) == 0
    assert t.insert(a, va) == 8  # extends the cached 8
    dup = slots(env, 12)
    assert t.insert(a[:12], dup) == 12  # all cached: the caller's slots are duplicates
    assert torch.equal(t.match_prefix(a).device_indices, va)  # the tree keeps its own slots
    b = a[:5] + [99] * 7  # diverges inside page 2
    vb = slots(env, 12)
    assert t.insert(b, vb) == 4
    assert torch.equal(t.match_prefix(b).device_indices, torch.cat([va[:4], vb[4:]]))
    assert t.total_size() == 24
    check_tree(t)
    assert t.insert([], torch.empty(0, dtype=torch.int64)) == 0


def test_insert_rejects_unaligned_or_mismatched():
    env = Env(4)
    with pytest.raises(ValueError):
        env.tree.insert([1, 2, 3], slots(env, 4)[:3])
    with pytest.raises(ValueError):
        env.tree.insert([1, 2, 3, 4], slots(env, 8))
    assert env.tree.total_size() == 0


# -- locks and size bookkeeping ----------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 4])
def test_lock_protects_from_evict(p):
    env = Env(p)
    t = env.tree
    a, b = [1] * (3 * p), [1] * (3 * p) + [2] * (2 * p)
    t.insert(b, slots(env, 5 * p))
    c = [3] * (2 * p)
    t.insert(c, slots(env, 2 * p))
    m = t.match_prefix(a)  # splits b's node
    assert len(m.device_indices) == 3 * p
    t.inc_lock_ref(m.last_node)
    assert t.protected_size() == 3 * p and t.evictable_size() == 4 * p
    check_tree(t)
    avail = env.alloc.available_size()
    freed = t.evict(10**6)
    assert freed == 4 * p  # b's tail and c; not the locked prefix
    assert env.alloc.available_size() == avail + 4 * p
    assert t.total_size() == 3 * p and t.evictable_size() == 0 and t.protected_size() == 3 * p
    assert torch.equal(t.match_prefix(b).device_indices, m.device_indices)
    check_tree(t)
    t.inc_lock_ref(m.last_node)  # second lock on the same node
    t.dec_lock_ref(m.last_node)
    assert t.protected_size() == 3 * p and t.evict(10**6) == 0
    t.dec_lock_ref(m.last_node)
    assert t.protected_size() == 0 and t.evictable_size() == 3 * p
    assert t.evict(10**6) == 3 * p
    assert t.total_size() == 0 and env.alloc.available_size() == env.capacity
    with pytest.raises(RuntimeError, match="underflow"):
        t.dec_lock_ref(m.last_node)


def test_lock_root_and_none_are_noops():
    env = Env(1)
    t = env.tree
    t.inc_lock_ref(None)
    t.inc_lock_ref(t.root)
    t.dec_lock_ref(t.root)
    t.dec_lock_ref(None)
    assert t.root.lock_ref == 1 and t.protected_size() == 0 and t.evictable_size() == 0


@pytest.mark.parametrize("p", [1, 4])
def test_split_of_locked_node_keeps_bookkeeping(p):
    env = Env(p)
    t = env.tree
    key = list(range(4 * p))
    t.insert(key, slots(env, 4 * p))
    m = t.match_prefix(key)
    t.inc_lock_ref(m.last_node)
    assert t.protected_size() == 4 * p
    m2 = t.match_prefix(key[: 2 * p] + [-1] * p)  # splits the locked node
    assert m2.last_node is not m.last_node and m.last_node.parent is m2.last_node
    assert m2.last_node.lock_ref == 1 and m.last_node.lock_ref == 1
    assert t.protected_size() == 4 * p and t.evictable_size() == 0
    check_tree(t)
    # Locking the upper half twice, then releasing the original lock, leaves the lower half evictable.
    t.inc_lock_ref(m2.last_node)
    t.dec_lock_ref(m.last_node)
    assert t.protected_size() == 2 * p and t.evictable_size() == 2 * p
    check_tree(t)
    assert t.evict(10**6) == 2 * p
    t.dec_lock_ref(m2.last_node)
    assert t.evictable_size() == 2 * p and t.protected_size() == 0
    check_tree(t)


@pytest.mark.parametrize("p", [1, 4])
def test_evict_lru_order(p):
    env = Env(p)
    t = env.tree
    keys = {name: [i + 1] * (2 * p) for i, name in enumerate("ABCD")}
    vals = {}
    for name, key in keys.items():  # inserted A, B, C, D
        vals[name] = slots(env, len(key))
        t.insert(key, vals[name])
    t.match_prefix(keys["A"])  # A is now the most recently used
    t.match_prefix(keys["C"])  # then C

    def present() -> set[str]:  # without match_prefix, which would refresh access times
        return {n for n in keys if tuple(keys[n][:p]) in t.root.children}

    order = []
    for _ in range(4):
        before = present()
        avail = env.alloc.available_size()
        assert t.evict(1) == 2 * p  # a whole leaf, even when asked for less
        (gone,) = before - present()
        order.append(gone)
        assert env.alloc.available_size() == avail + 2 * p
        assert set(env.alloc.free_pages.tolist()) >= {s // p for s in vals[gone].tolist()}
        check_tree(t)
    assert order == list("BDAC")
    assert t.total_size() == 0 and env.alloc.available_size() == env.capacity


@pytest.mark.parametrize("p", [1, 4])
def test_evict_leaves_first_then_parents(p):
    env = Env(p)
    t = env.tree
    base = [7] * (2 * p)
    x, y = base + [1] * p, base + [2] * p
    t.insert(x, slots(env, 3 * p))
    vy = slots(env, 3 * p)
    assert t.insert(y, vy) == 2 * p
    env.alloc.free(vy[: 2 * p])  # duplicates of the shared prefix
    t.match_prefix(y)  # x's leaf is LRU
    assert t.evict(1) == p
    assert len(t.match_prefix(x).device_indices) == 2 * p
    assert len(t.match_prefix(y).device_indices) == 3 * p
    # Evicting y's leaf makes the shared prefix a leaf, evicted in the same call.
    assert t.evict(2 * p) == 3 * p
    assert t.total_size() == 0 and env.alloc.available_size() == env.capacity
    check_tree(t)


@pytest.mark.parametrize("p", [1, 4])
def test_evict_returns_freed_and_frees_to_allocator(p):
    env = Env(p)
    t = env.tree
    v = {}
    for i in range(3):
        v[i] = slots(env, 2 * p)
        t.insert([i + 1] * (2 * p), v[i])
    assert t.evict(0) == 0
    avail = env.alloc.available_size()
    freed = t.evict(p + 1)  # one leaf (2p tokens) covers it
    assert freed == 2 * p and env.alloc.available_size() == avail + 2 * p
    free = set(env.alloc.free_pages.tolist())
    assert {s // p for s in v[0].tolist()} <= free  # the LRU leaf (first inserted) went back
    assert t.evict(10**6) == 4 * p
    assert env.alloc.available_size() == env.capacity and t.evict(5) == 0


# -- cache_finished_req / cache_unfinished_req ---------------------------------------------------------


@pytest.mark.parametrize("p", [1, 4])
def test_cache_finished_req_unaligned_tail(p):
    env = Env(p)
    req = env.run(list(range(2 * p + 3)))
    assert env.alloc.available_size() == env.capacity - (2 * p + 3 + p - 1) // p * p
    env.check()
    row = env.r2t.req_to_token[req.req_pool_idx, : 2 * p + 3].clone()
    env.finish(req)
    aligned = (2 * p + 3) // p * p
    assert env.tree.total_size() == aligned and env.tree.evictable_size() == aligned
    assert env.r2t.available_size() == env.r2t.size
    m = env.tree.match_prefix(list(range(2 * p + 3)))
    assert torch.equal(m.device_indices, row[:aligned])
    env.check()


@pytest.mark.parametrize("p", [1, 4])
def test_cache_finished_req_frees_duplicates(p):
    env = Env(p)
    prompt = list(range(3 * p + 1))
    a = env.run(prompt)
    b = env.run(prompt)  # admitted before a finished: no cache hit, its own copy
    assert len(b.prefix_indices) == 0
    env.check()
    a_row = env.r2t.req_to_token[a.req_pool_idx, : 3 * p].clone()
    env.finish(a)
    env.check()
    env.finish(b)  # b's aligned pages are duplicates of a's: freed
    env.check()
    al = (3 * p + 1) // p * p
    assert env.tree.total_size() == al
    assert env.alloc.available_size() == env.capacity - al
    assert torch.equal(env.tree.match_prefix(prompt).device_indices[: 3 * p], a_row)


@pytest.mark.parametrize("p", [1, 4])
def test_short_max_prefix_then_finish_frees_recomputed_pages(p):
    """A request may match less than is cached (e.g. input logprobs): the pages it recomputed
    are duplicates when it finishes and go back to the allocator."""
    env = Env(p)
    prompt = list(range(20, 20 + 3 * p + 1))
    env.finish(env.run(prompt))
    cached = env.tree.match_prefix(prompt).device_indices.clone()
    req = env.run(prompt + [1] * p, max_prefix=p)
    assert len(req.prefix_indices) == p
    env.check()
    env.finish(req)
    env.check()
    # The tree keeps its original slots for the shared part, plus req's new aligned pages.
    assert torch.equal(env.tree.match_prefix(prompt).device_indices, cached)
    total = (len(prompt) + p) // p * p
    assert env.tree.total_size() == total
    assert env.alloc.available_size() == env.capacity - total


@pytest.mark.parametrize("p", [1, 4])
def test_two_requests_sharing_prefix(p):
    env = Env(p)
    shared = [5] * (2 * p)
    a = env.run(shared + [1] * (p + 1))
    env.finish(a)
    b = env.run(shared + [2] * (2 * p), max_prefix=None)
    assert len(b.prefix_indices) == 2 * p  # hit on a's shared pages
    assert env.tree.protected_size() == 2 * p
    c = env.run(shared + [1] * (p + 2))
    a_aligned = (3 * p + 1) // p * p
    assert len(c.prefix_indices) == a_aligned  # a's full aligned prompt
    env.check()
    env.finish(b)
    env.check()
    env.finish(c)
    env.check()
    assert env.tree.protected_size() == 0
    # shared (2p) + a's branch + b's branch (2p) + c's part beyond a's aligned prompt
    c_aligned = (3 * p + 2) // p * p
    assert env.tree.total_size() == 2 * p + (a_aligned - 2 * p) + 2 * p + (c_aligned - a_aligned)


@pytest.mark.parametrize("p", [1, 4])
def test_cache_unfinished_req_moves_lock_and_rewrites_req_to_token(p):
    env = Env(p)

    def al(n: int) -> int:
        return n // p * p

    prompt = list(range(50, 50 + 4 * p + 2))
    req = FakeReq(prompt)
    env.admit(req)
    assert env.extend(req, 2 * p + 1)  # first chunk
    avail = env.alloc.available_size()
    env.unfinished(req)
    pre1 = al(2 * p + 1)
    assert env.alloc.available_size() == avail  # nothing freed: the tree took the aligned part
    assert len(req.prefix_indices) == pre1
    assert env.tree.protected_size() == pre1 and env.tree.evictable_size() == 0
    assert path_key(env.tree, req.last_node) == prompt[:pre1]
    assert torch.equal(env.tree.match_prefix(prompt[:pre1]).device_indices,
                       env.r2t.req_to_token[req.req_pool_idx, :pre1])
    env.check()
    assert env.extend(req, 3 * p + 1)  # second chunk continues the unaligned tail page
    env.check()
    # Another request (hitting the first chunk) caches the whole prompt first.
    other = env.run(prompt)
    assert len(other.prefix_indices) == pre1
    env.finish(other)
    other_slots = env.tree.match_prefix(prompt).device_indices
    assert len(other_slots) == al(len(prompt))
    env.check()
    avail = env.alloc.available_size()
    env.unfinished(req)
    pre2 = al(3 * p + 1)
    # req's own page(s) for positions [pre1, pre2) were duplicates: freed; req_to_token now
    # points at the tree's slots there, and the lock moved down to the longer prefix.
    assert env.alloc.available_size() == avail + (pre2 - pre1)
    assert len(req.prefix_indices) == pre2
    assert torch.equal(env.r2t.req_to_token[req.req_pool_idx, :pre2], other_slots[:pre2])
    assert torch.equal(req.prefix_indices, other_slots[:pre2])
    assert env.tree.protected_size() == pre2
    assert path_key(env.tree, req.last_node) == prompt[:pre2]
    env.check()
    assert env.extend(req, len(prompt))
    env.finish(req)
    env.check()
    assert env.tree.total_size() == al(len(prompt))


@pytest.mark.parametrize("p", [1, 4])
def test_cache_unfinished_req_before_any_hit(p):
    env = Env(p)
    req = FakeReq(list(range(3 * p)))
    env.admit(req)
    assert req.last_node is env.tree.root and len(req.prefix_indices) == 0
    assert env.extend(req, p - 1 if p > 1 else 1)
    env.unfinished(req)  # nothing aligned yet (p > 1): lock stays at the root, nothing inserted
    env.check()
    assert env.extend(req, 3 * p)
    env.unfinished(req)
    assert len(req.prefix_indices) == 3 * p and env.tree.protected_size() == 3 * p
    env.check()
    env.finish(req)
    env.check()
    assert env.tree.protected_size() == 0 and env.tree.total_size() == 3 * p


@pytest.mark.parametrize("p", [1, 4])
def test_decode_then_finish_with_real_req(p):
    env = Env(p)
    sp = SamplingParams()
    req = Req("r0", list(range(10, 10 + 2 * p + 1)), sp)
    env.admit(req)
    assert env.extend(req, len(req.origin_input_ids))
    req.output_ids.append(1000)
    for step in range(p + 2):  # decode: the last output gets KV, then a new output is sampled
        s = req.kv_committed_len + 1
        last = int(env.r2t.req_to_token[req.req_pool_idx, s - 2])
        out = env.alloc.alloc_decode([s], [last])
        env.r2t.write(req.req_pool_idx, s - 1, out)
        req.kv_committed_len = s
        req.output_ids.append(1001 + step)
        env.check()
    assert req.kv_committed_len == len(req.kv_token_ids()) - 1
    env.finish(req)
    env.check()
    n = req.kv_committed_len // p * p
    toks = req.kv_token_ids()
    assert len(env.tree.match_prefix(toks).device_indices) == n
    # A follow-up request continuing the conversation hits all of it.
    follow = Req("r1", toks + [7, 7], sp)
    env.admit(follow)
    assert len(follow.prefix_indices) == n
    assert env.extend(follow, len(toks) + 2)
    env.finish(follow)
    env.check()


@pytest.mark.parametrize("p", [1, 4])
def test_finished_req_without_new_kv(p):
    """A request released right after admission (kv_committed_len == prefix)."""
    env = Env(p)
    prompt = list(range(3 * p + 1))
    env.finish(env.run(prompt))
    avail, total = env.alloc.available_size(), env.tree.total_size()
    req = FakeReq(prompt)
    env.admit(req)
    assert len(req.prefix_indices) == 3 * p
    env.finish(req)
    assert (env.alloc.available_size(), env.tree.total_size()) == (avail, total)
    assert env.tree.protected_size() == 0
    env.check()


@pytest.mark.parametrize("p", [1, 4])
def test_reset(p):
    env = Env(p)
    env.finish(env.run(list(range(3 * p))))
    assert env.tree.total_size() == 3 * p
    env.tree.reset()
    env.alloc.clear()
    assert env.tree.total_size() == 0 and env.tree.evictable_size() == 0 and env.tree.protected_size() == 0
    assert env.tree.root.children == {} and env.tree.root.lock_ref == 1
    assert env.tree.match_prefix(list(range(3 * p))).device_indices.numel() == 0
    assert env.tree.all_values().numel() == 0
    env.finish(env.run(list(range(3 * p))))
    env.check()


def test_tree_node_order_tiebreak():
    a, b = TreeNode(), TreeNode()
    a.last_access_time = b.last_access_time = 5.0
    assert (a < b) != (b < a)


# -- randomized ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_workload(p, seed):
    rng = random.Random(seed)
    env = Env(p, num_pages=48, num_reqs=8)
    bases = [[rng.randrange(4) for _ in range(rng.randint(0, 5 * p))] for _ in range(4)]
    chunked: set[int] = set()
    out_tok = itertools.count(100)
    n_done = 0

    def new_prompt() -> list[int]:
        base = rng.choice(bases)
        cut = rng.randint(0, len(base))
        return base[:cut] + [rng.randrange(4) for _ in range(rng.randint(1, 3 * p))]

    for _ in range(400):
        op = rng.random()
        if op < 0.3 and env.r2t.available_size():
            req = FakeReq(new_prompt())
            env.admit(req)
            if rng.random() < 0.4:  # chunked prefill
                target = rng.randint(req.kv_committed_len, len(req.origin_input_ids))
            else:
                target = len(req.origin_input_ids)
            if not env.extend(req, target):
                env.finish(req)  # could not fit: release (no new KV)
                continue
            if target < len(req.origin_input_ids):
                env.unfinished(req)
                chunked.add(id(req))
            else:
                req.output_ids.append(next(out_tok))
        elif op < 0.55 and env.live:
            req = rng.choice(env.live)
            if id(req) in chunked:  # next chunk
                target = rng.randint(req.kv_committed_len, len(req.origin_input_ids))
                if env.extend(req, target):
                    if target < len(req.origin_input_ids):
                        env.unfinished(req)
                    else:
                        chunked.discard(id(req))
                        req.output_ids.append(next(out_tok))
            else:  # decode one token
                if env.extend(req, req.kv_committed_len + 1):
                    req.output_ids.append(next(out_tok))
        elif op < 0.85 and env.live:
            req = rng.choice(env.live)
            chunked.discard(id(req))
            env.finish(req)
            n_done += 1
        else:
            before = env.tree.evictable_size()
            freed = env.tree.evict(rng.randint(1, 4 * p))
            assert freed <= before and env.tree.evictable_size() == before - freed
        env.check()
    for req in list(env.live):
        env.finish(req)
    env.check()
    assert n_done > 20
    assert env.tree.protected_size() == 0
    assert env.alloc.available_size() + env.tree.total_size() == env.capacity
    env.tree.evict(10**9)
    assert env.tree.total_size() == 0 and env.alloc.available_size() == env.capacity
    assert env.r2t.available_size() == env.r2t.size
