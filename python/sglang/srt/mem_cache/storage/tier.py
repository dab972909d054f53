"""The L3 tier as HiCache uses it: one storage backend per host pool (target, and the EAGLE draft's
in its own namespace), written behind the host backup and read on a host-memory miss.

- `store(host_pages, keys)` runs on the controller's write thread after a host copy is committed;
  the radix tree pins the node's host pages until it returns (a `store` op in `node.pending`).
- `query(keys)` / `load(host_pages, keys)` run on the scheduler thread at admission: a page counts
  only when every pool (target and draft) has it, so a restored page never lacks its draft KV.
- Integrity: a `StorageLayoutError` (the store holds pages of another layout) disables the tier
  with one error log; a corrupt or short page is a miss (the backend's decode), ending the hit.

Prefetch policy (`--hicache-storage-prefetch-policy`, upstream's names). Upstream prefetches in the
background from arrival and stops when the request is scheduled (best_effort), when every page has
arrived (wait_complete) or at a deadline (timeout). Here the read is the admission's own work, done
synchronously, so there is no queueing time to cut short: best_effort and wait_complete both read
every page `batch_exists` reported; timeout stops between batches at the deadline
(`prefetch_timeout_base` s + `prefetch_timeout_per_ki_token` s per 1024 tokens, extra config,
upstream's keys and defaults) and uses the leading pages read.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol, Sequence

import torch

from sglang.srt.mem_cache.storage.fingerprint import config_identity, kv_fingerprint, weights_identity
from sglang.srt.mem_cache.storage.hicache_storage import (
    HiCacheStorage,
    PagedKV,
    StorageLayoutError,
    layout_meta,
    load_pool_pages,
    storage_namespace,
    store_pool_pages,
)



class StorageServerArgs(Protocol):
    """The flags the tier reads (a ServerArgs has them): what names its namespace and fingerprint."""

    model_path: str
    served_model_name: str | None
    load_format: str
    dtype: str
    quantization: str | None
    tp_size: int
    attn_cp_size: int
    nnodes: int
    enable_hierarchical_cache: bool
    hicache_storage_backend: str | None
    hicache_storage_backend_extra_config: str | None
    hicache_storage_prefetch_policy: str


logger = logging.getLogger(__name__)

READ_BATCH_PAGES = 16  # pages per batch_get: the granularity at which a timeout can stop a read


class StorageTier:
    def __init__(self, hosts: Sequence[PagedKV], backends: Sequence[HiCacheStorage], prefetch_policy: str,
                 timeout_base: float = 0.5, timeout_per_ki_token: float = 0.25) -> None:
        if len(hosts) != len(backends):
            raise ValueError(f"{len(hosts)} host pools but {len(backends)} storage backends")
        self.hosts, self.backends = list(hosts), list(backends)
        self.policy = prefetch_policy
        self.timeout_base, self.timeout_per_ki_token = timeout_base, timeout_per_ki_token
        self.page_size = hosts[0].layout().page_size
        self.error: str | None = None  # set once: the tier is off from then on
        self._lock = threading.Lock()
        self.stats = {"stored_pages": 0, "queried_pages": 0, "hit_pages": 0, "loaded_pages": 0}

    @property
    def enabled(self) -> bool:
        return self.error is None

    def _disable(self, e: BaseException) -> None:
        with self._lock:
            if self.error is not None:
                return
            self.error = str(e)
        logger.error("HiCache storage tier disabled: %s", e)

    # -- write (controller write thread) -----------------------------------------------------------
    def store(self, host_pages: torch.Tensor, keys: Sequence[str]) -> None:
        """Write host pages (page ids of every host pool) under their prefix-hash keys."""
        if not self.enabled or not len(keys):
            return
        try:
            for host, backend in zip(self.hosts, self.backends):
                # keys chain over the prefix: a stored leading run (a prefix restored from L3, or
                # written by another server) is skipped before its pages are gathered and encoded
                skip = backend.batch_exists(keys)
                if skip < len(keys):
                    store_pool_pages(backend, host, host_pages[skip:], keys[skip:])
                    self.stats["stored_pages"] += len(keys) - skip
        except StorageLayoutError as e:
            self._disable(e)

    # -- read (scheduler thread, at admission) -----------------------------------------------------
    def query(self, keys: Sequence[str]) -> int:
        """Leading pages of `keys` every pool's store holds."""
        if not self.enabled or not keys:
            return 0
        n = len(keys)
        for backend in self.backends:
            n = min(n, backend.batch_exists(keys[:n]))
            if n == 0:
                break
        self.stats["queried_pages"] += len(keys)
        self.stats["hit_pages"] += n
        return n

    def load(self, host_pages: torch.Tensor, keys: Sequence[str]) -> int:
        """Read `keys` into `host_pages` (same order) of every pool; returns the leading pages loaded
        in all of them (a miss, a corrupt page or the timeout ends the hit)."""
        deadline = None
        if self.policy == "timeout":
            tokens = len(keys) * self.page_size
            deadline = time.monotonic() + self.timeout_base + self.timeout_per_ki_token * tokens / 1024
        done = 0
        try:
            while done < len(keys) and self.enabled:
                if deadline is not None and done and time.monotonic() > deadline:
                    break
                end = min(done + READ_BATCH_PAGES, len(keys))
                got = end - done
                for host, backend in zip(self.hosts, self.backends):
                    got = min(got, load_pool_pages(backend, host, host_pages[done:end], keys[done:end]))
                    if got == 0:
                        break
                done += got
                if done < end:
                    break
        except StorageLayoutError as e:
            self._disable(e)
            return 0
        self.stats["loaded_pages"] += done
        return done

    def flush(self) -> None:
        for b in self.backends:
            b.flush()

    def close(self) -> None:
        for b in self.backends:
            b.close()


