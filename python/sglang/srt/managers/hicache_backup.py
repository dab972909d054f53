"""Async host backup for write_through HiCache: reserve before the forward, copy at layer ends,
commit to the radix tree only after the final target + draft ack.

Per prefill request, one `BackupReservation` walks an explicit state machine:

    RESERVED --layer enqueued/acked--> IN_PROGRESS --all (pool, layer) acked--> ACKED --> COMMITTED
        \\------------- a layer failed, or the tree never received the tokens -------> ROLLED_BACK

- reserve (`prepare_batch`): host slots for the pages the request's insert will add. The final
  insertion prefix is probed first (`probe_host_len`: tokens whose host copy exists or is being made,
  plus other live reservations of the same tokens), so a repeated prompt reserves only its new
  suffix instead of a duplicate backup that would roll back as an insert miss.
- layer progress: every device pool (target, draft) calls `on_layer_end(layer)` after writing a
  layer; the callback queues that layer's copy of the current batch's reservations on the
  controller's write thread. Acks come back through a queue and are applied on the scheduler
  thread (`check_events`), so the state machine is single-threaded. No collectives anywhere: under
  CP each rank drives its own copies from its own hooks, and the cache acks them at the same
  scheduler step on every rank (a local wait, see HiRadixCache.check_events).
- attach (`on_insert`, the request's insert: a chunk, or its release): the tree nodes that hold
  exactly the reserved device slots are pinned (`node.pending`), so device eviction cannot free
  slots a copy still reads; tokens the tree did not take (aborted, retracted, duplicate) are left
  unattached. A layer that never ended in the forward fails the reservation (`on_batch_done`).
- commit: once ACKED, attached nodes get their host copy (visible to matches); unattached host
  slots are freed; a reservation with nothing attached is an insert miss and rolls back.
  rollback: once no copy is in flight, everything is freed and nodes unpinned.
Copies are only tied to "the current batch" because the launch is inline (the forward runs inside
`run_batch`, right after `prepare_batch`); with a threaded launcher the cache backs up at insert.
"""

from __future__ import annotations

import collections
import enum
import itertools
import logging
import torch

from sglang.srt.mem_cache.hiradix_cache import page_prefix_hashes

logger = logging.getLogger(__name__)
_ids = itertools.count(1)


class BackupState(enum.Enum):
    RESERVED = "reserved"
    IN_PROGRESS = "in_progress"
    ACKED = "acked"
    COMMITTED = "committed"
    ROLLED_BACK = "rolled_back"


class BackupReservation:
    """Host slots reserved for tokens [start, end) of `key`, copied from `device_indices`."""

    kind = "backup"  # it pins nodes like a TransferOp (HiTreeNode.pending), so splits follow it

    def __init__(self, key: list[int], start: int, device_indices: torch.Tensor, host_indices: torch.Tensor,
                 expected: set[tuple[int, int]]) -> None:
        if len(device_indices) != len(host_indices) or len(key) - start != len(host_indices):
            raise ValueError("a reservation needs one device and one host slot per token of [start, end)")
        self.id = next(_ids)
        self.key, self.start, self.end = key, start, len(key)
        self.device_indices, self.host_indices = device_indices, host_indices
        self.expected = frozenset(expected)
        self.enqueued: set[tuple[int, int]] = set()
        self.acked: set[tuple[int, int]] = set()
        self.error: BaseException | None = None
        self.state = BackupState.RESERVED
        self.nodes: list = []  # attached tree nodes (pinned)
        self.page_keys: list[str] | None = None  # content keys for the KV trace / L3 (when one is set)
        self.runs = None  # the controller's PagePlan of these slots, shared by every layer's copy
        self.attached = False

    # -- transitions ------------------------------------------------------------------------------
    def layer_enqueued(self, pair: int, layer: int) -> bool:
        """Record a layer copy being queued; False if it is not expected or already queued."""
        key = (pair, layer)
        if self.state not in (BackupState.RESERVED, BackupState.IN_PROGRESS) or key not in self.expected \
                or key in self.enqueued:
            return False
        self.enqueued.add(key)
        self.state = BackupState.IN_PROGRESS
        return True

    def layer_acked(self, pair: int, layer: int, error: BaseException | None = None) -> None:
        key = (pair, layer)
        if key not in self.enqueued or key in self.acked:
            raise RuntimeError(f"reservation {self.id}: unexpected ack of {key}")
        self.acked.add(key)
        if error is not None and self.error is None:
            self.error = error
        if self.error is None and self.acked == self.expected:
            self.state = BackupState.ACKED

    def fail(self, reason: str) -> None:
        if self.error is None:
            self.error = RuntimeError(reason)

    @property
    def quiescent(self) -> bool:
        """No copy of this reservation is queued or running."""
        return self.acked == self.enqueued

    @property
    def finished(self) -> bool:
        return self.state in (BackupState.COMMITTED, BackupState.ROLLED_BACK)

    def commit(self) -> None:
        if self.state is not BackupState.ACKED:
            raise RuntimeError(f"reservation {self.id}: commit from {self.state.value}")
        self.state = BackupState.COMMITTED

    def rollback(self) -> None:
        if not self.quiescent:
            raise RuntimeError(f"reservation {self.id}: rollback with copies in flight")
        if self.state is BackupState.COMMITTED:
            raise RuntimeError(f"reservation {self.id}: rollback after commit")
        self.state = BackupState.ROLLED_BACK


