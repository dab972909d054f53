"""Context parallel with shared KV: the logical -> physical page map and the per-request split.
The one copy of these rules: the allocator, the CP attention backend, HiCache under CP and PD
senders import them; none re-derives the arithmetic (test_structure.py checks).

Page map: the scheduler (identical on every rank) hands out *logical* KV pages; logical page
L >= 1 is owned by rank `page_owner(L)` and lives in that rank's pool at physical page
`physical_page(L)`. Physical page 0 is the padding page on every rank (logical page 0 maps to it).
A rank stores only the pages it owns, so a request's KV is spread over the ranks (about 1/cp each).
`page_owner`, `physical_page` and `physical_slots` take an int or a tensor and return the same kind.

Splits (`--nsa-prefill-cp-mode`), per request, over the new tokens [prefix_len, seq_len):
- in-seq-split (zigzag): the new tokens are cut into 2 x cp blocks; rank r computes blocks r and
  2cp - 1 - r, so the causal work is balanced. Under shared KV the cuts fall on page boundaries
  (blocks of whole pages balanced by token count, never "half of the local q"), so every new page
  has exactly one compute owner. With fewer than 2 x cp new pages it falls back to the
  token-balanced split (blocks of tokens), whose pages are then stored by gathering the new KV.
- round-robin-split: token at position p goes to rank p % cp; with pages, page j goes to j % cp
  (the same rule at page granularity); with fewer than cp new pages, the token rule.
A partly filled page of a cached prefix keeps its owner: the new tokens on it go to that rank.
One token (decode, tiny extends) always goes to its page's owner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

CP_MODES = ("in-seq-split", "round-robin-split")  # --nsa-prefill-cp-mode

IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor)


def page_owner(page: IntOrTensor, cp_size: int) -> IntOrTensor:
    """The rank that stores logical page `page` (>= 1; page 0, the padding page, has none)."""
    return (page - 1) % cp_size


def physical_page(page: IntOrTensor, cp_size: int) -> IntOrTensor:
    """Logical page -> the page index in its owner's pool (0 stays the padding page)."""
    if isinstance(page, torch.Tensor):
        return torch.where(page > 0, (page - 1) // cp_size + 1, torch.zeros_like(page))
    return 0 if page <= 0 else (page - 1) // cp_size + 1


def physical_slots(slots: IntOrTensor, page_size: int, cp_size: int) -> IntOrTensor:
    """Logical KV slot -> the slot in the owning rank's pool (same offset within the page)."""
    return physical_page(slots // page_size, cp_size) * page_size + slots % page_size


def new_page_owner(page_index: int, cp_size: int) -> int:
    """Owner of a request's page number `page_index` (position // page_size) when no split says
    otherwise (round-robin pages, decode pages, fallback splits)."""
    return page_index % cp_size


def zigzag_rank(block: int, cp_size: int) -> int:
    """Block k of 2 x cp goes to rank k (first half) or 2cp - 1 - k (second half)."""
    return block if block < cp_size else 2 * cp_size - 1 - block


@dataclass
class RequestSplit:
    token_ranks: list[int]  # rank computing each new token, in position order
    new_page_owners: list[int]  # owner of each page this extend opens, in order
    page_aligned: bool  # every new token is computed by the owner of its page


def split_request(prefix_len: int, extend_len: int, page_size: int, cp_size: int, mode: str,
                  prefix_page_owner: int | None = None) -> RequestSplit:
    """Which rank computes each new token of one request, and who owns the pages it opens.

    `prefix_page_owner`: owner of the page holding position prefix_len - 1, needed when that page
    is partly filled (prefix_len % page_size != 0) and this extend continues it."""
    if mode not in CP_MODES:
        raise ValueError(f"unknown CP mode {mode!r}; choose from {CP_MODES}")
    if extend_len <= 0:
        return RequestSplit([], [], True)
    ps, seq_len = page_size, prefix_len + extend_len
    first_new_page = -(-prefix_len // ps)
    n_new_pages = -(-seq_len // ps) - first_new_page
    cont = prefix_len % ps != 0  # the extend starts inside an existing page
    if cont and prefix_page_owner is None:
        raise ValueError("prefix_page_owner is needed when the extend continues a partly filled page")
    cont_tokens = min(ps - prefix_len % ps, extend_len) if cont else 0

    def owner_of_pos(p: int, new_owners: list[int]) -> int:
        page = p // ps
        if page < first_new_page:
            return prefix_page_owner
        return new_owners[page - first_new_page]

    new_owners = [new_page_owner(first_new_page + j, cp_size) for j in range(n_new_pages)]
    positions = range(prefix_len, seq_len)
    if extend_len == 1 or n_new_pages + (1 if cont else 0) == 1:
        ranks = [owner_of_pos(p, new_owners) for p in positions]  # one page: its owner
    elif mode == "round-robin-split":
        if ps == 1 or n_new_pages >= cp_size:
            ranks = [owner_of_pos(p, new_owners) for p in positions]
        else:
            ranks = [p % cp_size for p in positions]
    elif n_new_pages >= 2 * cp_size:
        # zigzag over whole pages, blocks balanced by token count
        total = extend_len - cont_tokens
        new_owners = []
        for j in range(n_new_pages):
            start = max(0, (first_new_page + j) * ps - prefix_len - cont_tokens)
            new_owners.append(zigzag_rank(min(2 * cp_size - 1, start * 2 * cp_size // total), cp_size))
        ranks = [owner_of_pos(p, new_owners) for p in positions]
    else:
        # token-balanced zigzag fallback: 2cp blocks of (near) equal token counts
        nb = 2 * cp_size
        ranks = [zigzag_rank(i * nb // extend_len, cp_size) for i in range(extend_len)]
    aligned = all(r == owner_of_pos(p, new_owners) for r, p in zip(ranks, positions))
    return RequestSplit(ranks, new_owners, aligned)
