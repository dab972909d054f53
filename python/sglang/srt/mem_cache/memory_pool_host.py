"""Host (CPU) mirrors of the device KV pools: HiCache's second tier.

A `HostKVPool` is built from a device pool's `layout()` and stores, per host page, exactly the
page payloads the device pool names (`page_payloads(layer)`): the MLA KV of every layer and, for
NSA pools, the raw index-K-with-scale rows of the index ("full" IndexCache) layers only. Nothing
here recomputes the device layout, so a host copy can never drop a payload the device has
(upstream's NSA host pool once fell back to the MLA one and never backed up the index K).

Host slots are token indices like the device's (slot s lives on host page s // page_size), so a
radix node's host value splits exactly like its device value. One `HostPageAllocator` hands out
host pages for every mirror of a worker: the target's and the draft's (EAGLE) host pools share
the same host slot indices, as the device pools share request -> token slots.

Layouts (`--hicache-mem-layout`): layer_first keeps one [pages, page elems] buffer per layer and
payload; page_first keeps one [pages, layers, page elems] buffer per payload, so a page's layers
are contiguous (what an L3 store wants to read per page). Both expose `payload(layer, name)`, a
[pages, elems] view indexed by host page. Buffers are pinned when CUDA is present.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from sglang.srt.mem_cache.memory_pool import KVCache, KVPoolLayout, PagePayload

HOST_MEM_LAYOUTS = ("layer_first", "page_first")
HOST_HEADROOM_BYTES = 10 * 10**9  # upstream leaves ~10 GB of host RAM free (or 10% of it, if less)


def available_host_bytes() -> int:
    """Free host memory now (psutil when installed, else sysconf)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil ships with the server's deps
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_bytes_per_token(layout: KVPoolLayout) -> int:
    """Host bytes one token costs in a mirror of a pool with this layout."""
    index = len(layout.index_layer_ids) * layout.index_k_bytes_per_page // layout.page_size
    return layout.layer_num * layout.kv_row_bytes + index


