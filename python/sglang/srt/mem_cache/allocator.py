"""Paged KV slot allocator.

Slot `i` lives on page `i // page_size`. Page 0 is reserved: padded tokens write there, so
no real request's KV can be clobbered by padding. With page_size == 1 a page is a slot.

Rules (checked, never silently ignored): a page is handed out at most once until freed; freeing
a page that is already free is an error (it would let two requests share KV).
"""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.cp_page_map import new_page_owner, page_owner, split_request
from sglang.srt.utils.common import cdiv


class KVAllocatorError(RuntimeError):
    pass


class PagedTokenToKVPoolAllocator:
    """KV slots by whole pages. Every slot tensor it returns is on the host (int64): the scheduler's
    bookkeeping reads slots every step (req_to_token's host mirror, the prefix cache, frees), and the
    step's one pinned upload (ForwardBatch.build) carries them to the device -- a device result
    would cost an upload here and a read-back sync there."""

    def __init__(self, size: int, page_size: int, device: str = "cpu") -> None:
        if size % page_size:
            raise ValueError(f"KV pool size {size} must be a multiple of page_size {page_size}")
        self.size, self.page_size, self.device = size, page_size, device
        self.num_pages = size // page_size
        self.clear()

    # -- bookkeeping -------------------------------------------------------------------------
    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self._is_free = torch.ones(self.num_pages + 1, dtype=torch.bool)
        self._is_free[0] = False

    def available_size(self) -> int:
        """Free capacity in tokens (whole free pages only)."""
        return len(self.free_pages) * self.page_size

    def _take_pages(self, n: int) -> torch.Tensor | None:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        self._is_free[pages] = False
        return pages

    def free(self, indices: torch.Tensor) -> None:
        """Free the pages holding `indices` (token slots). Callers free whole pages only."""
        if indices is None or indices.numel() == 0:
            return
        pages = torch.unique(indices.to("cpu", torch.int64) // self.page_size)
        if bool((pages <= 0).any()) or bool((pages > self.num_pages).any()):
            raise KVAllocatorError(f"freeing out-of-range KV pages {pages[(pages <= 0) | (pages > self.num_pages)].tolist()[:8]}")
        if bool(self._is_free[pages].any()):
            raise KVAllocatorError(f"double free of KV pages {pages[self._is_free[pages]].tolist()[:8]}")
        self._is_free[pages] = True
        self.free_pages = torch.cat([self.free_pages, pages])

    # -- allocation ----------------------------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """`need_size` fresh slots on whole pages (used with page_size 1, or page-aligned needs)."""
        pages = self._take_pages(cdiv(need_size, self.page_size))
        if pages is None:
            return None
        slots = (pages[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)
        return slots[:need_size]

    def alloc_extend(
        self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]
    ) -> torch.Tensor | None:
        """Slots for positions [prefix_len, seq_len) of each request, concatenated.

        A request's tokens first fill the free tail of its last partially used page (the one
        holding `last_loc`, the slot of position prefix_len - 1), then take new pages.
        Returns None (and allocates nothing) when there are not enough free pages.
        """
        p = self.page_size
        self._check_extend(prefix_lens, seq_lens, last_locs)
        need = sum(cdiv(s, p) - cdiv(pl, p) for pl, s in zip(prefix_lens, seq_lens))
        pages = self._take_pages(need)
        return None if pages is None else self._extend_slots(prefix_lens, seq_lens, last_locs, pages)

    @staticmethod
    def _check_extend(prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]) -> None:
        if len(prefix_lens) != len(seq_lens) or len(seq_lens) != len(last_locs):
            raise ValueError("alloc_extend needs one prefix_len, seq_len and last_loc per request")
        if any(s < pl or pl < 0 for pl, s in zip(prefix_lens, seq_lens)):
            # A negative page count would make _take_pages hand out (almost) all free pages.
            raise ValueError(f"alloc_extend needs 0 <= prefix_len <= seq_len, got {list(zip(prefix_lens, seq_lens))[:8]}")

    def _extend_slots(self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int],
                      pages: torch.Tensor) -> torch.Tensor:
        """The slots of each request's new tokens: the tail of its last page, then `pages` in order."""
        p = self.page_size
        out, cursor = [], 0
        ar = torch.arange(p)
        for pl, s, last in zip(prefix_lens, seq_lens, last_locs):
            parts = []
            if pl % p and s > pl:
                tail = min(p - pl % p, s - pl)
                parts.append(torch.arange(last + 1, last + 1 + tail))
            n_new = cdiv(s, p) - cdiv(pl, p)
            if n_new:
                new = (pages[cursor : cursor + n_new, None] * p + ar).reshape(-1)
                cursor += n_new
                covered = sum(len(x) for x in parts)
                parts.append(new[: s - pl - covered])
            out.append(torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64))
        return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)

    def alloc_decode(self, seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        """One slot per request for position seq_len - 1 (seq_lens include the new token): the slot
        after last_loc on its page, or the first slot of a fresh page. Same result as alloc_extend
        for one token each, without per-request tensors (this runs every decode step)."""
        if len(seq_lens) != len(last_locs):
            raise ValueError("alloc_decode needs one seq_len and last_loc per request")
        if any(s < 1 for s in seq_lens):
            raise ValueError(f"alloc_decode needs seq_len >= 1, got {seq_lens[:8]}")
        p = self.page_size
        fresh = [(s - 1) % p == 0 for s in seq_lens]
        pages = self._take_pages(sum(fresh))
        if pages is None:
            return None
        it = iter(pages.tolist())
        out = [next(it) * p if f else last + 1 for f, last in zip(fresh, last_locs)]
        return torch.tensor(out, dtype=torch.int64)


def TokenToKVPoolAllocator(size: int, device: str = "cpu") -> PagedTokenToKVPoolAllocator:
    return PagedTokenToKVPoolAllocator(size, 1, device)


class CPPagedTokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """Logical KV pages for context parallel with shared KV (the page map: mem_cache.cp_page_map).

    The scheduler is identical on every CP rank, so this allocator is too: it hands out logical
    pages whose owner (`page_owner`) is the rank the CP split assigns to compute them, so a page
    is written by the rank that stores it. One free list per owner; an allocation that one owner
    cannot serve fails as a whole (the scheduler then evicts or waits, as for a full pool)."""

    def __init__(self, size: int, page_size: int, cp_size: int, cp_mode: str, device: str = "cpu") -> None:
        self.cp_size, self.cp_mode = cp_size, cp_mode
        pages = size // page_size // cp_size * cp_size  # every owner gets the same number of pages
        if pages < cp_size:
            raise ValueError(f"KV pool of {size} tokens is too small for {cp_size} CP ranks of page {page_size}")
        super().__init__(pages * page_size, page_size, device)

    def clear(self) -> None:
        super().clear()
        owners = page_owner(torch.arange(1, self.num_pages + 1), self.cp_size)
        self.free_by_owner = [self.free_pages[owners == o] for o in range(self.cp_size)]

    def available_size(self) -> int:
        return sum(len(f) for f in self.free_by_owner) * self.page_size

    def owned_pages(self) -> list[int]:
        """Pages in use per owner (what each rank stores)."""
        per = self.num_pages // self.cp_size
        return [per - len(f) for f in self.free_by_owner]

    def _take_owned(self, owners: list[int]) -> torch.Tensor | None:
        need = [0] * self.cp_size
        for o in owners:
            need[o] += 1
        if any(n > len(f) for n, f in zip(need, self.free_by_owner)):
            return None
        taken = []
        for o in range(self.cp_size):
            taken.append(self.free_by_owner[o][: need[o]])
            self.free_by_owner[o] = self.free_by_owner[o][need[o] :]
        cursor = [0] * self.cp_size
        out = []
        for o in owners:
            out.append(int(taken[o][cursor[o]]))
            cursor[o] += 1
        pages = torch.tensor(out, dtype=torch.int64)
        self._is_free[pages] = False
        return pages

    def _take_pages(self, n: int) -> torch.Tensor | None:
        raise NotImplementedError("CP pages are taken per owner (alloc_extend / alloc_decode)")

    def alloc_owned_pages(self, owners: list[int]) -> torch.Tensor | None:
        """Slots of fresh pages with the given owners, in order (HiCache load-back: the pages keep
        the owners they were backed up from); None when an owner has too few free pages."""
        pages = self._take_owned(owners)
        if pages is None:
            return None
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def free(self, indices: torch.Tensor) -> None:
        if indices is None or indices.numel() == 0:
            return
        before = self._is_free.clone()
        super().free(indices)  # checks, marks free, appends to free_pages (unused here)
        pages = torch.nonzero(self._is_free & ~before).flatten()  # host bookkeeping, not the forward
        owners = page_owner(pages, self.cp_size)
        for o in range(self.cp_size):
            mine = pages[owners == o]
            if len(mine):
                self.free_by_owner[o] = torch.cat([self.free_by_owner[o], mine])
        self.free_pages = self.free_pages[:0]

    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self.alloc_extend([0], [need_size], [-1])

    def alloc_extend(self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        p = self.page_size
        self._check_extend(prefix_lens, seq_lens, last_locs)
        owners = []
        for pl, s, last in zip(prefix_lens, seq_lens, last_locs):
            prev = page_owner(last // p, self.cp_size) if pl % p and s > pl else None
            owners += split_request(pl, s - pl, p, self.cp_size, self.cp_mode, prev).new_page_owners
        pages = self._take_owned(owners)
        return None if pages is None else self._extend_slots(prefix_lens, seq_lens, last_locs, pages)

    def alloc_decode(self, seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        if len(seq_lens) != len(last_locs):
            raise ValueError("alloc_decode needs one seq_len and last_loc per request")
        p = self.page_size
        fresh = [(s - 1) % p == 0 for s in seq_lens]
        pages = self._take_owned([new_page_owner((s - 1) // p, self.cp_size) for s, f in zip(seq_lens, fresh) if f])
        if pages is None:
            return None
        it = iter(pages.tolist())
        out = [next(it) * p if f else last + 1 for f, last in zip(fresh, last_locs)]
        return torch.tensor(out, dtype=torch.int64)


def make_token_allocator(size: int, page_size: int, cp_size: int = 1, cp_mode: str = "round-robin-split",
                         device: str = "cpu") -> PagedTokenToKVPoolAllocator:
    """The allocator of a pool of `size` logical tokens: under context parallel (`cp_size` > 1) the
    CP-owned pages, as host slots (the CP split re-lays them out on the host before the upload)."""
    if cp_size > 1:
        return CPPagedTokenToKVPoolAllocator(size, page_size, cp_size, cp_mode, "cpu")
    return PagedTokenToKVPoolAllocator(size, page_size, device)
