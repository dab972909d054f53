"""HiRadixCache's L3 side (`--hicache-storage-backend`, `controller.storage`): committed host
copies are written behind to the tier; at admission a device + host miss is read back into fresh
host pages. A mixin of HiRadixCache (it reads the tree, the controller and the host allocator)."""

from __future__ import annotations

import logging
import time

from sglang.srt.mem_cache.base_prefix_cache import MatchResult
from sglang.srt.mem_cache.hicache_transfer import TransferOp
from sglang.srt.mem_cache.hiradix_node import LOAD_BACK_THRESHOLD, HiTreeNode, Pin
from sglang.srt.mem_cache.storage.hicache_storage import page_hashes

logger = logging.getLogger("sglang.srt.mem_cache.hiradix_cache")  # one logger for the cache's messages


class StorageOps:
    def store_to_storage(self, nodes: list[HiTreeNode]) -> None:
        """Write nodes whose host copy was just committed to L3, behind the backups on the write
        thread; each stays pinned on the host (a "store" op in `pending`) until that write is acked."""
        tier = self.controller.storage
        if tier is None or not tier.enabled:
            return
        for n in nodes:
            if n.host_value is None:
                continue
            op = self.controller.store(n.host_value, self.page_keys(n), on_done=self._on_store_done)
            op.nodes = [n]
            n.pending.append(op)

    def _on_store_done(self, op: TransferOp) -> None:
        for n in op.nodes:
            n.pending.remove(op)
        if op.error is not None:
            logger.warning("HiCache storage write of %d tokens failed: %s", len(op.host_indices), op.error)

    def prefetch_from_storage(self, key: list[int], match: MatchResult) -> MatchResult:
        """On a miss in device and host memory, read the pages L3 holds past `match` into fresh host
        pages and hang them under the match as a host-only node; the result is the new match (its
        host part then loads back layer by layer like any host hit). Synchronous (storage/tier.py)."""
        tier = self.controller.storage
        ps = self.page_size
        key = list(key[: self._align(len(key))])
        have = len(match.device_indices) + match.host_hit_length
        least = max(LOAD_BACK_THRESHOLD, ps)
        if not tier.enabled or len(key) - have < least:
            return match
        keys = page_hashes(key, ps)[have // ps:]
        n = tier.query(keys)
        if n * ps < least:
            return match
        parent = match.last_host_node if match.host_hit_length else match.last_node
        path, x = [], parent
        while x is not self.root:
            path.append(x)
            x = x.parent
        pin = Pin(path)  # the host eviction making room must not take the match itself
        try:
            host = self._alloc_host(n * ps)
        finally:
            pin.release()
        if host is None:
            return match
        got = tier.load(host.reshape(-1, ps)[:, 0] // ps, keys[:n]) * ps
        if got < least:
            self.host_allocator.free(host)
            return match
        if got < len(host):
            self.host_allocator.free(host[got:])
        node = HiTreeNode(key[have: have + got], None, parent)
        node.host_value, node.last_access_time = host[:got], time.monotonic()
        parent.children[self._child_key(node.key)] = node
        self.stats["storage_loaded_tokens"] += got
        return self.match_prefix(key)
