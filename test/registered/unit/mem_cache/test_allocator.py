"""PagedTokenToKVPoolAllocator: page-consistent slots for alloc/alloc_extend/alloc_decode, page 0
reserved, no slot handed out twice, all-or-nothing when short, checked frees. CPU, fast."""

from __future__ import annotations

import random

import pytest


import torch

from sglang.srt.mem_cache.allocator import (
    KVAllocatorError,
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)

PAGE_SIZES = [1, 16, 64]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def free_page_set(a: PagedTokenToKVPoolAllocator) -> set[int]:
    return set(a.free_pages.tolist())


class Tracker:
    """Mirror of who owns which slots; checks the allocator's invariants after every step."""

    def __init__(self, alloc: PagedTokenToKVPoolAllocator) -> None:
        self.a = alloc
        self.p = alloc.page_size
        self.reqs: dict[int, list[int]] = {}  # req id -> slot of each position

    def extend(self, batch: dict[int, int]) -> torch.Tensor | None:
        """batch: req id -> new seq_len (request's current length is its prefix)."""
        ids = list(batch)
        prefix_lens = [len(self.reqs.get(r, [])) for r in ids]
        seq_lens = [batch[r] for r in ids]
        last_locs = [self.reqs[r][pl - 1] if pl else -1 for r, pl in zip(ids, prefix_lens)]
        before_free = free_page_set(self.a)
        before_avail = self.a.available_size()
        out = self.a.alloc_extend(prefix_lens, seq_lens, last_locs)
        need_pages = sum(cdiv(s, self.p) - cdiv(pl, self.p) for pl, s in zip(prefix_lens, seq_lens))
        if out is None:
            assert need_pages > before_avail // self.p
            assert free_page_set(self.a) == before_free and self.a.available_size() == before_avail
            return None
        assert out.dtype == torch.int64
        assert out.numel() == sum(s - pl for pl, s in zip(prefix_lens, seq_lens))
        assert self.a.available_size() == before_avail - need_pages * self.p
        off = 0
        for r, pl, s in zip(ids, prefix_lens, seq_lens):
            self.reqs.setdefault(r, []).extend(out[off : off + s - pl].tolist())
            off += s - pl
        self.check()
        return out

    def free_req(self, r: int) -> None:
        self.a.free(torch.tensor(self.reqs.pop(r), dtype=torch.int64))
        self.check()

    def check(self) -> None:
        p, a = self.p, self.a
        free = free_page_set(a)
        assert len(free) == len(a.free_pages), "free list holds a page twice"
        assert a.available_size() == len(free) * p
        all_slots: list[int] = []
        owned_pages: set[int] = set()
        for r, slots in self.reqs.items():
            pages_of_req: dict[int, int] = {}
            for pos, slot in enumerate(slots):
                page = slot // p
                # Same page index <-> same page, and the offset within the page is the position's.
                assert slot % p == pos % p, (r, pos, slot)
                if pos // p in pages_of_req:
                    assert pages_of_req[pos // p] == page
                else:
                    assert page not in pages_of_req.values(), "two position-pages on one KV page"
                    pages_of_req[pos // p] = page
            for page in pages_of_req.values():
                assert page not in owned_pages, "a KV page shared by two requests"
                owned_pages.add(page)
            all_slots += slots
        assert len(all_slots) == len(set(all_slots)), "slot handed out twice"
        assert all(1 <= s // p <= a.num_pages for s in all_slots), "page 0 or out-of-range slot"
        assert not (owned_pages & free), "an owned page is on the free list"
        assert 0 not in free
        assert len(owned_pages) + len(free) == a.num_pages, "pages leaked"


# -- construction / clear ---------------------------------------------------------------------------


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_initial_state(p):
    a = PagedTokenToKVPoolAllocator(8 * p, p)
    assert a.num_pages == 8 and a.available_size() == 8 * p
    assert sorted(a.free_pages.tolist()) == list(range(1, 9))


def test_size_not_multiple_of_page_raises():
    with pytest.raises(ValueError):
        PagedTokenToKVPoolAllocator(100, 16)


def test_token_allocator_is_page_size_1():
    a = TokenToKVPoolAllocator(10)
    assert a.page_size == 1 and a.available_size() == 10
    slots = a.alloc(10)
    assert sorted(slots.tolist()) == list(range(1, 11))  # slot 0 is the padding slot
    assert a.alloc(1) is None


# -- alloc ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_alloc_whole_pages(p):
    a = PagedTokenToKVPoolAllocator(4 * p, p)
    s = a.alloc(2 * p)
    assert s.numel() == 2 * p and a.available_size() == 2 * p
    pages = s.view(2, p) // p
    assert (pages == pages[:, :1]).all() and pages[0, 0] != pages[1, 0]
    assert (s.view(2, p) % p == torch.arange(p)).all()
    assert (s // p >= 1).all()
    assert a.alloc(3 * p) is None and a.available_size() == 2 * p
    assert a.alloc(0).numel() == 0 and a.available_size() == 2 * p
    s2 = a.alloc(2 * p)
    assert not set(s.tolist()) & set(s2.tolist())
    assert a.available_size() == 0 and a.alloc(1) is None


@pytest.mark.parametrize("p", [16, 64])
def test_alloc_unaligned_takes_whole_page(p):
    a = PagedTokenToKVPoolAllocator(4 * p, p)
    s = a.alloc(p + 3)
    assert s.numel() == p + 3
    assert a.available_size() == 2 * p
    a.free(s)
    assert a.available_size() == 4 * p


# -- alloc_extend -------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_alloc_extend_mixed_prefix_lens(p):
    a = PagedTokenToKVPoolAllocator(64 * p, p)
    t = Tracker(a)
    # First extends from scratch, various lengths (aligned, not, tiny).
    assert t.extend({0: 3 * p, 1: p + 1, 2: 1, 3: 2 * p - 1, 4: 0}) is not None
    # Second round: every request continues from an aligned or unaligned prefix.
    assert t.extend({0: 4 * p + 2, 1: 3 * p, 2: 2, 3: 2 * p + 5, 4: p + 3}) is not None
    # Third: zero-length extension in a batch, and one staying inside its partial page.
    assert t.extend({0: 4 * p + 2, 1: 3 * p + 1, 2: 2 if p == 1 else 3, 3: 5 * p + 5}) is not None
    for r in list(t.reqs):
        t.free_req(r)
    assert a.available_size() == 64 * p


@pytest.mark.parametrize("p", [16, 64])
def test_alloc_extend_fills_tail_of_last_page_first(p):
    a = PagedTokenToKVPoolAllocator(8 * p, p)
    first = a.alloc_extend([0], [5], [-1])
    assert first.numel() == 5
    page = int(first[0]) // p
    avail = a.available_size()
    # Extending inside the same page takes no new page and continues right after last_loc.
    nxt = a.alloc_extend([5], [9], [int(first[-1])])
    assert nxt.tolist() == list(range(int(first[-1]) + 1, int(first[-1]) + 5))
    assert a.available_size() == avail
    # Crossing the page boundary: the tail of `page` first, then one fresh page.
    last = int(nxt[-1])
    more = a.alloc_extend([9], [p + 4], [last])
    assert more[: p - 9].tolist() == list(range(last + 1, (page + 1) * p))
    assert (more[p - 9 :] // p == more[p - 9] // p).all()
    assert int(more[p - 9]) // p != page and int(more[p - 9]) % p == 0
    assert a.available_size() == avail - p


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_alloc_extend_short_allocates_nothing(p):
    a = PagedTokenToKVPoolAllocator(4 * p, p)
    t = Tracker(a)
    assert t.extend({0: 2 * p + 1}) is not None  # 3 pages used, 1 left
    snapshot = (free_page_set(a), a.available_size())
    # Needs 2 new pages (the first request's tail fits in its page, the second needs 2).
    assert t.extend({0: 3 * p, 1: p + 1}) is None
    assert (free_page_set(a), a.available_size()) == snapshot
    # A fitting batch still works afterwards (request 0 stays inside its partial page).
    assert t.extend({0: 3 * p - 1 if p > 1 else 3, 1: p}) is not None
    assert a.available_size() == 0
    if p > 1:
        # Filling the last partial page needs no new page, so it works on a full pool...
        t.extend({0: 3 * p})
    # ...but any new page does not.
    assert t.extend({1: p + 1}) is None


def test_alloc_extend_empty_batch():
    a = PagedTokenToKVPoolAllocator(64, 16)
    out = a.alloc_extend([], [], [])
    assert out is not None and out.numel() == 0 and a.available_size() == 64


# -- alloc_decode -------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_alloc_decode(p):
    a = PagedTokenToKVPoolAllocator(32 * p, p)
    t = Tracker(a)
    lens = {0: p, 1: p - 1 if p > 1 else 1, 2: 1, 3: 2 * p + 1}
    t.extend(lens)
    for _ in range(p + 2):
        ids = list(t.reqs)
        seq_lens = [len(t.reqs[r]) + 1 for r in ids]
        last_locs = [t.reqs[r][-1] for r in ids]
        avail = a.available_size()
        new_pages = sum((s - 1) % p == 0 for s in seq_lens)
        out = a.alloc_decode(seq_lens, last_locs)
        assert out.numel() == len(ids)
        assert a.available_size() == avail - new_pages * p
        for r, s, slot, last in zip(ids, seq_lens, out.tolist(), last_locs):
            if (s - 1) % p:
                assert slot == last + 1  # same page, next offset
            else:
                assert slot % p == 0
            t.reqs[r].append(slot)
        t.check()
    for r in list(t.reqs):
        t.free_req(r)
    assert a.available_size() == 32 * p


@pytest.mark.parametrize("p", [1, 16])
def test_alloc_decode_short(p):
    a = PagedTokenToKVPoolAllocator(2 * p, p)
    s = a.alloc_extend([0, 0], [p, p], [-1, -1])
    assert a.available_size() == 0
    assert a.alloc_decode([p + 1], [int(s[p - 1])]) is None
    assert a.available_size() == 0


# -- free ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_free_and_realloc(p):
    a = PagedTokenToKVPoolAllocator(4 * p, p)
    s1 = a.alloc(2 * p)
    s2 = a.alloc(2 * p)
    assert a.alloc(1) is None
    a.free(s1)
    assert a.available_size() == 2 * p
    s3 = a.alloc(2 * p)
    assert sorted(s3.tolist()) == sorted(s1.tolist())  # the freed pages come back
    assert not set(s3.tolist()) & set(s2.tolist())
    a.free(torch.cat([s2, s3]))
    assert a.available_size() == 4 * p
    a.free(None)
    a.free(torch.empty(0, dtype=torch.int64))
    assert a.available_size() == 4 * p


@pytest.mark.parametrize("p", [16, 64])
def test_free_one_slot_frees_its_page(p):
    a = PagedTokenToKVPoolAllocator(4 * p, p)
    s = a.alloc(2 * p)
    a.free(s[p + 3 : p + 4])
    assert a.available_size() == 3 * p
    with pytest.raises(KVAllocatorError):
        a.free(s[p:])  # that page is free already


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_double_free_raises_and_changes_nothing(p):
    a = PagedTokenToKVPoolAllocator(4 * p, p)
    s1, s2 = a.alloc(p), a.alloc(p)
    a.free(s1)
    snapshot = (a.free_pages.clone(), a.available_size())
    with pytest.raises(KVAllocatorError, match="double free"):
        a.free(s1)
    with pytest.raises(KVAllocatorError, match="double free"):
        a.free(torch.cat([s2, s1]))  # mixed: one valid, one already free
    assert torch.equal(a.free_pages, snapshot[0]) and a.available_size() == snapshot[1]
    a.free(s2)  # s2 was not freed by the failed call
    assert a.available_size() == 4 * p
    with pytest.raises(KVAllocatorError):
        a.free(s2)


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_double_free_of_never_allocated_page(p):
    a = PagedTokenToKVPoolAllocator(4 * p, p)
    with pytest.raises(KVAllocatorError):
        a.free(torch.tensor([p]))  # page 1, never handed out


@pytest.mark.parametrize("p", PAGE_SIZES)
@pytest.mark.parametrize("bad", ["page0", "beyond", "negative"])
def test_out_of_range_free_raises(p, bad):
    a = PagedTokenToKVPoolAllocator(4 * p, p)
    s = a.alloc(4 * p)
    idx = {"page0": [0], "beyond": [5 * p], "negative": [-1]}[bad]
    with pytest.raises(KVAllocatorError, match="out-of-range"):
        a.free(torch.cat([s[:1], torch.tensor(idx)]))
    assert a.available_size() == 0  # nothing freed by the failed call
    a.free(s)
    assert a.available_size() == 4 * p


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_last_page_slots_are_valid(p):
    a = PagedTokenToKVPoolAllocator(3 * p, p)
    s = a.alloc(3 * p)
    assert int(s.max()) == 4 * p - 1  # pages 1..num_pages: buffers need size + page_size rows
    a.free(s[-1:])
    assert a.available_size() == p


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_clear(p):
    a = PagedTokenToKVPoolAllocator(4 * p, p)
    a.alloc(3 * p)
    a.clear()
    assert a.available_size() == 4 * p
    assert sorted(a.free_pages.tolist()) == [1, 2, 3, 4]
    s = a.alloc(4 * p)
    assert s.numel() == 4 * p and (s // p >= 1).all()
    a.free(s)
    with pytest.raises(KVAllocatorError):
        a.free(s)


# -- randomized -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_randomized_extend_decode_free(p, seed):
    rng = random.Random(seed)
    a = PagedTokenToKVPoolAllocator(40 * p, p)
    t = Tracker(a)
    next_id = 0
    for _ in range(150):
        op = rng.random()
        if op < 0.45:
            batch = {}
            for r in rng.sample(list(t.reqs), k=min(len(t.reqs), rng.randint(0, 3))):
                batch[r] = len(t.reqs[r]) + rng.randint(0, 2 * p + 1)
            for _ in range(rng.randint(0, 2)):
                batch[next_id] = rng.randint(0, 3 * p + 1)
                next_id += 1
            t.extend(batch)
        elif op < 0.75 and t.reqs:
            ids = [r for r in t.reqs if t.reqs[r]]
            if ids:
                before = {r: list(t.reqs[r]) for r in ids}
                out = a.alloc_decode([len(t.reqs[r]) + 1 for r in ids], [t.reqs[r][-1] for r in ids])
                if out is not None:
                    for r, slot in zip(ids, out.tolist()):
                        t.reqs[r].append(slot)
                    t.check()
                else:
                    assert {r: t.reqs[r] for r in ids} == before
        elif t.reqs:
            t.free_req(rng.choice(list(t.reqs)))
    for r in list(t.reqs):
        t.free_req(r)
    assert a.available_size() == 40 * p and len(free_page_set(a)) == 40


@pytest.mark.parametrize("p", [1, 16])
def test_alloc_extend_rejects_shrinking_request(p):
    a = PagedTokenToKVPoolAllocator(8 * p, p)
    s = a.alloc_extend([0], [3 * p], [-1])
    avail = a.available_size()
    # seq_len < prefix_len would mean a negative page count (which used to take most free pages).
    with pytest.raises(ValueError):
        a.alloc_extend([3 * p], [p], [int(s[-1])])
    with pytest.raises(ValueError):
        a.alloc_extend([3 * p, 0], [p, 4 * p], [int(s[-1]), -1])
    with pytest.raises(ValueError):
        a.alloc_extend([0], [1, 2], [-1])
    assert a.available_size() == avail
