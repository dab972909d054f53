"""The prefix cache seam: RadixCache, ChunkCache (--disable-radix-cache) and HiRadixCache (HiCache's host tier).

Rules:
- `match_prefix(key)` returns the KV slots of the longest cached prefix of `key` (page-aligned)
  and the node that ends it. The caller must `inc_lock_ref(node)` before relying on the slots
  and `dec_lock_ref(node)` when done; locked nodes are never evicted.
- `cache_finished_req(req)` hands a finished request's KV to the cache: slots the cache now
  owns stay allocated, duplicates and the unaligned tail are freed, the request's lock is
  released and its request slot freed. After it, the request owns no KV.
- `cache_unfinished_req(req)` (chunked prefill) inserts the KV computed so far and moves the
  request's lock to the new, longer prefix.
- `evict(n)` frees at least `n` tokens of unlocked KV if possible (LRU leaves first).

Lifecycle hooks (no-ops here; a cache with asynchronous work -- HiCache's host backup and
load-back -- overrides them). The scheduler calls each from exactly one place:
- `check_events()` once per scheduler iteration: poll finished transfers, ack them, update the tree;
- `prepare_batch(batch)` before a batch is launched (e.g. reserve host slots, start load-backs);
- `on_batch_done(batch)` after the batch's results are applied (e.g. commit backups to the tree).
A match may hit KV that lives only on the host: `MatchResult.host_hit_length` tokens past the
device hit, ending at `last_host_node`; admission matches through `match_for_admission(key)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class MatchResult:
    device_indices: torch.Tensor  # int64 KV slots of the matched prefix
    last_node: Any
    host_hit_length: int = 0  # tokens past the device hit whose KV is on the host (HiCache)
    last_host_node: Any = None


class BasePrefixCache(ABC):
    @abstractmethod
    def match_prefix(self, key: list[int]) -> MatchResult: ...

    @abstractmethod
    def cache_finished_req(self, req) -> None: ...

    @abstractmethod
    def cache_unfinished_req(self, req) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int: ...

    @abstractmethod
    def inc_lock_ref(self, node) -> None: ...

    @abstractmethod
    def dec_lock_ref(self, node) -> None: ...

    # -- lifecycle hooks (see the module docstring) ---------------------------------------------------
    def check_events(self) -> None:
        pass

    def has_pending_events(self) -> bool:
        """Copies submitted but not yet acknowledged by check_events: an idle scheduler keeps polling
        for them (else a backup that ended after the last step would wait for the next request).
        Must change only in steps / check_events, so every rank of a server answers alike."""
        return False

    def prepare_batch(self, batch) -> None:
        pass

    def on_batch_done(self, batch) -> None:
        pass

    def match_for_admission(self, key: list[int]) -> MatchResult:
        """The match a request is admitted with: its `device_indices` are on the device (or loading
        to it). HiCache also reads an L3 hit to the host and loads the host part back first."""
        return self.match_prefix(key)

    def init_load_back(self, match: MatchResult) -> MatchResult:
        """Make a match's host part device-resident (HiCache queues a layer-wise load); the result's
        `device_indices` then cover it. Caches without a host tier have no host part."""
        return match

    def host_total_size(self) -> int:
        """Tokens with a host copy (HiCache); 0 without a host tier."""
        return 0

    def host_leak_report(self) -> str | None:
        """A host tier's leak check (host free + host cached == host total); None when fine or none."""
        return None

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    # Shared by the implementations: a request's KV slots for its first n tokens.
    @staticmethod
    def req_kv_indices(req, req_to_token_pool, n: int) -> torch.Tensor:
        return req_to_token_pool.read(req.req_pool_idx, n)


class ChunkCache(BasePrefixCache):
    """No reuse across requests (--disable-radix-cache): requests keep their own KV only."""

    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, page_size: int) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_pool_allocator
        self.page_size = page_size

    def match_prefix(self, key: list[int]) -> MatchResult:
        return MatchResult(torch.empty(0, dtype=torch.int64), None)

    def cache_finished_req(self, req) -> None:
        kv = self.req_kv_indices(req, self.req_to_token_pool, req.kv_committed_len)
        self.allocator.free(kv)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.prefix_indices = torch.empty(0, dtype=torch.int64)

    def cache_unfinished_req(self, req) -> None:
        req.prefix_indices = self.req_kv_indices(req, self.req_to_token_pool, req.kv_committed_len)

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node) -> None:
        pass

    def dec_lock_ref(self, node) -> None:
        pass
