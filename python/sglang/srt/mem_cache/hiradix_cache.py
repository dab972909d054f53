"""HiRadixCache: the radix prefix cache with a host-memory tier (HiCache).

A node holds its KV on the device (`value`, device slots), on the host (`host_value`, host slots
of `memory_pool_host`), or both. Invariants (checked by `check_invariants`, used by the tests):
- device residency is prefix-closed: a device node's parent is a device node (or the root), so a
  match is a device part followed by a host-only part;
- a node with neither copy does not exist; `pending` (transfers in flight) pins a node on both tiers;
- lock_ref is only taken on device paths (the base class's rules), so locked nodes are device nodes.

Write policies (`--hicache-write-policy`, upstream semantics): write_through backs a node up on
insert; write_through_selective on its second hit (a request that inserts through an existing node);
write_back only when the device evicts it. Device eviction keeps a backed-up node as host-only;
host eviction removes host-only leaves, LRU first. With write_through, the backup of a prefill's new
pages runs during its forward (layer-end hooks, `managers/hicache_backup.py`) and becomes visible
here only after the final target + draft ack.

`match_prefix` reports device slots, then `host_hit_length` tokens past them ending at
`last_host_node`; `init_load_back(match)` gives those tokens device slots, queues the layer-wise
load (the forward waits per layer in the pool getters) and returns the match as if all were on the
device. Host pages stay on the node: they are released only by a later host eviction, which never
touches a node whose load is not yet acknowledged (check_events).

L3 (`--hicache-storage-backend`, `controller.storage`, mem_cache/storage/tier.py): a node whose
host copy is committed is written to storage behind it, keyed by its pages' prefix hashes, pinned
on the host until the write is acked (a "store" op: it blocks host eviction, not device eviction).
At admission, a key past the device + host match is looked up in storage
(`prefetch_from_storage`): the hit pages are read into fresh host pages and hung under the match
as one host-only node, which the normal load-back then brings to the device (hiradix_storage.py).
"""

from __future__ import annotations

import collections
import heapq
import logging
import time

import torch

from sglang.srt.mem_cache.base_prefix_cache import MatchResult
from sglang.srt.mem_cache.cp_page_map import page_owner
from sglang.srt.mem_cache.hicache_transfer import HostTransfers, NullBackup, TransferOp
from sglang.srt.mem_cache.hiradix_node import LOAD_BACK_THRESHOLD, HiTreeNode, Pin, device_busy
from sglang.srt.mem_cache.hiradix_storage import StorageOps
from sglang.srt.mem_cache.memory_pool_host import HostPageAllocator
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode
from sglang.srt.mem_cache.storage.hicache_storage import page_hashes

logger = logging.getLogger(__name__)

WRITE_THRESHOLDS = {"write_through": 1, "write_through_selective": 2, "write_back": None}


