"""Radix prefix cache over token ids, page-granular, with LRU eviction of unlocked leaves.

Every node key is a whole number of pages; children are keyed by their first page. A node's
value holds the KV slots of its key. See BasePrefixCache for the ownership rules.
"""

from __future__ import annotations

import heapq
import itertools
import time

import torch

from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult

_counter = itertools.count()


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time", "id")

    def __init__(self, key: list[int] | None = None, value: torch.Tensor | None = None, parent=None) -> None:
        self.children: dict[tuple, TreeNode] = {}
        self.parent: TreeNode | None = parent
        self.key: list[int] = key or []
        self.value: torch.Tensor = value if value is not None else torch.empty(0, dtype=torch.int64)
        self.lock_ref = 0
        self.last_access_time = time.monotonic()
        self.id = next(_counter)

    def __lt__(self, other: "TreeNode") -> bool:
        return (self.last_access_time, self.id) < (other.last_access_time, other.id)


class RadixCache(BasePrefixCache):
    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, page_size: int = 1) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.reset()

    # -- helpers ----------------------------------------------------------------------------------
    def reset(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1
        self._evictable = 0
        self._protected = 0

    def _align(self, n: int) -> int:
        return n // self.page_size * self.page_size

    def _child_key(self, key: list[int]) -> tuple:
        return tuple(key[: self.page_size])

    def _match_len(self, a: list[int], b: list[int]) -> int:
        n = min(len(a), len(b))
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return self._align(i)

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Split `child` so its first `at` tokens become a new parent node; returns it."""
        new = TreeNode(child.key[:at], child.value[:at], child.parent)
        new.lock_ref = child.lock_ref
        new.last_access_time = child.last_access_time
        new.children = {self._child_key(child.key[at:]): child}
        child.parent.children[self._child_key(child.key)] = new
        child.parent = new
        child.key, child.value = child.key[at:], child.value[at:]
        return new

    def _walk(self, key: list[int]):
        """The nodes along the longest page-aligned cached prefix of `key`, in order, touched for
        LRU; a node matched only in part is split first, so each yielded node is matched whole.
        The one walk behind every match (radix and HiRadix)."""
        key = list(key[: self._align(len(key))])
        node = self.root
        now = time.monotonic()
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                return
            n = self._match_len(child.key, key)
            if n == 0:
                return
            child.last_access_time = now
            if n < len(child.key):
                child = self._split(child, n)
            yield child
            node, key = child, key[n:]

    # -- API --------------------------------------------------------------------------------------
    def match_prefix(self, key: list[int]) -> MatchResult:
        nodes = list(self._walk(key))
        indices = torch.cat([n.value for n in nodes]) if nodes else torch.empty(0, dtype=torch.int64)
        return MatchResult(indices, nodes[-1] if nodes else self.root)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Insert a page-aligned key; returns how many leading tokens were already cached (their
        slots in `value` are now duplicates the caller must free)."""
        if len(key) % self.page_size or len(key) != len(value):
            raise ValueError("radix insert needs a page-aligned key and one slot per token")
        node, matched = self.root, 0
        now = time.monotonic()
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                new = TreeNode(list(key), value.clone(), node)
                node.children[self._child_key(key)] = new
                self._evictable += len(key)
                break
            n = self._match_len(child.key, key)
            child.last_access_time = now
            if n < len(child.key):
                child = self._split(child, n)
            matched += n
            node, key, value = child, key[n:], value[n:]
        return matched

    def inc_lock_ref(self, node: TreeNode | None) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("radix cache lock underflow")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        leaves = [n for n in self._all_nodes() if not n.children and n.lock_ref == 0 and n is not self.root]
        heapq.heapify(leaves)
        freed = 0
        while leaves and freed < num_tokens:
            leaf = heapq.heappop(leaves)
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def _commit(self, req, kv_len: int) -> tuple[list[int], torch.Tensor, int]:
        """Insert a request's aligned KV; free slots the tree already had. Returns (key, kv, aligned)."""
        token_ids = req.kv_token_ids()[:kv_len]
        kv = self.req_kv_indices(req, self.req_to_token_pool, kv_len)
        aligned = self._align(kv_len)
        new_prefix = self.insert(token_ids[:aligned], kv[:aligned])
        cached = len(req.prefix_indices)
        if new_prefix > cached:
            self.allocator.free(kv[cached:new_prefix])
        return token_ids, kv, aligned

    def cache_finished_req(self, req) -> None:
        kv_len = req.kv_committed_len
        _, kv, aligned = self._commit(req, kv_len)
        self.allocator.free(kv[aligned:kv_len])
        self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node = None, None
        req.prefix_indices = torch.empty(0, dtype=torch.int64)

    def cache_unfinished_req(self, req) -> None:
        token_ids, _, aligned = self._commit(req, req.kv_committed_len)
        match = self.match_prefix(token_ids[:aligned])
        cached = len(req.prefix_indices)
        self.req_to_token_pool.write(req.req_pool_idx, cached, match.device_indices[cached:])
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(match.last_node)
        req.prefix_indices, req.last_node = match.device_indices, match.last_node

    # -- stats ------------------------------------------------------------------------------------
    def _all_nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return sum(len(n.key) for n in self._all_nodes())

    def all_values(self) -> torch.Tensor:
        vals = [n.value for n in self._all_nodes() if n is not self.root]
        return torch.cat(vals) if vals else torch.empty(0, dtype=torch.int64)
