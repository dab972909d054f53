"""What PD moves: every pool's page payloads, described once for the handshake and the copy list.

A server's KV is one or two pools (the target's; the draft's with speculative decoding). Each layer
of each pool has page payloads (`KVCache.page_payloads`): MLA KV, plus index K on full IndexCache
layers only -- the logical layer -> index buffer map is the pool's, never recomputed here. Both
sides describe their pools the same way; the receiver's description travels in `Register` and the
sender refuses any difference (layer ids, shapes, dtypes, page size) before a byte moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.mem_cache.cp_page_map import page_owner, physical_page
from sglang.srt.mem_cache.memory_pool import KVCache


@dataclass(frozen=True)
class BufferMeta:
    pool: str  # "target" / "draft"
    layer_id: int
    name: str  # "kv" / "index_k"
    row_bytes: int  # bytes of one page of this payload


@dataclass(frozen=True)
class PoolsMeta:
    """The layout both sides must agree on (no addresses, no capacities)."""

    page_size: int
    pools: tuple[tuple[str, int, int, str, int, tuple[int, ...]], ...]  # name, layers, dim, dtype, kv row, index ids
    buffers: tuple[BufferMeta, ...]


@dataclass
class PoolsDesc:
    meta: PoolsMeta
    ptrs: list[int]  # base address of each buffer (row p = page p), aligned with meta.buffers
    tensors: list[torch.Tensor]  # the local buffers (kept for registration and tests)


def describe_pools(pools: dict[str, KVCache]) -> PoolsDesc:
    """Describe `{"target": pool, "draft": pool?}` for transfer."""
    metas, bufs, pool_meta, page_size = [], [], [], None
    for name, pool in pools.items():
        lay = pool.layout()
        page_size = lay.page_size if page_size is None else page_size
        pool_meta.append((name, lay.layer_num, lay.kv_cache_dim, str(lay.dtype), lay.kv_row_bytes,
                          tuple(lay.index_layer_ids)))
        for layer in range(lay.layer_num):
            for p in pool.page_payloads(layer):
                if not p.buffer.is_contiguous():
                    raise ValueError(f"{name} layer {layer} {p.name}: page payload must be contiguous to transfer")
                metas.append(BufferMeta(name, layer, p.name, p.buffer.shape[1] * p.buffer.element_size()))
                bufs.append(p.buffer)
    meta = PoolsMeta(page_size, tuple(pool_meta), tuple(metas))
    return PoolsDesc(meta, [b.data_ptr() for b in bufs], bufs)


def layout_mismatch(local: PoolsMeta, remote: PoolsMeta, local_name: str = "prefill",
                    remote_name: str = "decode") -> str | None:
    """A clear message naming the first difference, or None when the layouts match."""
    if local.page_size != remote.page_size:
        return f"page size mismatch: {local_name} --page-size {local.page_size}, {remote_name} {remote.page_size}"
    lp, rp = {p[0]: p for p in local.pools}, {p[0]: p for p in remote.pools}
    if set(lp) != set(rp):
        return (f"KV pools mismatch: {local_name} has {sorted(lp)}, {remote_name} has {sorted(rp)} "
                "(--speculative-algorithm must match on both servers)")
    fields = ("layer count", "kv_cache_dim", "dtype", "MLA row bytes", "index-K layer ids")
    for name in lp:
        for i, what in enumerate(fields, start=1):
            if lp[name][i] != rp[name][i]:
                return (f"{name} pool layout mismatch ({what}): {local_name} {lp[name][i]}, {remote_name} "
                        f"{rp[name][i]}")
    if local.buffers != remote.buffers:
        diff = next((a, b) for a, b in zip(local.buffers, remote.buffers) if a != b) \
            if len(local.buffers) == len(remote.buffers) else (len(local.buffers), len(remote.buffers))
        return f"page payload layout mismatch: {local_name} {diff[0]}, {remote_name} {diff[1]}"
    return None


def request_pages(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """The logical pages of a request's first len(slots) positions, in position order."""
    return slots[::page_size] // page_size


def rank_pages(logical: torch.Tensor, dst: torch.Tensor, rank: int, cp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(physical source pages on `rank`, destination pages) of the pages `rank` owns: a CP rank
    sends only its own pages (cp_page_map), so no rank materialises the full KV."""
    if cp_size == 1:
        return logical, dst
    mine = page_owner(logical, cp_size) == rank
    return physical_page(logical[mine], cp_size), dst[mine]


def copy_ops(src: PoolsDesc, dst_ptrs: list[int], src_pages: torch.Tensor,
             dst_pages: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """(src addresses, dst addresses, lengths) moving `src_pages` -> `dst_pages` of every buffer,
    consecutive page runs merged into one range each."""
    if len(src_pages) == 0:
        return [], [], []
    s, d = src_pages.to(torch.int64), dst_pages.to(torch.int64)
    brk = torch.ones(len(s), dtype=torch.bool)
    brk[1:] = (s[1:] != s[:-1] + 1) | (d[1:] != d[:-1] + 1)
    starts = torch.nonzero(brk).flatten()
    lens = torch.diff(torch.cat([starts, torch.tensor([len(s)])]))
    rs, rd, rl = s[starts].tolist(), d[starts].tolist(), lens.tolist()
    srcs, dsts, ns = [], [], []
    for meta, sp, dp in zip(src.meta.buffers, src.ptrs, dst_ptrs):
        row = meta.row_bytes
        srcs += [sp + a * row for a in rs]
        dsts += [dp + b * row for b in rd]
        ns += [n * row for n in rl]
    return srcs, dsts, ns


def bytes_per_page(meta: PoolsMeta) -> int:
    """Bytes one logical page moves over all pools, layers and payloads."""
    return sum(b.row_bytes for b in meta.buffers)
