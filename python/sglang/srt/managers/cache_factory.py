"""The prefix cache the server's flags ask for: ChunkCache (--disable-radix-cache), RadixCache, or
HiRadixCache (--enable-hierarchical-cache) with its host mirrors, transfer controller, optional L3
tier and backup policy. The choice lives here, with the scheduler that builds it, so mem_cache/
imports nothing of managers/ (the controller and the backup are passed in)."""

from __future__ import annotations

import logging

from sglang.srt.debug.kv_trace import hicache_trace
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.managers.hicache_backup import AsyncBackup
from sglang.srt.managers.tp_worker import BaseTpWorker
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, ChunkCache
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
from sglang.srt.mem_cache.memory_pool_host import HostKVPool, HostPageAllocator, plan_host_tokens
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def create_tree_cache(server_args: ServerArgs, worker: BaseTpWorker, page_size: int) -> BasePrefixCache:
    """The scheduler's `tree_cache` over the worker's request slots and KV allocator."""
    if server_args.enable_hierarchical_cache:
        return create_hiradix_cache(server_args, worker, page_size)
    cache_cls = ChunkCache if server_args.disable_radix_cache else RadixCache
    return cache_cls(worker.req_to_token_pool, worker.token_to_kv_pool_allocator, page_size)


def create_hiradix_cache(server_args: ServerArgs, worker: BaseTpWorker, page_size: int) -> HiRadixCache:
    """HiRadixCache over host mirrors of every pool of `worker`, sized by --hicache-size / --hicache-ratio."""
    sa = server_args
    cp = worker.model_runner.cp_group
    pools = list(worker.kv_pools().values())
    tokens = plan_host_tokens(worker.max_total_num_tokens, [p.layout() for p in pools], sa.hicache_ratio,
                              sa.hicache_size, page_size)
    pairs = [(p, HostKVPool(p, tokens, sa.hicache_mem_layout)) for p in pools]
    controller = HiCacheController(pairs, sa.hicache_io_backend, cp.rank if cp else 0, cp.world_size if cp else 1)
    controller.trace = hicache_trace()  # None unless SGLANG_CP_HICACHE_KV_TRACE >= 1
    if sa.hicache_storage_backend is not None:
        if cp is not None and cp.world_size > 1:  # each rank's host holds only the pages it owns
            logger.error("HiCache storage tier is not supported with context parallel yet: disabled")
        else:
            from sglang.srt.mem_cache.storage.tier import create_storage_tier

            # rank 0 on every TP rank: the MLA KV (and index K) is replicated over TP, the pages alike
            controller.storage = create_storage_tier(sa, [h for _, h in pairs], 0, worker.model_runner.model_config)
    cache = HiRadixCache(worker.req_to_token_pool, worker.token_to_kv_pool_allocator, page_size, controller,
                         HostPageAllocator(tokens, page_size), sa.hicache_write_policy)
    if sa.hicache_write_policy == "write_through" and worker.launcher.inline:
        cache.backup = AsyncBackup(cache)  # reserve before the forward, copy at layer ends
    logger.info("HiCache: host pool of %d tokens (%.2f GB, %d mirror(s), %s), write policy %s", tokens,
                sum(h.get_size_bytes() for _, h in pairs) / 1e9, len(pairs), sa.hicache_mem_layout,
                sa.hicache_write_policy)
    return cache