def plan_host_tokens(device_tokens: int, layouts: list[KVPoolLayout], ratio: float, size_gb: float,
                     page_size: int, available: int | None = None) -> int:
    """Host tokens for mirrors of `layouts` (target [+ draft]): --hicache-size GB when > 0, else
    --hicache-ratio x device tokens; page-aligned. Raises ServerArgsError (naming the flag that
    set the size) when the mirrors would not fit in free host memory."""
    from sglang.srt.errors import ServerArgsError

    per_token = sum(host_bytes_per_token(lo) for lo in layouts)
    flag = "hicache_size" if size_gb > 0 else "hicache_ratio"
    tokens = int(size_gb * 1e9) // per_token if size_gb > 0 else int(device_tokens * ratio)
    tokens = tokens // page_size * page_size
    if tokens < page_size:
        raise ServerArgsError(flag, f"gives a host pool of {tokens} tokens, less than one page ({page_size})")
    need = tokens * per_token
    free = available_host_bytes() if available is None else available
    headroom = min(HOST_HEADROOM_BYTES, free // 10)  # the rest of the server must still run
    if need > free - headroom:
        raise ServerArgsError(flag, f"host KV pool needs {need / 1e9:.2f} GB ({tokens} tokens x {per_token} B) "
                              f"but only {free / 1e9:.2f} GB of host memory is available, of which "
                              f"{headroom / 1e9:.2f} GB stays free")
    return tokens


class HostPageAllocator:
    """Host pages 0..num_pages-1, as token slots (page p = slots [p * P, (p + 1) * P)). Double and
    out-of-range frees raise: a host page shared by two nodes would corrupt a reload.

    Allocations take the lowest free pages (the free list is re-sorted after frees), so a backup's
    host pages form long runs of consecutive pages: each run is one host<->device copy per layer
    (mem_cache/hicache_io.py), where pages in free order would cost one copy per page."""

    def __init__(self, size: int, page_size: int) -> None:
        if size % page_size:
            raise ValueError(f"host pool size {size} must be a multiple of page_size {page_size}")
        self.size, self.page_size, self.num_pages = size, page_size, size // page_size
        self.clear()

    def clear(self) -> None:
        self.free_pages = list(range(self.num_pages))
        self._sorted = True
        self._is_free = [True] * self.num_pages
        # CP owner of the device page each host page was backed up from: a load-back takes device
        # pages of the same owners, so every rank reloads exactly the pages it backed up.
        self.page_owner = torch.zeros(self.num_pages, dtype=torch.int64)

    def record_owners(self, host_slots: torch.Tensor, owners: torch.Tensor) -> None:
        self.page_owner[host_slots[:: self.page_size] // self.page_size] = owners

    def owners(self, host_slots: torch.Tensor) -> list[int]:
        return self.page_owner[host_slots[:: self.page_size] // self.page_size].tolist()

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """`need_size` (page-aligned) host slots, or None when there are not enough free pages."""
        if need_size % self.page_size:
            raise ValueError(f"host allocations are whole pages: {need_size} % {self.page_size}")
        n = need_size // self.page_size
        if n > len(self.free_pages):
            return None
        if not self._sorted:  # timsort merges the sorted runs that frees appended: about linear
            self.free_pages.sort()
            self._sorted = True
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        for p in pages:
            self._is_free[p] = False
        pages_t = torch.tensor(pages, dtype=torch.int64)
        return (pages_t[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def free(self, slots: torch.Tensor) -> None:
        if slots is None or slots.numel() == 0:
            return
        pages = torch.unique(slots.to(torch.int64) // self.page_size).tolist()
        bad = [p for p in pages if not 0 <= p < self.num_pages]
        if bad:
            raise RuntimeError(f"freeing out-of-range host pages {bad[:8]}")
        dup = [p for p in pages if self._is_free[p]]
        if dup:
            raise RuntimeError(f"double free of host pages {dup[:8]}")
        for p in pages:
            self._is_free[p] = True
        self.free_pages.extend(pages)
        self._sorted = False


class HostKVPool:
    """Host mirror of one device pool (see the module docstring)."""

    def __init__(self, device_pool: KVCache, size: int, layout: str = "layer_first",
                 pin_memory: bool | None = None) -> None:
        if layout not in HOST_MEM_LAYOUTS:
            raise ValueError(f"host layout {layout!r} not in {HOST_MEM_LAYOUTS}")
        self.device_pool = device_pool
        self.layout_info = lo = device_pool.layout()
        if size % lo.page_size:
            raise ValueError(f"host pool size {size} must be a multiple of page_size {lo.page_size}")
        self.size, self.page_size, self.mem_layout = size, lo.page_size, layout
        self.num_pages = size // lo.page_size
        self.layer_num = lo.layer_num
        self.index_layer_ids = tuple(lo.index_layer_ids)
        self.index_layer_map = {lid: j for j, lid in enumerate(self.index_layer_ids)}
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        kv_elems = lo.page_size * lo.kv_cache_dim
        self._kv = self._alloc(lo.layer_num, kv_elems, lo.dtype, pin)
        self._index = (self._alloc(len(self.index_layer_ids), lo.index_k_bytes_per_page, torch.uint8, pin)
                       if self.index_layer_ids else None)

    def _alloc(self, layers: int, elems: int, dtype: torch.dtype, pin: bool):
        if self.mem_layout == "page_first":
            return torch.zeros((self.num_pages, layers, elems), dtype=dtype, pin_memory=pin)
        return [torch.zeros((self.num_pages, elems), dtype=dtype, pin_memory=pin) for _ in range(layers)]

    def _select(self, store, j: int) -> torch.Tensor:
        return store[:, j] if self.mem_layout == "page_first" else store[j]

    def payload_names(self, layer_id: int) -> list[str]:
        """The payloads this layer moves: MLA KV always, index K on index layers only."""
        self._check_layer(layer_id)
        return ["kv", "index_k"] if layer_id in self.index_layer_map else ["kv"]

    def payload(self, layer_id: int, name: str) -> torch.Tensor:
        """[num_pages, per-page elems] view of one layer's payload (row = host page)."""
        self._check_layer(layer_id)
        if name == "kv":
            return self._select(self._kv, layer_id)
        if name == "index_k":
            j = self.index_layer_map.get(layer_id)
            if j is None:
                raise KeyError(f"layer {layer_id} has no index K on the host (index layers: {self.index_layer_ids})")
            return self._select(self._index, j)
        raise KeyError(f"unknown page payload {name!r}")

    def layout(self) -> KVPoolLayout:
        """The device pool's layout with this mirror's page count (what the L3 storage checks)."""
        return dataclasses.replace(self.layout_info, num_pages=self.num_pages)

    def page_payloads(self, layer_id: int) -> list[PagePayload]:
        """Row = host page (the L3 storage reads / writes host pages through these)."""
        return [PagePayload(name, self.payload(layer_id, name)) for name in self.payload_names(layer_id)]

    def _check_layer(self, layer_id: int) -> None:
        if not 0 <= layer_id < self.layer_num:
            raise ValueError(f"layer {layer_id} outside [0, {self.layer_num}) of this host pool")

    def check_device_pool(self, pool: KVCache) -> None:
        """The device pool a transfer targets must have this mirror's layout (index layers included)."""
        lo = pool.layout()
        mine = self.layout_info
        if (lo.layer_num, lo.kv_cache_dim, lo.dtype, lo.page_size, lo.index_k_bytes_per_page, lo.kv_cache_dtype) != \
                (mine.layer_num, mine.kv_cache_dim, mine.dtype, mine.page_size, mine.index_k_bytes_per_page,
                 mine.kv_cache_dtype):
            raise ValueError(f"host pool layout {mine} does not mirror device pool layout {lo}")
        if hasattr(pool, "check_index_layer_ids"):
            pool.check_index_layer_ids(list(self.index_layer_ids), "host pool")

    def get_size_bytes(self) -> int:
        stores = [self._kv] + ([self._index] if self._index is not None else [])
        total = 0
        for s in stores:
            for t in (s if isinstance(s, list) else [s]):
                total += t.numel() * t.element_size()
        return total