class AsyncBackup:
    """The reservations of a HiRadixCache (write_through) and the layer-end hooks that drive them."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.controller = cache.controller
        self.expected = {(i, lid) for i, (dev, _) in enumerate(self.controller.pairs) for lid in range(dev.layer_num)}
        self.live: list[BackupReservation] = []
        self.current: list[BackupReservation] = []  # the batch being launched
        self._acks: collections.deque = collections.deque()  # (reservation, pair, layer, error), any thread
        self.stats: collections.Counter = collections.Counter()  # reserved / committed / rolled_back / tokens
        for i, (dev, _) in enumerate(self.controller.pairs):
            dev.register_layer_end_callback(lambda layer, i=i: self.on_layer_end(i, layer))

    # -- reserve ------------------------------------------------------------------------------------
    def probe_host_len(self, key: list[int]) -> int:
        """Leading tokens of `key` whose host copy exists or is already being made (tree walk without
        splitting, then live reservations of the same tokens)."""
        cache, node, n = self.cache, self.cache.root, 0
        rest = key
        while rest:
            child = node.children.get(cache._child_key(rest))
            if child is None or child.host_value is None:
                break
            m = cache._match_len(child.key, rest)
            n += m
            if m < len(child.key):
                break
            node, rest = child, rest[m:]
        moved = True
        while moved:
            moved = False
            for r in self.live:
                if r.finished or r.error is not None or not r.start <= n < r.end:
                    continue
                common = cache._align(_common_len(r.key, key))
                if common > n:
                    n, moved = min(common, r.end), True
        return n

    def prepare_batch(self, batch) -> None:
        self.current = []
        if batch.forward_mode.is_decode():
            return
        r2t = self.cache.req_to_token_pool
        for req, p, e in zip(batch.reqs[: batch.num_extend_reqs], batch.prefix_lens, batch.extend_lens):
            end = self.cache._align(p + e)
            key = req.fill_ids()[:end]
            start = self.probe_host_len(key)
            if start >= end:
                continue
            host = self.cache._alloc_host(end - start)
            if host is None:
                continue  # the host is full of pinned copies: the insert-time path may try again
            dev = r2t.read(req.req_pool_idx, end)[start:end]
            self.cache.note_owners(host, dev)
            r = BackupReservation(key, start, dev, host, self.expected)
            r.rid = req.rid
            ctl = self.controller
            r.runs = ctl.plan_later(host, dev)  # one plan, made on the write thread, for every layer
            r.page_keys = (page_prefix_hashes(key, self.cache.page_size, start)
                           if ctl.trace is not None or ctl.storage is not None else None)
            self.stats["reserved"] += 1
            self.stats["reserved_tokens"] += end - start
            self.live.append(r)
            self.current.append(r)
        batch.hicache_reservations = list(self.current)

    # -- layer progress -----------------------------------------------------------------------------
    def on_layer_end(self, pair: int, layer: int) -> None:
        for r in self.current:
            if r.layer_enqueued(pair, layer):
                self.controller.backup_layer(pair, layer, r.device_indices, r.host_indices, r.page_keys,
                                             lambda err, r=r: self._acks.append((r, pair, layer, err)), r.runs)

    def covers(self, node) -> int:
        """Leading tokens of a freshly inserted device node whose backup a live reservation makes."""
        first = int(node.value[0])
        for r in self.live:
            if r.error is not None or r.finished:
                continue
            hit = (r.device_indices == first).nonzero()
            if len(hit):
                j = int(hit[0])
                n = min(len(node.value), len(r.device_indices) - j)
                if torch.equal(node.value[:n], r.device_indices[j: j + n]):
                    return n
        return 0

    # -- attach / commit / rollback (scheduler thread) ----------------------------------------------
    def on_batch_done(self, batch) -> None:
        for r in getattr(batch, "hicache_reservations", ()):
            missing = r.expected - r.enqueued
            if missing and r.error is None:
                r.fail(f"layers {sorted(missing)[:4]} never ended in the forward")
        self.check_events()

    def on_insert(self, req) -> None:
        """The request's KV was just inserted (a chunk, or at release): attach its reservations.
        Their forwards have run (the launch is inline), so what the tree did not take never will."""
        for r in self.live:
            if r.rid == req.rid and not r.attached:
                if r.error is None:
                    self._attach(r)
                r.attached = True

    def _attach(self, r: BackupReservation) -> None:
        """Pin the tree nodes that hold exactly r's device slots (split at r's bounds)."""
        cache = self.cache
        cache.match_prefix(r.key[: r.start])  # splits at start and end so nodes align with r
        cache.match_prefix(r.key)
        node, pos, rest = cache.root, 0, r.key
        while rest and pos < r.end:
            child = node.children.get(cache._child_key(rest))
            if child is None or cache._match_len(child.key, rest) < len(child.key):
                break
            n = len(child.key)
            if pos >= r.start and child.on_device and child.host_value is None:
                seg = slice(pos - r.start, pos - r.start + n)
                if torch.equal(child.value, r.device_indices[seg]):
                    child.pending.append(r)
                    r.nodes.append(child)
                    cache.pinned_backup_tokens += n
            node, rest, pos = child, rest[n:], pos + n

    def has_attached(self) -> bool:
        """Reservations check_events still has to commit or roll back."""
        return any(r.attached for r in self.live)

    def check_events(self) -> None:
        while self._acks:
            r, pair, layer, err = self._acks.popleft()
            r.layer_acked(pair, layer, err)
        for r in list(self.live):
            if not r.attached:
                continue
            if r.state is BackupState.ACKED and not r.nodes:
                r.fail("insert miss: the tree took none of the reserved tokens")  # aborted / duplicate
            if r.error is not None:
                if r.quiescent:
                    self._rollback(r)
            elif r.state is BackupState.ACKED:
                self._commit(r)
            if r.finished:
                self.live.remove(r)

    def _unpin(self, r: BackupReservation) -> None:
        for node in r.nodes:
            node.pending.remove(r)
            self.cache.pinned_backup_tokens -= len(node.key)

    def _commit(self, r: BackupReservation) -> None:
        used = torch.zeros(len(r.host_indices), dtype=torch.bool)
        self._unpin(r)
        committed = []
        for node in r.nodes:
            off = _offset(r, node)
            if off is None or node.host_value is not None:
                continue
            node.host_value = r.host_indices[off: off + len(node.key)]
            used[off: off + len(node.key)] = True
            committed.append(node)
        self.cache.host_allocator.free(r.host_indices[~used])
        self.cache.store_to_storage(committed)  # L3 (if any) behind the host copy
        r.nodes = []
        r.commit()
        self.stats["committed"] += 1
        self.stats["committed_tokens"] += int(used.sum())

    def _rollback(self, r: BackupReservation) -> None:
        logger.warning("HiCache backup of %d tokens rolled back: %s", r.end - r.start, r.error)
        self._unpin(r)
        r.nodes = []
        self.cache.host_allocator.free(r.host_indices)
        r.rollback()
        self.stats["rolled_back"] += 1

    def reserved_size(self) -> int:
        """Host slots held by reservations not yet committed or rolled back."""
        return sum(len(r.host_indices) for r in self.live if not r.finished)

    def reset(self) -> None:
        self.live, self.current = [], []
        self._acks.clear()


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _offset(r: BackupReservation, node) -> int | None:
    """Where a pinned node's slots start inside r (nodes may have split since attaching)."""
    hit = (r.device_indices == int(node.value[0])).nonzero() if node.on_device else []
    if not len(hit):
        return None
    j = int(hit[0])
    n = len(node.key)
    return j if torch.equal(r.device_indices[j: j + n], node.value) else None
