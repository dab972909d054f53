"""Storage backends by name (`--hicache-storage-backend`), imported lazily, and their start-up checks.

Import-light on purpose: server_args reads the choices from here without importing a backend
(Mooncake's native library loads only when its backend is built).
"""

from __future__ import annotations

import importlib
import json

from typing import TYPE_CHECKING

from sglang.srt.mem_cache.memory_pool import KVPoolLayout

if TYPE_CHECKING:
    from sglang.srt.mem_cache.storage.hicache_storage import HiCacheStorage

# name -> (module, class, extra-config keys it reads)
STORAGE_BACKENDS: dict[str, tuple[str, str, frozenset[str]]] = {
    "file": ("sglang.srt.mem_cache.storage.file_storage", "HiCacheFile",
             frozenset({"file_path", "write_queue_size", "fsync"})),
    "mooncake": ("sglang.srt.mem_cache.storage.mooncake_store", "MooncakeStore",
                 frozenset({"master_server_address", "metadata_server", "local_hostname", "protocol", "device_name",
                            "global_segment_size", "local_buffer_size", "staging_pages"})),
}
STORAGE_BACKEND_NAMES = list(STORAGE_BACKENDS)  # --hicache-storage-backend choices
PREFETCH_POLICIES = ["best_effort", "wait_complete", "timeout"]  # --hicache-storage-prefetch-policy (upstream)
# extra-config keys every backend accepts: the timeout policy's deadline (read by storage/tier.py)
# and `kv_fingerprint`: the weights' identity in the KV fingerprint (storage/fingerprint.py), for copies of
# one checkpoint on several hosts sharing a store
COMMON_EXTRA_KEYS = frozenset({"prefetch_timeout_base", "prefetch_timeout_per_ki_token", "kv_fingerprint"})


class StorageConfigError(ValueError):
    """A storage flag is invalid; `flag` names it (server_args turns this into a ServerArgsError)."""

    def __init__(self, flag: str, reason: str) -> None:
        self.flag, self.reason = flag, reason
        super().__init__(f"--{flag.replace('_', '-')}: {reason}")


def create_storage_backend(name: str, layout: KVPoolLayout, extra_config: dict | None = None,
                           namespace: str = "", fingerprint: str = "") -> "HiCacheStorage":
    """A HiCacheStorage for `--hicache-storage-backend name`. `namespace` separates servers that
    share a store (model name, rank, KV fingerprint); `fingerprint` is written into every page and
    checked on every read."""
    if name not in STORAGE_BACKENDS:
        raise ValueError(f"unknown HiCache storage backend {name!r}; choices: {STORAGE_BACKEND_NAMES}")
    module, cls, _ = STORAGE_BACKENDS[name]
    return getattr(importlib.import_module(module), cls)(layout, extra_config, namespace=namespace,
                                                                       fingerprint=fingerprint)


def parse_extra_config(text: str | dict | None) -> dict:
    if text is None or isinstance(text, dict):
        return dict(text or {})
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise StorageConfigError("hicache_storage_backend_extra_config", f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise StorageConfigError("hicache_storage_backend_extra_config", "must be a JSON object")
    return value


def validate_storage_args(backend: str | None, extra_config: str | dict | None, prefetch_policy: str,
                          enable_hierarchical_cache: bool | None) -> dict:
    """Start-up checks of the storage flags; the parsed extra config. `enable_hierarchical_cache`
    None means the flag does not exist in this build (the L3 tier sits under the host tier)."""
    if prefetch_policy not in PREFETCH_POLICIES:
        raise StorageConfigError("hicache_storage_prefetch_policy", f"{prefetch_policy!r} is not one of "
                                 f"{PREFETCH_POLICIES}")
    extra = parse_extra_config(extra_config)
    if backend is None:
        if extra:
            raise StorageConfigError("hicache_storage_backend_extra_config", "needs --hicache-storage-backend")
        return extra
    if backend not in STORAGE_BACKENDS:
        raise StorageConfigError("hicache_storage_backend", f"{backend!r} is not one of {STORAGE_BACKEND_NAMES}")
    if enable_hierarchical_cache is False:
        raise StorageConfigError("hicache_storage_backend", "needs --enable-hierarchical-cache (the storage tier "
                                 "sits under the host-memory tier)")
    known = STORAGE_BACKENDS[backend][2] | COMMON_EXTRA_KEYS
    unknown = sorted(set(extra) - known)
    if unknown:
        raise StorageConfigError("hicache_storage_backend_extra_config", f"unknown key(s) {unknown} for the "
                                 f"{backend} backend; known: {sorted(known)}")
    if "kv_fingerprint" in extra and not (isinstance(extra["kv_fingerprint"], str) and extra["kv_fingerprint"]):
        raise StorageConfigError("hicache_storage_backend_extra_config", "kv_fingerprint must be a non-empty string")
    for k in (COMMON_EXTRA_KEYS - {"kv_fingerprint"}) & set(extra):
        v = extra[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise StorageConfigError("hicache_storage_backend_extra_config", f"{k} must be a number >= 0 (s)")
    if backend == "file" and "file_path" in extra and not isinstance(extra["file_path"], str):
        raise StorageConfigError("hicache_storage_backend_extra_config", "file_path must be a string")
    if backend == "mooncake":
        from sglang.srt.mem_cache.storage.mooncake_store import import_mooncake_store

        try:  # the package and its native library (libibverbs & co.), at start-up rather than at first use
            import_mooncake_store()
        except ImportError as e:
            raise StorageConfigError("hicache_storage_backend", str(e)) from None
        import os

        if not (extra.get("master_server_address") or os.environ.get("MOONCAKE_MASTER")):
            raise StorageConfigError("hicache_storage_backend_extra_config", "mooncake needs "
                                     "'master_server_address' (or env MOONCAKE_MASTER): host:port of mooncake_master")
    return extra
