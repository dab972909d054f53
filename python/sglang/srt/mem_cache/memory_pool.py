"""Device memory pools: request -> token slot map, and the MLA / NSA KV buffers.

Layouts (per layer):
- MLA: `kv_buffer[layer]` of [size + page_size, 1, kv_lora_rank + qk_rope_head_dim] in the model
  dtype (latent then rope part, as upstream SGLang stores it); page p is rows [p * P, (p + 1) * P).
  With `kv_cache_dtype="fp8_e4m3"` the buffer is uint8 [size + page_size, 1, row_bytes] in DeepSeek's
  FP8 row format (mem_cache/kv_fp8_format.py: e4m3 latent, fp32 per-128 scales, bf16 rope; 656 B
  for V3.2); `kv_cache_dim` is then the row's byte count (the storage elements per token), so
  page moves stay raw bytes and `get_mla_kv` dequantises.
- NSA index K: `index_k_with_scale_buffer[buffer]` of uint8 [num_pages + 1, page_size * bytes/token]:
  a page holds its tokens' K data first (FP8: D bytes/token; exact modes: D * itemsize), then, for
  FP8 only, the tokens' fp32 scales (one per 128 values). With D = 128 and FP8 this is upstream's
  [num_pages, page_size * (128 + 4)], so HiCache and transfers can move index K page by page.
Slot 0..page_size-1 (page 0) is the padding page: padded tokens write there.

What other parts need to know about the layout they ask the pool (`layout()`, `page_payloads()`),
never recompute: HiCache host mirrors and PD transfers move exactly a layer's page payloads.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch

from sglang.srt.mem_cache import kv_fp8_format
from sglang.srt.mem_cache.index_k_format import (
    INDEX_K_DTYPES,
    dequantize_fp8_per_block,
    num_scale_blocks,
    quantize_fp8_per_block,
)
from sglang.srt.utils.common import upload


class ReqToTokenPool:
    """Maps (request slot, position) -> KV slot index.

    The scheduler reads and writes a host mirror (`req_to_token_cpu`), so it never reads the
    device; writes are queued and applied to the device table (`req_to_token`, read by the
    attention kernels) in one upload per step by `flush_writes()`. On a CPU device both are the
    same tensor. Row `padding_slot` (one past the last request slot) stays all zeros: CUDA-graph
    padding rows point there, i.e. at the padding page.
    """

    def __init__(self, size: int, max_context_len: int, device: str = "cpu") -> None:
        self.size, self.max_context_len, self.device = size, max_context_len, device
        self.padding_slot = size
        shape = (size + 1, max_context_len)
        self.req_to_token = torch.zeros(shape, dtype=torch.int32, device=device)
        on_host = torch.device(device).type == "cpu"
        self.req_to_token_cpu = self.req_to_token if on_host else torch.zeros(shape, dtype=torch.int32)
        self._pending: list[tuple[int, int, torch.Tensor]] = []
        self._pending_tokens: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.free_slots = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int) -> list[int] | None:
        if need_size > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return out

    def free(self, idx: int | list[int]) -> None:
        idxs = [idx] if isinstance(idx, int) else list(idx)
        if len(set(idxs)) != len(idxs):
            raise RuntimeError(f"double free of request slots {sorted(i for i in set(idxs) if idxs.count(i) > 1)}")
        if any(not 0 <= i < self.size for i in idxs):
            raise RuntimeError(f"freeing out-of-range request slots {[i for i in idxs if not 0 <= i < self.size]}")
        if set(idxs) & set(self.free_slots):
            raise RuntimeError(f"double free of request slots {sorted(set(idxs) & set(self.free_slots))}")
        self.free_slots.extend(idxs)

    def write(self, req_idx: int, start: int, values: torch.Tensor) -> None:
        values = values.to("cpu", torch.int32).reshape(-1)
        self.req_to_token_cpu[req_idx, start : start + values.numel()] = values
        if self.req_to_token is not self.req_to_token_cpu and values.numel():
            self._pending.append((req_idx, start, values))

    def write_tokens(self, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor) -> None:
        """Scattered writes req_to_token[rows[i], cols[i]] = values[i] (one batch of new tokens)."""
        rows, cols, values = rows.to(torch.int64), cols.to(torch.int64), values.to("cpu", torch.int32)
        self.req_to_token_cpu[rows, cols] = values
        if self.req_to_token is not self.req_to_token_cpu and values.numel():
            self._pending_tokens.append((rows, cols, values))

    def last_locs(self, req_idx: list[int], lens: list[int]) -> list[int]:
        """last_loc for many requests in one host gather."""
        if not req_idx:
            return []
        cols = torch.tensor(lens, dtype=torch.int64) - 1
        got = self.req_to_token_cpu[torch.tensor(req_idx), cols.clamp(min=0)]
        return torch.where(cols >= 0, got, -1).tolist()

    def read(self, req_idx: int, n: int) -> torch.Tensor:
        """The first n KV slots of a request (int64, host)."""
        return self.req_to_token_cpu[req_idx, :n].to(torch.int64)

    def last_loc(self, req_idx: int, n: int) -> int:
        """KV slot of position n - 1 (-1 when n == 0), from the host mirror."""
        return int(self.req_to_token_cpu[req_idx, n - 1]) if n > 0 else -1

    def flush_writes(self) -> None:
        """Apply queued writes to the device table: one pinned upload + one scatter."""
        if not self._pending and not self._pending_tokens:
            return
        parts = [(torch.full((v.numel(),), r, dtype=torch.int32), torch.arange(s, s + v.numel(), dtype=torch.int32), v)
                 for r, s, v in self._pending] + self._pending_tokens
        rows = torch.cat([r.to(torch.int32) for r, _, _ in parts])
        cols = torch.cat([c.to(torch.int32) for _, c, _ in parts])
        vals = torch.cat([v for _, _, v in parts])
        self._pending.clear()
        self._pending_tokens.clear()
        packed = torch.stack([rows, cols, vals])
        dev = upload(packed, self.req_to_token.device).long()
        self.req_to_token[dev[0], dev[1]] = dev[2].to(torch.int32)

    def clear(self) -> None:
        self.free_slots = list(range(self.size))


class LayerTransferCounter(Protocol):
    """HiCache's layer-wise load progress: `wait_until(layer_id)` returns once that layer's KV
    (MLA and index K) is on the device."""

    def wait_until(self, layer_id: int) -> None: ...


@dataclass(frozen=True)
class KVPoolLayout:
    """What a KV pool stores, for the parts that mirror or move it (HiCache, PD, KV trace)."""

    layer_num: int
    kv_cache_dim: int  # storage elements of `dtype` per token row: kv_lora_rank + rope, or FP8 row bytes
    dtype: torch.dtype  # storage dtype of the MLA KV (uint8 for the FP8 format)
    page_size: int
    num_pages: int  # usable pages (page 0, the padding page, not counted)
    kv_row_bytes: int  # MLA KV bytes of one token in one layer
    index_k_bytes_per_page: int  # index K (+ FP8 scales) bytes of one page in one layer; 0 for MLA
    index_layer_ids: tuple[int, ...]  # layers holding index K (IndexCache "full" layers); () for MLA
    kv_cache_dtype: str = "auto"  # "fp8_e4m3": rows in kv_fp8_format's layout (a mirror must match)

    @property
    def kv_bytes_per_page(self) -> int:
        return self.kv_row_bytes * self.page_size


@dataclass(frozen=True)
class PagePayload:
    """One page-granular buffer of a layer: `buffer` is a [num_pages + 1, per-page] view of the
    pool's storage (row p = page p), so `buffer[pages]` reads and `buffer[pages] = x` writes them."""

    name: str  # "kv" (MLA latent + rope), "index_k" (DSA indexer K + scales, raw bytes)
    buffer: torch.Tensor


