"""NSA helpers shared by the indexer, the backends and IndexCache, and the context-parallel split.

NSA prefill context parallel (CP): the page map and the token splits, as pure host functions.

Shared KV under CP: the scheduler (identical on every rank) hands out *logical* KV pages; logical
page L >= 1 is owned by rank `page_owner(L)` and lives in that rank's pool at physical page
`physical_page(L)`. Physical page 0 is the padding page on every rank. A rank stores only the
pages it owns, so a request's KV is spread over the ranks (about 1/cp each).

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

import torch

from sglang.srt.layers.attention.attention_registry import CP_MODES
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.utils.common import get_bool_env

# SGLANG_DEBUG_CHECKS=1 turns on invariant checks that cost a sync or a pass over the data.
DEBUG_CHECKS = get_bool_env("SGLANG_DEBUG_CHECKS")


def debug_checks_active() -> bool:
    """SGLANG_DEBUG_CHECKS, but never inside a CUDA-graph capture (the checks read values back)."""
    return DEBUG_CHECKS and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class StaleTopkError(RuntimeError):
    pass


def assert_topk_matches_batch(topk: torch.Tensor, forward_batch: ForwardBatch, layer_id: int) -> None:
    """A shared IndexCache layer's inherited top-k must belong to this batch's layout: one row per
    token of this forward, every index -1 or a causal position of that token's own request."""
    if topk.dim() != 2 or topk.shape[0] != forward_batch.num_tokens:
        raise StaleTopkError(f"layer {layer_id}: top-k has shape {tuple(topk.shape)} for a batch of "
                             f"{forward_batch.num_tokens} tokens (indices from another batch or layout)")
    bad = (topk >= 0) & (topk.long() > forward_batch.positions[:, None])
    if bool(bad.any()):
        row = int(bad.any(dim=1).nonzero()[0])
        raise StaleTopkError(f"layer {layer_id}: token {row} (position {int(forward_batch.positions[row])}) "
                             f"inherits non-causal top-k {topk[row][bad[row]].tolist()[:4]}")


# -- context parallel: the page map and the splits (pure host functions) ------------------------



def page_owner(page: int, cp_size: int) -> int:
    """The rank that stores logical page `page` (>= 1)."""
    return (page - 1) % cp_size


def physical_page(page: int, cp_size: int) -> int:
    """Logical page -> the page index in its owner's pool (0 stays the padding page)."""
    return 0 if page <= 0 else (page - 1) // cp_size + 1


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


def local_layout(token_ranks: list[list[int]], cp_rank: int, cp_size: int) -> tuple[list[int], list[int], list[int]]:
    """A rank's compute-padded row layout for a batch: request b gets a lane of
    max_r(#tokens of b on r) rows on every rank (at least 1), valid rows first (position order),
    then dummy rows -- so every rank has the same number of rows and communicator shapes match.

    Returns (lanes per request, the global flat token index of each local row (-1 = dummy),
    the local row index of each valid row)."""
    lanes, rows, valid = [], [], []
    offset = 0
    for tr in token_ranks:
        counts = [0] * cp_size
        for r in tr:
            counts[r] += 1
        lane = max(1, max(counts))
        mine = [offset + i for i, r in enumerate(tr) if r == cp_rank]
        valid.extend(range(len(rows), len(rows) + len(mine)))
        rows.extend(mine + [-1] * (lane - len(mine)))
        lanes.append(lane)
        offset += len(tr)
    return lanes, rows, valid
