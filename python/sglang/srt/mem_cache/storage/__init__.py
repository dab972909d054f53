"""HiCache L3 storage: pages of every layer, content-addressed by the prefix hash (see hicache_storage)."""

from sglang.srt.mem_cache.storage.hicache_storage import (
    HiCacheStorage,
    PageCodec,
    PageData,
    StorageLayoutError,
    get_hash_str,
    load_pool_pages,
    page_hashes,
    read_pool_pages,
    storage_namespace,
    store_pool_pages,
    write_pool_pages,
)
from sglang.srt.mem_cache.storage.registry import (
    PREFETCH_POLICIES,
    STORAGE_BACKEND_NAMES,
    StorageConfigError,
    create_storage_backend,
    validate_storage_args,
)

__all__ = ["HiCacheStorage", "PREFETCH_POLICIES", "PageCodec", "PageData", "STORAGE_BACKEND_NAMES",
           "StorageConfigError", "StorageLayoutError", "create_storage_backend", "get_hash_str",
           "load_pool_pages", "page_hashes", "read_pool_pages", "storage_namespace", "store_pool_pages",
           "validate_storage_args", "write_pool_pages"]