class KVCache(ABC):
    """Base of the device KV pools.

    Rule: every accessor of a layer's buffers calls `_wait_layer(layer_id)` first, the getters of
    the raw buffers handed to kernels included. That single hook is where a layer-wise host load
    (HiCache) blocks until the layer has arrived; an accessor that skips it reads stale KV (upstream
    forgot it for the index K and shipped garbled output). Tests enumerate the accessors and check.

    Layer-end hooks: the model calls `on_layer_end(layer_id)` on the pool of its forward batch
    (the rank's own pool under CP, the draft pool for the NextN layer) once after every layer has
    written its KV. Callbacks (`register_layer_end_callback`, run in registration order) may
    enqueue device work (e.g. a host backup of the layer on a side stream), never sync the host.
    They see exactly the eager forwards: a CUDA graph is captured under
    `suspend_layer_end_hooks()`, so a replayed step runs no hook (what needs graph steps must be
    driven from outside the graph). With no callback registered the call costs one attribute test.
    """

    layer_transfer_counter: LayerTransferCounter | None = None
    _layer_end_callbacks: tuple[Callable[[int], None], ...] = ()
    _layer_end_suspended: int = 0

    def register_layer_transfer_counter(self, counter: LayerTransferCounter | None) -> None:
        self.layer_transfer_counter = counter

    def _wait_layer(self, layer_id: int) -> None:
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id)

    # -- lifecycle hooks --------------------------------------------------------------------------
    def register_layer_end_callback(self, cb: Callable[[int], None]) -> None:
        self._layer_end_callbacks = (*self._layer_end_callbacks, cb)

    def on_layer_end(self, layer_id: int) -> None:
        """Layer `layer_id`'s KV is written (queued on the device): run the layer-end callbacks."""
        if self._layer_end_callbacks and not self._layer_end_suspended:
            for cb in self._layer_end_callbacks:
                cb(layer_id)

    @contextlib.contextmanager
    def suspend_layer_end_hooks(self) -> Iterator[None]:
        """`on_layer_end` calls nothing inside (CUDA-graph capture); nests."""
        self._layer_end_suspended += 1
        try:
            yield
        finally:
            self._layer_end_suspended -= 1

    # -- layout ----------------------------------------------------------------------------------
    @abstractmethod
    def layout(self) -> KVPoolLayout: ...

    @abstractmethod
    def page_payloads(self, layer_id: int) -> list[PagePayload]:
        """The layer's page-granular buffers (waits for the layer like every accessor)."""

    @abstractmethod
    def get_key_buffer(self, layer_id: int) -> torch.Tensor: ...

    @abstractmethod
    def get_kv_pages(self, layer_id: int, pages: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def set_kv_pages(self, layer_id: int, pages: torch.Tensor, data: torch.Tensor) -> None: ...

    @abstractmethod
    def kv_bytes_per_token(self) -> int: ...

    @abstractmethod
    def get_kv_size_bytes(self) -> int: ...


class MLATokenToKVPool(KVCache):
    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str = "cpu",
        kv_cache_dtype: str = "auto",
    ) -> None:
        if size % page_size:
            raise ValueError(f"KV pool size {size} must be a multiple of page_size {page_size}")
        if kv_cache_dtype not in kv_fp8_format.KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} not in {kv_fp8_format.KV_CACHE_DTYPES}")
        self.size, self.page_size, self.dtype, self.device = size, page_size, dtype, device
        self.kv_lora_rank, self.qk_rope_head_dim, self.layer_num = kv_lora_rank, qk_rope_head_dim, layer_num
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_fp8 = kv_cache_dtype == "fp8_e4m3"  # the MLA KV rows (the index K has its own: index_k_fp8)
        if self.kv_fp8:
            kv_fp8_format.check_dims(kv_lora_rank, qk_rope_head_dim)
            self.store_dtype = torch.uint8
            self.kv_cache_dim = kv_fp8_format.row_bytes(kv_lora_rank, qk_rope_head_dim)
        else:
            self.store_dtype = dtype
            self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.kv_buffer = [
            torch.zeros((size + page_size, 1, self.kv_cache_dim), dtype=self.store_dtype, device=device)
            for _ in range(layer_num)
        ]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """The layer's whole [slots, 1, kv_cache_dim] buffer (what kernels read; uint8 FP8 rows if kv_fp8)."""
        self._wait_layer(layer_id)
        return self.kv_buffer[layer_id]

    def get_kv_store_buffer(self, layer_id: int) -> torch.Tensor:
        """The layer's [slots, 1, dim] buffer for a fused store kernel to write new tokens into
        (sgl_kernel.kv_store.store_mla_kv; `set_mla_kv_buffer` is its torch twin)."""
        self._wait_layer(layer_id)
        return self.kv_buffer[layer_id]

    def set_mla_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        buf = self.kv_buffer[layer_id]
        if self.kv_fp8:
            buf[loc, 0] = kv_fp8_format.pack(latent, k_rope).to(buf.device)
            return
        buf[loc, 0, : self.kv_lora_rank] = latent.to(self.dtype)
        buf[loc, 0, self.kv_lora_rank :] = k_rope.to(self.dtype)

    def get_mla_kv(self, layer_id: int, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(latent [..., kv_lora_rank], k_rope [..., rope]) for slots `loc` of any shape, in the model
        dtype (dequantised from the FP8 rows if kv_fp8)."""
        kv = self.get_key_buffer(layer_id)[loc, 0]
        if self.kv_fp8:
            return kv_fp8_format.dequantize(kv, self.kv_lora_rank, self.qk_rope_head_dim, self.dtype)
        return kv[..., : self.kv_lora_rank], kv[..., self.kv_lora_rank :]

    # -- page-level moves (HiCache backup/load, PD transfer) --------------------------------------
    def _paged(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id].view(-1, self.page_size, self.kv_cache_dim)

    def get_kv_pages(self, layer_id: int, pages: torch.Tensor) -> torch.Tensor:
        """MLA KV of whole pages: [n, page_size, kv_cache_dim] (raw uint8 rows if kv_fp8)."""
        self._wait_layer(layer_id)
        return self._paged(layer_id)[pages]

    def set_kv_pages(self, layer_id: int, pages: torch.Tensor, data: torch.Tensor) -> None:
        expect = (len(pages), self.page_size, self.kv_cache_dim)
        if tuple(data.shape) != expect:
            raise ValueError(f"layer {layer_id}: MLA pages must be {expect}, got {tuple(data.shape)}")
        if self.kv_fp8 and data.dtype != torch.uint8:  # raw bytes only: a cast would garble the rows
            raise ValueError(f"layer {layer_id}: FP8 KV pages must be raw uint8 rows, got {data.dtype}")
        self._paged(layer_id)[pages] = data.to(self.store_dtype).to(self.kv_buffer[layer_id].device)

    def layer_view(self, layer_id: int, kv: torch.Tensor | None = None,
                   index_rows: torch.Tensor | None = None) -> "MLATokenToKVPool":
        """A pool of the same geometry whose layer `layer_id` reads the given buffers (MLA KV
        [pages * page_size + page_size, 1, dim]; index-K rows [pages + 1, page bytes]): the
        transient full-context view context parallel attends over. Nothing else is readable."""
        view = copy.copy(self)
        view.layer_transfer_counter = None  # the buffers are built from already-waited layers
        view._layer_end_callbacks = ()  # hooks belong to the rank's own pool
        view.kv_buffer = {layer_id: kv} if kv is not None else {}
        view.size = (kv.shape[0] if kv is not None else index_rows.shape[0] * self.page_size) - self.page_size
        if hasattr(self, "index_k_with_scale_buffer"):
            view.index_k_with_scale_buffer = [index_rows] if index_rows is not None else []
            view.index_layer_ids = [layer_id] if index_rows is not None else []
            view.index_layer_map = {layer_id: 0} if index_rows is not None else {}
        return view

    def kv_bytes_per_token(self) -> int:
        return self.layer_num * self.kv_cache_dim * self.store_dtype.itemsize

    def get_kv_size_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.kv_buffer)

    def layout(self) -> KVPoolLayout:
        return KVPoolLayout(
            layer_num=self.layer_num, kv_cache_dim=self.kv_cache_dim, dtype=self.store_dtype,
            page_size=self.page_size, num_pages=self.size // self.page_size,
            kv_row_bytes=self.kv_cache_dim * self.store_dtype.itemsize, index_k_bytes_per_page=0, index_layer_ids=(),
            kv_cache_dtype=self.kv_cache_dtype)

    def page_payloads(self, layer_id: int) -> list[PagePayload]:
        """MLA KV as [num_pages + 1, page_size * kv_cache_dim] (model dtype; raw uint8 FP8 rows if kv_fp8)."""
        self._wait_layer(layer_id)
        return [PagePayload("kv", self.kv_buffer[layer_id].view(-1, self.page_size * self.kv_cache_dim))]


class NSATokenToKVPool(MLATokenToKVPool):
    """MLA pool plus the DSA indexer's K cache, allocated only for layers that run the indexer."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        index_head_dim: int,
        index_k_dtype: str = "fp8_e4m3",
        index_layer_ids: list[int] | None = None,
        device: str = "cpu",
        kv_cache_dtype: str = "auto",
    ) -> None:
        super().__init__(size, page_size, dtype, kv_lora_rank, qk_rope_head_dim, layer_num, device, kv_cache_dtype)
        if index_k_dtype not in INDEX_K_DTYPES:
            raise ValueError(f"index_k_dtype {index_k_dtype!r} not in {sorted(INDEX_K_DTYPES)}")
        self.index_head_dim, self.index_k_dtype = index_head_dim, index_k_dtype
        self.index_k_fp8 = index_k_dtype == "fp8_e4m3"  # the index K (+ fp32 scales); kv_fp8 is the MLA KV
        self.data_dtype = torch.float8_e4m3fn if self.index_k_fp8 else INDEX_K_DTYPES[index_k_dtype]
        self.num_scales = num_scale_blocks(index_head_dim) if self.index_k_fp8 else 0
        self.data_bytes_per_token = index_head_dim * self.data_dtype.itemsize
        self.index_bytes_per_token = self.data_bytes_per_token + 4 * self.num_scales
        if self.index_bytes_per_token % 4:
            raise ValueError(f"index_head_dim {index_head_dim} gives a per-token size not a multiple of 4 bytes")
        # Logical layer id -> index buffer slot; layers that reuse another layer's top-k get none.
        self.index_layer_ids = list(range(layer_num)) if index_layer_ids is None else sorted(index_layer_ids)
        bad = [i for i in self.index_layer_ids if not 0 <= i < layer_num]
        if bad:
            raise ValueError(f"index layer ids {bad} outside [0, {layer_num})")
        if len(set(self.index_layer_ids)) != len(self.index_layer_ids):
            raise ValueError(f"duplicate index layer ids in {self.index_layer_ids}")
        self.index_layer_map = {lid: j for j, lid in enumerate(self.index_layer_ids)}
        num_pages = size // page_size + 1
        self.index_k_with_scale_buffer = [
            torch.zeros((num_pages, page_size * self.index_bytes_per_token), dtype=torch.uint8, device=device)
            for _ in self.index_layer_ids
        ]

    def index_buffer_id(self, layer_id: int) -> int:
        try:
            return self.index_layer_map[layer_id]
        except KeyError:
            raise KeyError(
                f"layer {layer_id} has no index-K buffer (index layers: {self.index_layer_ids}); "
                "a shared IndexCache layer must not read or write indexer K"
            ) from None

    def get_index_k_buffer(self, layer_id: int) -> torch.Tensor:
        """The layer's raw uint8 [num_pages + 1, page_size * bytes/token] buffer (what kernels read)."""
        self._wait_layer(layer_id)
        return self.index_k_with_scale_buffer[self.index_buffer_id(layer_id)]

    def get_index_k_store_buffer(self, layer_id: int) -> torch.Tensor:
        """The same raw buffer, for a fused store kernel to write new tokens' index K into
        (sgl_kernel.kv_store.store_index_k; `set_index_k` is its torch twin)."""
        self._wait_layer(layer_id)
        return self.index_k_with_scale_buffer[self.index_buffer_id(layer_id)]

    def _views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Typed [num_pages, page_size, D] data view and [num_pages, page_size, ns] scale view."""
        p, d, npg = self.page_size, self.index_head_dim, buf.shape[0]
        row = buf.shape[1]
        isz = self.data_dtype.itemsize
        data = buf.view(self.data_dtype).as_strided((npg, p, d), (row // isz, d, 1))
        if not self.index_k_fp8:
            return data, None
        f32 = buf.view(torch.float32)
        base = p * self.data_bytes_per_token // 4
        scales = f32.as_strided((npg, p, self.num_scales), (row // 4, self.num_scales, 1), storage_offset=base)
        return data, scales

    def set_index_k(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor) -> None:
        """Quantise (FP8 mode) and store index K [T, D] at slots `loc` (torch twin of the store kernel)."""
        data, scales = self._views(self.index_k_with_scale_buffer[self.index_buffer_id(layer_id)])
        page, off = loc // self.page_size, loc % self.page_size
        if self.index_k_fp8:
            q, s = quantize_fp8_per_block(k)
            data[page, off] = q
            scales[page, off] = s
        else:
            data[page, off] = k.to(self.data_dtype)

    def get_index_k(self, layer_id: int, loc: torch.Tensor) -> torch.Tensor:
        """Dequantised index K (fp32) for slots `loc` of any shape -> [..., D]."""
        data, scales = self._views(self.get_index_k_buffer(layer_id))
        page, off = loc // self.page_size, loc % self.page_size
        if self.index_k_fp8:
            return dequantize_fp8_per_block(data[page, off], scales[page, off])
        return data[page, off].float()

    # -- page-level moves (HiCache backup/load, PD transfer): raw bytes, layer-checked ------------
    def get_index_k_pages(self, layer_id: int, pages: torch.Tensor) -> torch.Tensor:
        """Raw index-K rows ([n, page_size * bytes_per_token] uint8) of `pages` for a full layer."""
        return self.get_index_k_buffer(layer_id)[pages]

    def set_index_k_pages(self, layer_id: int, pages: torch.Tensor, rows: torch.Tensor) -> None:
        buf = self.index_k_with_scale_buffer[self.index_buffer_id(layer_id)]
        if rows.dtype != torch.uint8 or tuple(rows.shape) != (len(pages), buf.shape[1]):
            raise ValueError(f"layer {layer_id}: index-K rows must be uint8 [{len(pages)}, {buf.shape[1]}], "
                             f"got {rows.dtype} {tuple(rows.shape)}")
        buf[pages] = rows.to(buf.device)

    def check_index_layer_ids(self, layer_ids: list[int], what: str = "peer") -> None:
        """A transfer / backup made for another IndexCache layout must not be applied here."""
        if list(layer_ids) != self.index_layer_ids:
            raise ValueError(f"index-K layer layout mismatch: {what} has layers {list(layer_ids)}, "
                             f"this pool has {self.index_layer_ids}")

    def kv_bytes_per_token(self) -> int:
        return super().kv_bytes_per_token() + len(self.index_layer_ids) * self.index_bytes_per_token

    def get_kv_size_bytes(self) -> int:
        return super().get_kv_size_bytes() + sum(b.numel() for b in self.index_k_with_scale_buffer)

    def layout(self) -> KVPoolLayout:
        return dataclasses.replace(super().layout(), index_k_bytes_per_page=self.page_size * self.index_bytes_per_token,
                                   index_layer_ids=tuple(self.index_layer_ids))

    def page_payloads(self, layer_id: int) -> list[PagePayload]:
        """MLA KV, plus the raw index-K rows ([num_pages + 1, page bytes] uint8) on full layers only:
        a shared IndexCache layer has no index K to move."""
        out = super().page_payloads(layer_id)  # waits for the layer (MLA and index K arrive together)
        j = self.index_layer_map.get(layer_id)
        if j is not None:
            out.append(PagePayload("index_k", self.index_k_with_scale_buffer[j]))
        return out
