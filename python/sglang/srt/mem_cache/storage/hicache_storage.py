"""HiCache L3 storage: the key of a page, what a stored page is, and the backend interface.

Key: `get_hash_str(page_tokens, prior_hash)`, a SHA-256 chained over full pages (upstream's
function, same bytes): page i's key depends on every token of pages 0..i, so equal keys mean an
equal prefix and a different earlier page changes every later key. `page_hashes` is the one place
that cuts a token list into page keys.

Value: ONE page of ALL layers, as a self-describing blob

    fixed header  magic, meta length, payload count, CRC-32 of the payload, SHA-256 of the key
    layout meta   JSON of the pool layout (layer count, kv row bytes, page size, dtype, index
                  layer ids, index-K bytes per page): a reader with another layout refuses it
    lengths       u64 per payload: layer_num MLA KV pages, then one index-K page per index layer
    payload       the bytes, in that order

Integrity, decided here for every backend: a blob from another pool layout raises
`StorageLayoutError` (a configuration error, never a silent wrong copy); a blob whose index-K
sidecar is missing or shorter than a page, that is truncated, fails its CRC or belongs to another
key is a miss (logged, counted), never a partial load: the MLA KV without its index K is the
"main KV byte-perfect, output garbage" failure (Mooncake#2236).
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import threading
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy
import torch

from sglang.srt.mem_cache.memory_pool import KVPoolLayout, PagePayload

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_MAGIC = b"SGLKVPG1"
_FIXED = struct.Struct("<8sIII32s")  # magic, meta_len, n_payloads, payload crc32, sha256(key)


# -- keys ------------------------------------------------------------------------------------------
def get_hash_str(token_ids: Sequence[int], prior_hash: str | None = None) -> str:
    """SHA-256 hex of (prior page's hash bytes, then each token as u32 little-endian): upstream's key."""
    h = hashlib.sha256()
    if prior_hash:
        h.update(bytes.fromhex(prior_hash))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.hexdigest()


def page_hashes(token_ids: Sequence[int], page_size: int, prior_hash: str | None = None) -> list[str]:
    """Keys of the full pages of `token_ids` (a trailing partial page has none), chained from
    `prior_hash` (the key of the page before `token_ids[0]`, None at the start of a sequence)."""
    keys: list[str] = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        prior_hash = get_hash_str(token_ids[start : start + page_size], prior_hash)
        keys.append(prior_hash)
    return keys


# -- values ----------------------------------------------------------------------------------------
class StorageLayoutError(ValueError):
    """A stored page was written by a pool of another layout (model, dtype, page size, IndexCache
    schedule): the store is shared with an incompatible server. Use another directory / namespace."""


@dataclass
class PageData:
    """One page of every layer, as raw bytes (1-D uint8 CPU tensors): `kv[l]` the MLA KV page of
    layer l (page_size rows), `index_k[j]` the index-K page of layout.index_layer_ids[j]."""

    kv: list[torch.Tensor]
    index_k: list[torch.Tensor]


class PagedKV(Protocol):
    """What the storage reads pages from and writes them to: a device KV pool or its host mirror."""

    def layout(self) -> KVPoolLayout: ...

    def page_payloads(self, layer_id: int) -> list[PagePayload]: ...


def layout_meta(layout: KVPoolLayout) -> dict:
    """The layout fields a stored page must agree on (not num_pages: pools of any size share pages)."""
    return {
        "format": FORMAT_VERSION,
        "layer_num": layout.layer_num,
        "kv_cache_dim": layout.kv_cache_dim,
        "kv_row_bytes": layout.kv_row_bytes,
        "page_size": layout.page_size,
        "dtype": str(layout.dtype).removeprefix("torch."),
        "index_layer_ids": list(layout.index_layer_ids),
        "index_k_bytes_per_page": layout.index_k_bytes_per_page,
        # only when not "auto", so pages stored before the FP8 format existed still match
        **({"kv_cache_dtype": layout.kv_cache_dtype} if layout.kv_cache_dtype != "auto" else {}),
    }


class PageCodec:
    """Encodes / decodes the page blob of one layout (sizes precomputed: all full blobs of a layout
    have the same length, `blob_size`, so backends can stage them in fixed slots)."""

    def __init__(self, layout: KVPoolLayout, fingerprint: str = "") -> None:
        self.layout = layout
        # the KV fingerprint (storage/fingerprint.py) of the writer: a reader of another one refuses
        self.meta = {**layout_meta(layout), **({"kv_fingerprint": fingerprint} if fingerprint else {})}
        self._meta_bytes = json.dumps(self.meta, sort_keys=True, separators=(",", ":")).encode()
        self.lengths = [layout.kv_bytes_per_page] * layout.layer_num + \
            [layout.index_k_bytes_per_page] * len(layout.index_layer_ids)
        self.n_payloads = len(self.lengths)
        self.header_size = _FIXED.size + len(self._meta_bytes) + 8 * self.n_payloads
        self.payload_size = sum(self.lengths)
        self.blob_size = self.header_size + self.payload_size

    # -- encode ------------------------------------------------------------------------------------
    def encode(self, key: str, page: PageData, out: memoryview | None = None, strict: bool = True) -> memoryview:
        """The blob of `page`, written into `out` (>= blob_size bytes) or a new buffer. `strict=False`
        only lets tests forge a short sidecar, as a buggy writer would."""
        parts = [*page.kv, *page.index_k]
        lengths = [int(t.numel()) * t.element_size() for t in parts]
        if len(page.kv) != self.layout.layer_num or len(page.index_k) != len(self.layout.index_layer_ids):
            raise ValueError(f"page has {len(page.kv)} KV / {len(page.index_k)} index-K payloads, layout wants "
                             f"{self.layout.layer_num} / {len(self.layout.index_layer_ids)}")
        if strict and lengths != self.lengths:
            raise ValueError(f"page payload lengths {lengths} differ from the layout's {self.lengths}")
        size = self.header_size + sum(lengths)
        buf = memoryview(bytearray(size)) if out is None else out[:size]
        off = self.header_size
        for t, n in zip(parts, lengths):
            # memoryview assignment = one single-threaded memcpy; torch's copy_ of these ~100 KB
            # pieces went through its intra-op thread pool and was ~50x slower on a busy 2-core host
            buf[off : off + n] = memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            off += n
        crc = zlib.crc32(buf[self.header_size : size])
        fixed = _FIXED.pack(_MAGIC, len(self._meta_bytes), self.n_payloads, crc, hashlib.sha256(key.encode()).digest())
        m0 = _FIXED.size
        buf[:m0] = fixed
        buf[m0 : m0 + len(self._meta_bytes)] = self._meta_bytes
        l0 = m0 + len(self._meta_bytes)
        buf[l0 : self.header_size] = struct.pack(f"<{self.n_payloads}Q", *lengths)
        return buf

    # -- decode ------------------------------------------------------------------------------------
    def decode(self, key: str, blob: bytes | bytearray | memoryview, where: str = "") -> PageData | None:
        """The page, or None (logged) when the blob is unusable; StorageLayoutError for another layout.
        The returned tensors view `blob` (pass a writable buffer the caller no longer reuses)."""
        blob = memoryview(blob)
        what = f"stored page {key[:16]}{' at ' + where if where else ''}"
        if len(blob) < _FIXED.size:
            return _miss(what, f"truncated header ({len(blob)} bytes)")
        magic, meta_len, n, crc, digest = _FIXED.unpack_from(blob)
        if magic != _MAGIC:
            return _miss(what, "bad magic (not a page blob)")
        if len(blob) < _FIXED.size + meta_len:
            return _miss(what, "truncated layout header")
        try:
            meta = json.loads(bytes(blob[_FIXED.size : _FIXED.size + meta_len]))
        except ValueError:
            return _miss(what, "unreadable layout header")
        if meta != self.meta:
            diff = {k: (meta.get(k), v) for k, v in self.meta.items() if meta.get(k) != v}
            raise StorageLayoutError(f"{what} was written for another KV layout or model: stored vs this pool "
                                     f"{diff}; a store shared by servers of different models / checkpoints / "
                                     "dtypes / page sizes / IndexCache schedules needs a separate directory or "
                                     "namespace")
        if n != self.n_payloads:
            return _miss(what, f"{n} payloads, layout has {self.n_payloads}")
        if digest != hashlib.sha256(key.encode()).digest():
            return _miss(what, "it belongs to another key")
        l0 = _FIXED.size + meta_len
        if len(blob) < l0 + 8 * n:
            return _miss(what, "truncated length table")
        lengths = list(struct.unpack_from(f"<{n}Q", blob, l0))
        kv_n = self.layout.layer_num
        for j, (got, want) in enumerate(zip(lengths[kv_n:], self.lengths[kv_n:])):
            if got != want:  # the sidecar rule: never load KV whose index K is missing or short
                return _miss(what, f"index-K sidecar of layer {self.layout.index_layer_ids[j]} has {got} bytes, "
                                   f"a page needs {want}")
        if lengths != self.lengths:
            return _miss(what, f"KV payload lengths {lengths[:kv_n]} differ from {self.lengths[:kv_n]}")
        if len(blob) != self.blob_size:
            return _miss(what, f"{len(blob)} bytes, a page blob has {self.blob_size} (truncated or padded)")
        if zlib.crc32(blob[self.header_size :]) != crc:
            return _miss(what, "checksum mismatch (corrupt)")
        data = torch.frombuffer(blob, dtype=torch.uint8) if not blob.readonly else \
            torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        parts, off = [], self.header_size
        for ln in lengths:
            parts.append(data[off : off + ln])
            off += ln
        return PageData(kv=parts[:kv_n], index_k=parts[kv_n:])


def _miss(what: str, reason: str) -> None:
    logger.warning("HiCache storage: %s ignored (a miss): %s", what, reason)
    return None


# -- pool <-> pages --------------------------------------------------------------------------------
def check_same_layout(a: KVPoolLayout, b: KVPoolLayout, what: str = "pool") -> None:
    if layout_meta(a) != layout_meta(b):
        diff = {k: (v, layout_meta(b)[k]) for k, v in layout_meta(a).items() if layout_meta(b)[k] != v}
        raise StorageLayoutError(f"{what} layout differs from the storage's: {diff}")


def _as_index(pages: Sequence[int] | torch.Tensor) -> torch.Tensor:
    if isinstance(pages, torch.Tensor):
        return pages.to(torch.int64).cpu()
    return torch.tensor(list(pages), dtype=torch.int64)


def read_pool_pages(pool: PagedKV, pages: Sequence[int] | torch.Tensor) -> list[PageData]:
    """Copy pages (pool page ids) of every layer out of `pool` (device or host) into PageData.
    The copies are page-major in one host array (a page's payloads adjacent, in blob order)."""
    layout = pool.layout()
    idx = _as_index(pages)
    n = len(idx)
    codec_lengths = [layout.kv_bytes_per_page] * layout.layer_num + \
        [layout.index_k_bytes_per_page] * len(layout.index_layer_ids)
    out = numpy.empty((n, sum(codec_lengths)), dtype=numpy.uint8)
    index_layers = set(layout.index_layer_ids)
    kv_offs, ik_offs, off = [], [], 0
    for layer in range(layout.layer_num):  # KV of every layer, then index K: the blob's order
        kv_offs.append(off)
        off += layout.kv_bytes_per_page
    for _ in layout.index_layer_ids:
        ik_offs.append(off)
        off += layout.index_k_bytes_per_page
    j = 0
    for layer in range(layout.layer_num):
        payloads = {p.name: p.buffer for p in pool.page_payloads(layer)}
        kinds = [("kv", kv_offs[layer])] + ([("index_k", ik_offs[j])] if layer in index_layers else [])
        j += layer in index_layers
        for name, start in kinds:
            src = payloads[name].view(torch.uint8)  # [num_pages + 1, page bytes]
            if src.shape[1] != (layout.kv_bytes_per_page if name == "kv" else layout.index_k_bytes_per_page):
                raise ValueError(f"layer {layer} {name}: pool pages of {src.shape[1]} bytes disagree with its layout")
            rows = src.numpy()[idx.numpy()] if src.device.type == "cpu" else src[idx.to(src.device)].cpu().numpy()
            out[:, start : start + src.shape[1]] = rows
    data = torch.from_numpy(out)
    return [PageData(kv=[data[i, o : o + layout.kv_bytes_per_page] for o in kv_offs],
                     index_k=[data[i, o : o + layout.index_k_bytes_per_page] for o in ik_offs]) for i in range(n)]


def write_pool_pages(pool: PagedKV, pages: Sequence[int] | torch.Tensor, data: Sequence[PageData]) -> None:
    """Write PageData (from `batch_get`) into pool pages `pages` (same order), every layer."""
    layout = pool.layout()
    idx = _as_index(pages)
    if len(idx) != len(data):
        raise ValueError(f"{len(idx)} pages but {len(data)} page values")
    if not len(idx):
        return
    index_slot = {lid: j for j, lid in enumerate(layout.index_layer_ids)}
    page_ids = idx.tolist()
    for layer in range(layout.layer_num):
        for p in pool.page_payloads(layer):
            if p.name == "kv":
                rows = [d.kv[layer] for d in data]
            elif p.name == "index_k":
                rows = [d.index_k[index_slot[layer]] for d in data]
            else:
                raise ValueError(f"unknown page payload {p.name!r} of layer {layer}")
            dst = p.buffer.view(torch.uint8)  # [num_pages + 1, page bytes]
            bad = next((r.numel() for r in rows if r.numel() != dst.shape[1]), None)
            if bad is not None:
                raise ValueError(f"layer {layer} {p.name}: a page value has {bad} bytes, pool pages have "
                                 f"{dst.shape[1]}")
            if dst.device.type == "cpu":
                # row by row into the pool (numpy memcpy): no staging tensor to allocate and fault in
                dst_np = dst.numpy()
                for pid, r in zip(page_ids, rows):
                    dst_np[pid] = r.numpy()
            else:  # one host->device copy per payload
                dst[idx.to(dst.device)] = torch.stack(rows).to(dst.device)


def store_pool_pages(storage: "HiCacheStorage", pool: PagedKV, pages: Sequence[int] | torch.Tensor,
                     keys: Sequence[str]) -> list[bool]:
    """Back up `pool` pages (every layer, MLA KV + index K) under `keys` (page_hashes of their prefix)."""
    check_same_layout(pool.layout(), storage.layout)
    return storage.batch_set(keys, read_pool_pages(pool, pages))


def load_pool_pages(storage: "HiCacheStorage", pool: PagedKV, pages: Sequence[int] | torch.Tensor,
                    keys: Sequence[str]) -> int:
    """Read `keys` from storage into `pool` pages (same order); returns n, the leading pages loaded:
    pages[:n] hold the stored pages, pages[n:] are untouched (the first miss ends a prefix hit)."""
    check_same_layout(pool.layout(), storage.layout)
    got = storage.batch_get(keys)
    n = next((i for i, p in enumerate(got) if p is None), len(got))
    write_pool_pages(pool, list(_as_index(pages)[:n].tolist()), got[:n])
    return n


# -- the backend interface ------------------------------------------------------------------------
class HiCacheStorage(ABC):
    """An L3 page store keyed by `page_hashes` keys. Pages are immutable (content-addressed): a key
    once written always means the same bytes, so a set of an existing key is skipped.

    Backends implement the byte-level `_put` / `_get` / `_exists_prefix` / `clear`; encoding,
    decoding and the integrity rules live here, once. Thread-safety: one thread setting and one
    thread getting at the same time (upstream's backup and prefetch threads) is supported.
    """

    def __init__(self, layout: KVPoolLayout, namespace: str = "", fingerprint: str = "") -> None:
        if namespace:
            _check_key(namespace, "namespace")  # becomes a directory / key prefix: see storage_namespace()
        self.layout = layout
        self.codec = PageCodec(layout, fingerprint)
        self.namespace = namespace
        self.stats = {"set": 0, "get_hit": 0, "get_miss": 0, "invalid": 0}
        self._stats_lock = threading.Lock()

    def _count(self, **inc: int) -> None:
        with self._stats_lock:
            for k, v in inc.items():
                self.stats[k] += v

    # -- public API ----------------------------------------------------------------------------
    def batch_set(self, keys: Sequence[str], values: Sequence[PageData]) -> list[bool]:
        """Store pages; True per key stored or already present (a write-behind backend may still be
        writing: `flush`). The values are encoded before this returns: the caller may reuse them."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        first: dict[str, int] = {}
        for i, k in enumerate(keys):
            _check_key(k)
            first.setdefault(k, i)  # a key twice in one batch: the same page, stored once
        uniq = list(first)
        ok_uniq = dict(zip(uniq, self._put(uniq, [values[first[k]] for k in uniq]))) if uniq else {}
        ok = [ok_uniq[k] for k in keys]
        self._count(set=sum(ok_uniq.values()))
        return ok

    def batch_get(self, keys: Sequence[str]) -> list[PageData | None]:
        """Each page, or None (absent, or unusable: see the module doc). Raises StorageLayoutError
        for a page of another layout."""
        for k in keys:
            _check_key(k)
        blobs = self._get(list(keys)) if keys else []
        out: list[PageData | None] = []
        for k, b in zip(keys, blobs):
            page = None if b is None else self.codec.decode(k, b, where=self._where(k))
            if b is not None and page is None:
                self._count(invalid=1)
                self._drop_invalid(k)
            out.append(page)
        hits = sum(p is not None for p in out)
        self._count(get_hit=hits, get_miss=len(out) - hits)
        return out

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many leading keys are stored (a prefix hit of that many pages). Existence only: a
        later `batch_get` may still miss on a corrupt page, so loads stop at the first None."""
        for k in keys:
            _check_key(k)
        return self._exists_prefix(list(keys)) if keys else 0

    @abstractmethod
    def clear(self) -> None:
        """Remove every page of this namespace (pending writes included)."""

    def flush(self) -> None:
        """Return once every accepted `batch_set` is readable by a new instance (no-op if synchronous)."""

    def close(self) -> None:
        self.flush()

    # -- backend hooks -------------------------------------------------------------------------
    def encode(self, key: str, page: PageData, out: memoryview | None = None) -> memoryview:
        return self.codec.encode(key, page, out)

    @abstractmethod
    def _put(self, keys: list[str], values: Sequence[PageData]) -> list[bool]: ...

    @abstractmethod
    def _get(self, keys: list[str]) -> list[bytes | bytearray | memoryview | None]: ...

    @abstractmethod
    def _exists_prefix(self, keys: list[str]) -> int: ...

    def _drop_invalid(self, key: str) -> None:
        """A stored page failed its checks: remove it so `batch_exists` stops counting it."""

    def _where(self, key: str) -> str:
        return ""

    def namespaces_like(self, prefix: str) -> list[str]:
        """Other namespaces of this store starting with `prefix`, where the backend can list them
        (the tier warns about pages of the same model under another fingerprint); [] if it cannot."""
        return []


def _check_key(key: str, what: str = "key") -> None:
    # Keys and namespaces become file names and store keys: [A-Za-z0-9._-], never a path.
    if not isinstance(key, str) or not key or len(key) > 200 or key.startswith(".") or \
            not all((c.isascii() and c.isalnum()) or c in "-_." for c in key):
        hint = "use page_hashes() keys" if what == "key" else "use storage_namespace()"
        raise ValueError(f"invalid storage {what} {key!r}: {hint}")


def storage_namespace(*parts: str | int) -> str:
    """A namespace for servers sharing one store: readable parts (model name, rank) made safe, plus a
    short hash of the exact parts, so 'org/model' and 'org_model' never share pages."""
    raw = "\x00".join(str(p) for p in parts)
    safe = "-".join("".join(c if (c.isascii() and c.isalnum()) or c in "-_." else "_" for c in str(p)) for p in parts)
    return f"{safe.lstrip('.')[:120]}-{hashlib.sha256(raw.encode()).hexdigest()[:8]}"


__all__ = ["FORMAT_VERSION", "HiCacheStorage", "PageCodec", "PageData", "PagedKV", "StorageLayoutError",
           "check_same_layout", "get_hash_str", "layout_meta", "load_pool_pages", "page_hashes",
           "read_pool_pages", "storage_namespace", "store_pool_pages", "write_pool_pages"]