def create_storage_tier(server_args: StorageServerArgs, hosts: Sequence[PagedKV], rank: int = 0,
                        model_config=None) -> StorageTier:
    """The tier of `--hicache-storage-backend`: namespace = model + rank + KV fingerprint (the draft
    pool its own); every page carries the fingerprint, and a page of another is refused."""
    from sglang.srt.mem_cache.storage.registry import create_storage_backend, validate_storage_args

    sa = server_args
    extra = validate_storage_args(sa.hicache_storage_backend, sa.hicache_storage_backend_extra_config,
                                  sa.hicache_storage_prefetch_policy, sa.enable_hierarchical_cache)
    model = sa.served_model_name or sa.model_path
    backends = []
    for i, host in enumerate(hosts):  # 0: target, 1: the EAGLE draft (another layout: its own pages)
        fp = pool_fingerprint(sa, model_config, host.layout(), extra.get("kv_fingerprint"))
        parts = (model, f"rank{rank}") if i == 0 else (model, f"rank{rank}", f"draft{i}")
        namespace = storage_namespace(*parts, f"kv{fp[:16]}")
        backend = create_storage_backend(sa.hicache_storage_backend, host.layout(), extra, namespace=namespace,
                                         fingerprint=fp)
        others = backend.namespaces_like(namespace[: namespace.index(f"-kv{fp[:16]}") + 3])
        if others:
            logger.warning("HiCache storage: the store holds KV of %r under %d other fingerprint(s) (another "
                           "checkpoint, config, dtype or layout): not used by this server, which keys its pages "
                           "by fingerprint %s (namespace %s)", model, len(others), fp[:16], namespace)
        backends.append(backend)
    return StorageTier(hosts, backends, sa.hicache_storage_prefetch_policy,
                       float(extra.get("prefetch_timeout_base", 0.5)),
                       float(extra.get("prefetch_timeout_per_ki_token", 0.25)))


def pool_fingerprint(server_args: StorageServerArgs, model_config, layout, weights_override: str | None = None) -> str:
    """The KV fingerprint of one pool of this server (see storage/fingerprint.py for the inputs)."""
    sa = server_args
    weights: list | str = weights_override or weights_identity(
        model_config.model_path if model_config is not None else sa.model_path, sa.load_format)
    config = config_identity(model_config.hf_config) if model_config is not None else {}
    return kv_fingerprint(weights, config, layout_meta(layout), dtype=str(getattr(model_config, "dtype", sa.dtype)),
                          quantization=getattr(sa, "quantization", None), tp_size=sa.tp_size,
                          attn_cp_size=sa.attn_cp_size, nnodes=sa.nnodes)
