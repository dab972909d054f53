"""HiCache L3 storage: pages of every layer, content-addressed by the prefix hash (see hicache_storage).

How the HiCache controller uses it (host pool = any object with `layout()` and `page_payloads(layer)`):

    extra = validate_storage_args(args.hicache_storage_backend, args.hicache_storage_backend_extra_config,
                                  args.hicache_storage_prefetch_policy, args.enable_hierarchical_cache)
    storage = create_storage_backend(args.hicache_storage_backend, host_pool.layout(), extra,
                                     namespace=storage_namespace(args.served_model_name))
    keys = page_hashes(token_ids, page_size, prior_hash)         # one key per full page, chained
    store_pool_pages(storage, host_pool, host_pages, keys)       # backup thread: host -> L3 (async on file)
    n = storage.batch_exists(keys)                               # prefetch: how many leading pages L3 has
    n = load_pool_pages(storage, host_pool, host_pages[:n], keys[:n])   # L3 -> host; the first miss ends it
    storage.close()                                              # at shutdown: drains the write-behind queue

A StorageLayoutError (the store holds pages of another layout) is a configuration error to log and
stop using the tier on, not a miss. The draft model's pool (EAGLE) is a second storage object with
its own namespace (its layout differs).

`tier.StorageTier` is that flow as HiCache runs it (controller.storage): writes behind committed
host copies, reads at admission, the prefetch policy, and the one-error disable.
"""

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