class HiRadixCache(StorageOps, RadixCache):
    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, page_size: int,
                 controller: HostTransfers, host_allocator: HostPageAllocator,
                 write_policy: str = "write_through") -> None:
        if write_policy not in WRITE_THRESHOLDS:
            raise ValueError(f"hicache write policy {write_policy!r} not in {sorted(WRITE_THRESHOLDS)}")
        self.controller, self.host_allocator, self.write_policy = controller, host_allocator, write_policy
        self.write_threshold = WRITE_THRESHOLDS[write_policy]
        self.backup = NullBackup()  # AsyncBackup (managers/hicache_backup.py) for write_through: cache_factory.py
        self.cp_size = controller.cp_size
        self.stats: collections.Counter = collections.Counter()  # loaded_tokens, backed_up_tokens, evicted_to_host
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size)

    # -- tree basics --------------------------------------------------------------------------------
    def reset(self) -> None:
        if getattr(self, "root", None) is not None:  # flush: let transfers drain first
            self.controller.wait_idle()
            self.check_events()
            self.host_allocator.clear()
            self.backup.reset()
        self.root = HiTreeNode()
        self.root.lock_ref = 1
        self._evictable = 0
        self._protected = 0
        self.pinned_backup_tokens = 0  # device tokens a backup in flight still reads (not evictable yet)

    def _split(self, child: HiTreeNode, at: int) -> HiTreeNode:
        new = HiTreeNode(child.key[:at], child.value[:at] if child.on_device else None, child.parent)
        new.lock_ref, new.last_access_time, new.hit_count = child.lock_ref, child.last_access_time, child.hit_count
        if child.host_value is not None:
            new.host_value, child.host_value = child.host_value[:at], child.host_value[at:]
        new.pending = list(child.pending)
        for op in child.pending:
            op.nodes.append(new)
        new.children = {self._child_key(child.key[at:]): child}
        child.parent.children[self._child_key(child.key)] = new
        child.parent = new
        child.key = child.key[at:]
        if child.on_device:
            child.value = child.value[at:]
        return new

    def match_prefix(self, key: list[int]) -> MatchResult:
        values, host_len = [], 0
        last_device = last_host = self.root
        for child in self._walk(key):
            if child.on_device:
                values.append(child.value)
                last_device = child
            else:
                host_len += len(child.key)
                last_host = child
        indices = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
        return MatchResult(indices, last_device, host_len, last_host if host_len else None)

    def insert(self, key: list[int], value: torch.Tensor, counted_len: int = 0) -> int:
        """Insert a page-aligned key. Returns the leading tokens already cached on the device (their
        slots in `value` are duplicates the caller frees); host-only nodes on the path adopt the
        recomputed device slots. Nodes past `counted_len` (tokens whose hit this request has not
        counted yet) get a hit; nodes that reach the policy's threshold are backed up."""
        if len(key) % self.page_size or len(key) != len(value):
            raise ValueError("radix insert needs a page-aligned key and one slot per token")
        node, pos, matched, device_run = self.root, 0, 0, True
        touched: list[HiTreeNode] = []
        now = time.monotonic()
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                child = HiTreeNode(list(key), value.clone(), node)
                node.children[self._child_key(key)] = child
                self._evictable += len(key)
                touched.append(child)
                break
            n = self._match_len(child.key, key)
            child.last_access_time = now
            if n < len(child.key):
                child = self._split(child, n)
            if child.on_device and device_run:
                matched += n
            elif not child.on_device:
                device_run = False
                child.value = value[:n].clone()
                self._evictable += n  # host-only nodes are unlocked
            if pos + n > counted_len:
                touched.append(child)
            node, key, value, pos = child, key[n:], value[n:], pos + n
        for t in touched:
            t.hit_count += 1
        self._maybe_backup(touched)
        return matched

    def _maybe_backup(self, nodes: list[HiTreeNode]) -> None:
        if self.write_threshold is None:
            return
        for n in nodes:
            if n.on_device and n.host_value is None and not n.pending and n.hit_count >= self.write_threshold:
                covered = self.backup.covers(n)
                if covered >= len(n.key):
                    continue  # its backup already runs in the forward (async write_through)
                if covered:
                    self._split(n, covered)  # n keeps the uncovered tail (e.g. decoded tokens)
                self.write_backup(n)

    def write_backup(self, node: HiTreeNode, wait: bool = False) -> bool:
        """Back a device node up to the host (all layers, target + draft); pinned until acked."""
        host = self._alloc_host(len(node.key))
        if host is None:
            return False
        node.host_value = host
        self.note_owners(host, node.value)
        op = self.controller.backup(node.value, host, self.page_keys(node), on_done=self._on_backup_done)
        op.nodes = [node]
        node.pending.append(op)
        self.pinned_backup_tokens += len(node.key)
        if wait:
            self.wait_op(op)
        return True

    def page_keys(self, node: HiTreeNode) -> list[str] | None:
        """Per-page content keys of a node's pages, only when a consumer (KV trace, L3) is set."""
        if self.controller.trace is None and self.controller.storage is None:
            return None
        path = []
        x = node
        while x is not self.root:
            path.append(x.key)
            x = x.parent
        tokens = [t for key in reversed(path) for t in key]
        return page_prefix_hashes(tokens, self.page_size, len(tokens) - len(node.key))

    def note_owners(self, host: torch.Tensor, device: torch.Tensor) -> None:
        """Remember the CP owner of each backed-up page (a load-back keeps it; see init_load_back)."""
        if self.cp_size > 1:
            self.host_allocator.record_owners(host, page_owner(device[:: self.page_size] // self.page_size,
                                                               self.cp_size))

    def wait_op(self, op: TransferOp) -> None:
        while not op.done:
            self.controller.wait_idle()
        self.check_events()

    def _alloc_host(self, n: int) -> torch.Tensor | None:
        host = self.host_allocator.alloc(n)
        if host is None:
            self.evict_host(n - self.host_allocator.available_size())
            host = self.host_allocator.alloc(n)
        return host

    def _on_backup_done(self, op: TransferOp) -> None:
        for n in op.nodes:
            n.pending.remove(op)
        self.pinned_backup_tokens -= len(op.device_indices)
        if op.error is None:
            self.store_to_storage(op.nodes)
            return
        logger.error("HiCache backup failed (%s): dropping its host copy", op.error)
        self.host_allocator.free(op.host_indices)
        for n in op.nodes:
            n.host_value = None

    # -- admission ----------------------------------------------------------------------------------
    def match_for_admission(self, key: list[int]) -> MatchResult:
        """Device + host match, extended by what L3 holds past it (read to the host), whose host part
        then gets device slots and a layer-wise load: all of the result's device_indices are usable."""
        match = self.match_prefix(key)
        if self.controller.storage is not None:
            match = self.prefetch_from_storage(key, match)
        if match.host_hit_length:  # counts as cached tokens, as a device hit does
            match = self.init_load_back(match)
        return match

    def _on_load_done(self, op: TransferOp) -> None:
        for n in op.nodes:
            n.pending.remove(op)
        if op.error is not None:  # the device slots hold garbage: never let a request read them
            raise RuntimeError(f"HiCache load-back failed: {op.error}") from op.error

    # -- load back ----------------------------------------------------------------------------------
    def init_load_back(self, match: MatchResult) -> MatchResult:
        """Give the host part of `match` device slots and queue its layer-wise load; the returned
        match covers device + loaded tokens. Too short a host hit, or no device room, returns it as is."""
        n = match.host_hit_length
        if n < max(LOAD_BACK_THRESHOLD, self.page_size) or match.last_host_node is None:
            return match
        nodes: list[HiTreeNode] = []
        node = match.last_host_node
        while node is not match.last_node:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        dev_len = len(match.device_indices)
        host = torch.cat([x.host_value for x in nodes])
        # Our own eviction must take neither the device prefix (locked) nor, through a write_back
        # backup's host allocation, the host pages about to be read (pinned).
        pin = Pin(nodes)
        self.inc_lock_ref(match.last_node)
        try:
            out = self._alloc_device(dev_len, n, host)
        finally:
            self.dec_lock_ref(match.last_node)
            pin.release()
        if out is None:
            return match
        keys = None
        if self.controller.trace is not None or self.controller.storage is not None:
            keys = [k for x in nodes for k in self.page_keys(x)]
        op = self.controller.load(host, out, keys, on_done=self._on_load_done)
        self.stats["loaded_tokens"] += n
        op.nodes = list(nodes)
        off = 0
        for x in nodes:
            x.value = out[off: off + len(x.key)].to(torch.int64)
            x.pending.append(op)
            off += len(x.key)
            self._evictable += len(x.key)
        return MatchResult(torch.cat([match.device_indices, out.to(torch.int64)]), match.last_host_node)

    def _alloc_device(self, dev_len: int, n: int, host: torch.Tensor) -> torch.Tensor | None:
        # Under CP, device pages of the owners the host pages were backed up from: each rank then
        # loads exactly the pages its own host mirror holds (no collective).
        def alloc():
            if self.cp_size > 1:
                return self.allocator.alloc_owned_pages(self.host_allocator.owners(host))
            return self.allocator.alloc_extend([dev_len], [dev_len + n], [-1])

        out = alloc()
        if out is None:
            self.evict(n)
            out = alloc()
        return None if out is None else out.to("cpu")

    # -- eviction -----------------------------------------------------------------------------------
    def _device_leaves(self) -> list[HiTreeNode]:
        return [x for x in self._all_nodes() if x is not self.root and x.on_device and x.lock_ref == 0
                and not device_busy(x) and not any(c.on_device for c in x.children.values())]

    def evict(self, num_tokens: int) -> int:
        """Free >= num_tokens of unlocked device KV, LRU leaves first: backed-up nodes become
        host-only; write_back backs a node up first; others (and their host-only subtree) go."""
        leaves = self._device_leaves()
        heapq.heapify(leaves)
        freed = 0
        while leaves and freed < num_tokens:
            leaf = heapq.heappop(leaves)
            if leaf.host_value is None and self.write_policy == "write_back":
                self.write_backup(leaf, wait=True)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            self.allocator.free(leaf.value)
            leaf.value = None
            if leaf.host_ready:
                self.stats["evicted_to_host"] += len(leaf.key)
            else:
                self._delete_subtree(leaf)
            parent = leaf.parent
            if (parent is not self.root and parent.on_device and parent.lock_ref == 0 and not device_busy(parent)
                    and not any(c.on_device for c in parent.children.values())):
                heapq.heappush(leaves, parent)
        return freed

    def _delete_subtree(self, node: HiTreeNode) -> None:
        """Remove a node without a device copy and its (host-only) descendants from the tree."""
        stack = [node]
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            if x.host_value is not None:
                self.host_allocator.free(x.host_value)
                x.host_value = None
        del node.parent.children[self._child_key(node.key)]

    def evict_host(self, num_tokens: int) -> int:
        """Free >= num_tokens of host KV: host-only leaves with nothing in flight, LRU first."""
        def evictable(x: HiTreeNode) -> bool:
            return (x is not self.root and not x.on_device and not x.children and not x.pending
                    and x.host_value is not None)

        leaves = [x for x in self._all_nodes() if evictable(x)]
        heapq.heapify(leaves)
        freed = 0
        while leaves and freed < num_tokens:
            leaf = heapq.heappop(leaves)
            self.host_allocator.free(leaf.host_value)
            leaf.host_value = None
            freed += len(leaf.key)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key)]
            if evictable(parent):
                heapq.heappush(leaves, parent)
        return freed

    # -- requests -----------------------------------------------------------------------------------
    def _commit(self, req, kv_len: int):
        token_ids = req.kv_token_ids()[:kv_len]
        kv = self.req_kv_indices(req, self.req_to_token_pool, kv_len)
        aligned = self._align(kv_len)
        counted = req.hicache_counted_len
        new_prefix = self.insert(token_ids[:aligned], kv[:aligned], counted_len=counted)
        req.hicache_counted_len = max(counted, aligned)
        self.backup.on_insert(req)
        cached = len(req.prefix_indices)
        if new_prefix > cached:
            self.allocator.free(kv[cached:new_prefix])
        return token_ids, kv, aligned

    def cache_finished_req(self, req) -> None:
        super().cache_finished_req(req)
        req.hicache_counted_len = 0

    # -- lifecycle hooks ------------------------------------------------------------------------------
    def check_events(self) -> None:
        if self.cp_size > 1:
            # Radix state must change at the same step on every CP rank: wait for this rank's own
            # copies here (local, no collective) instead of acking whenever they happen to finish.
            self.controller.wait_idle()
        self.controller.poll()  # acks run the ops' on_done (nodes unpinned, failures undone)
        self.backup.check_events()

    def has_pending_events(self) -> bool:
        return self.controller.unacked_ops() > 0 or self.backup.has_attached()

    def prepare_batch(self, batch) -> None:
        self.backup.prepare_batch(batch)

    def on_batch_done(self, batch) -> None:
        self.check_events()
        self.backup.on_batch_done(batch)

    # -- stats ----------------------------------------------------------------------------------------
    def evictable_size(self) -> int:
        """Unlocked device tokens minus those pinned by backups in flight (admission must not count
        on them; a pinned node that is also locked is subtracted twice: conservative, transient)."""
        return max(self._evictable - self.pinned_backup_tokens, 0)

    def total_size(self) -> int:
        """Device tokens the tree owns (the device leak check)."""
        return sum(len(x.key) for x in self._all_nodes() if x is not self.root and x.on_device)

    def host_total_size(self) -> int:
        return sum(len(x.key) for x in self._all_nodes() if x is not self.root and x.host_value is not None)

    def all_values(self) -> torch.Tensor:
        vals = [x.value for x in self._all_nodes() if x is not self.root and x.on_device]
        return torch.cat(vals) if vals else torch.empty(0, dtype=torch.int64)

    def host_leak_report(self) -> str | None:
        free, cached = self.host_allocator.available_size(), self.host_total_size()
        reserved = self.backup.reserved_size()
        if free + cached + reserved != self.host_allocator.size:
            return (f"host KV leak: free {free} + cached {cached} + reserved {reserved} != "
                    f"total {self.host_allocator.size}")
        return None

    def check_invariants(self) -> None:
        """Raise CacheInvariantError at the first node that breaks the tree's device / host rules."""
        for x in self._all_nodes():
            if x is self.root:
                continue
            if not x.on_device and x.host_value is None:
                raise CacheInvariantError(f"node {x.id} has neither a device nor a host copy")
            if x.on_device and x.parent is not self.root and not x.parent.on_device:
                raise CacheInvariantError(f"device node {x.id} under host-only parent {x.parent.id}")
            if x.lock_ref and not x.on_device:
                raise CacheInvariantError(f"host-only node {x.id} is locked")


class CacheInvariantError(RuntimeError):
    """A node breaks the device / host rules of the tree (a bug in the cache, never a user error)."""


def page_prefix_hashes(token_ids: list[int], page_size: int, start: int = 0) -> list[str]:
    """Content keys of the pages of `token_ids[start:]` (start page-aligned): the L3 store's keys
    (`storage.page_hashes`, chained over the whole prefix), also the KV trace's fingerprints."""
    return page_hashes(token_ids, page_size)[start // page_size:]

