"""Async host backup: the reservation state machine (reserve -> layer progress -> final ack -> commit
| rollback) on its own, then driven through a model-free HiRadixCache (target + draft pools), with
duplicate-prefix probing, pinning against eviction, and rollback leaving nothing visible."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.managers.hicache_backup import AsyncBackup, BackupReservation, BackupState
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.hicache_transfer import NullBackup
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.memory_pool_host import HostKVPool, HostPageAllocator
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from test_memory_pool_host import nsa_pool

P = 4
EXPECTED = {(0, 0), (0, 1), (1, 0)}


def _res(start: int = 0, end: int = 8) -> BackupReservation:
    n = end - start
    return BackupReservation(list(range(end)), start, torch.arange(n), torch.arange(n), EXPECTED)


# -- the state machine ----------------------------------------------------------------------------------
def test_reserve_progress_ack_commit():
    r = _res()
    assert r.state is BackupState.RESERVED and r.quiescent
    assert r.layer_enqueued(0, 0) and r.state is BackupState.IN_PROGRESS
    assert not r.layer_enqueued(0, 0)  # a layer is copied once per forward
    assert not r.layer_enqueued(0, 7)  # not a layer of this backup
    assert not r.quiescent
    r.layer_acked(0, 0)
    r.layer_enqueued(0, 1)
    r.layer_enqueued(1, 0)
    r.layer_acked(0, 1)
    assert r.state is BackupState.IN_PROGRESS  # the draft's layer is still out
    with pytest.raises(RuntimeError, match="commit from in_progress"):
        r.commit()
    r.layer_acked(1, 0)
    assert r.state is BackupState.ACKED and r.quiescent
    r.commit()
    assert r.state is BackupState.COMMITTED and r.finished
    with pytest.raises(RuntimeError, match="after commit"):
        r.rollback()


def test_failure_rolls_back_only_when_quiescent():
    r = _res()
    r.layer_enqueued(0, 0)
    r.layer_enqueued(0, 1)
    r.layer_acked(0, 0, RuntimeError("copy failed"))
    assert r.error is not None and r.state is BackupState.IN_PROGRESS
    with pytest.raises(RuntimeError, match="in flight"):
        r.rollback()  # layer 1's copy still writes into the reserved host slots
    r.layer_acked(0, 1)
    assert r.state is not BackupState.ACKED  # an error never reaches the final ack
    r.rollback()
    assert r.state is BackupState.ROLLED_BACK and not r.layer_enqueued(1, 0)
    with pytest.raises(RuntimeError, match="unexpected ack"):
        r.layer_acked(1, 0)


def test_reservation_shapes_are_checked():
    with pytest.raises(ValueError, match="one device and one host slot"):
        BackupReservation(list(range(8)), 4, torch.arange(3), torch.arange(3), EXPECTED)


# -- driven through a HiRadixCache ----------------------------------------------------------------------
class Harness:
    """A HiRadixCache over a target (4 layers) and a draft (1 layer) pool, no model: the test plays
    the forward by calling each pool's on_layer_end."""

    def __init__(self) -> None:
        self.target, self.draft = nsa_pool(size=128), nsa_pool(layers=1, index_layer_ids=(0,), size=128)
        pairs = [(self.target, HostKVPool(self.target, 128)), (self.draft, HostKVPool(self.draft, 128))]
        self.ctl = HiCacheController(pairs)
        self.r2t = ReqToTokenPool(8, 64)
        self.alloc = PagedTokenToKVPoolAllocator(128, P)
        self.cache = HiRadixCache(self.r2t, self.alloc, P, self.ctl, HostPageAllocator(128, P), "write_through")
        self.cache.backup = self.backup = AsyncBackup(self.cache)
        self.host_free0, self.dev_free0 = self.cache.host_allocator.available_size(), self.alloc.available_size()

    def req(self, tokens: list[int]) -> SimpleNamespace:
        m = self.cache.match_prefix(tokens)
        self.cache.inc_lock_ref(m.last_node)
        req = SimpleNamespace(rid=f"r{tokens[0]}", req_pool_idx=self.r2t.alloc(1)[0], prefix_indices=m.device_indices,
                              last_node=m.last_node, kv_committed_len=len(tokens),
                              hicache_counted_len=0)  # as Req declares it
        req.fill_ids = req.kv_token_ids = lambda: tokens
        self.r2t.write(req.req_pool_idx, 0, m.device_indices)
        new = self.alloc.alloc(len(tokens) - len(m.device_indices))
        self.r2t.write(req.req_pool_idx, len(m.device_indices), new)
        self._write_kv(new, seed=tokens[0])
        return req

    def _write_kv(self, slots: torch.Tensor, seed: int) -> None:
        """What the forward would write: distinct KV (and index K) per request."""
        g = torch.Generator().manual_seed(seed)
        for pool in (self.target, self.draft):
            for buf in pool.kv_buffer:
                buf[slots.to(buf.device)] = torch.randn(len(slots), *buf.shape[1:], generator=g).to(buf.device)
            pages = torch.unique(slots // P)
            for buf in pool.index_k_with_scale_buffer:
                buf[pages.to(buf.device)] = torch.randint(0, 256, (len(pages), buf.shape[1]), generator=g,
                                                          dtype=torch.uint8).to(buf.device)

    def batch(self, reqs) -> SimpleNamespace:
        return SimpleNamespace(forward_mode=ForwardMode.EXTEND, reqs=reqs, num_extend_reqs=len(reqs),
                               prefix_lens=[len(r.prefix_indices) for r in reqs],
                               extend_lens=[r.kv_committed_len - len(r.prefix_indices) for r in reqs])

    def forward(self, draft: bool = True, layers=range(4)) -> None:
        for lid in layers:
            self.target.on_layer_end(lid)
        if draft:
            self.draft.on_layer_end(0)

    def settle(self) -> None:
        self.ctl.wait_idle()
        self.cache.check_events()

    def host_visible(self, tokens: list[int]) -> int:
        return sum(len(n.key) for n in self._path(tokens) if n.host_ready)

    def _path(self, tokens):
        node, rest, out = self.cache.root, tokens, []
        while rest:
            child = node.children.get(tuple(rest[:P]))
            if child is None:
                break
            out.append(child)
            node, rest = child, rest[len(child.key):]
        return out

    def clean(self) -> None:
        self.settle()
        self.cache.check_invariants()
        assert self.backup.reserved_size() == 0 and self.cache.host_leak_report() is None
        assert self.cache.pinned_backup_tokens == 0


def _tokens(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


def test_commit_after_insert_and_final_ack():
    h = Harness()
    toks = _tokens(16)
    req = h.req(toks)
    b = h.batch([req])
    h.cache.prepare_batch(b)
    assert h.backup.reserved_size() == 16
    h.forward()
    h.cache.cache_finished_req(req)
    h.cache.on_batch_done(b)
    h.settle()
    assert h.host_visible(toks) == 16 and h.backup.stats["committed"] == 1
    # the host copy is byte-exact for the target and the draft, index K included
    node = h._path(toks)[0]
    dev_pages, host_pages = node.value[::P] // P, node.host_value[::P] // P
    for pool, host in h.ctl.pairs:
        for lid in range(pool.layer_num):
            for pl in pool.page_payloads(lid):
                assert torch.equal(host.payload(lid, pl.name)[host_pages], pl.buffer[dev_pages].cpu())
    h.clean()


def test_repeated_prompt_probes_and_reserves_nothing():
    h = Harness()
    toks = _tokens(16)
    for _ in range(2):
        req = h.req(toks[:16])
        req.prefix_indices = req.prefix_indices[:12]  # the scheduler recomputes at least the last page
        b = h.batch([req])
        h.cache.prepare_batch(b)
        h.forward()
        h.cache.cache_finished_req(req)
        h.cache.on_batch_done(b)
        h.settle()
    assert h.backup.stats["reserved"] == 1 and h.backup.stats["rolled_back"] == 0
    h.clean()


def test_same_prompt_twice_in_one_batch_reserves_once():
    h = Harness()
    toks = _tokens(16)
    a, b_ = h.req(toks), h.req(toks)
    b = h.batch([a, b_])
    h.cache.prepare_batch(b)
    assert h.backup.stats["reserved"] == 1
    h.forward()
    h.cache.cache_finished_req(a)
    h.cache.cache_finished_req(b_)
    h.cache.on_batch_done(b)
    h.settle()
    assert h.host_visible(toks) == 16
    h.clean()


@pytest.mark.parametrize("how", ["never_inserted", "draft_layer_missing", "copy_fails"])
def test_rollback_leaves_nothing_visible_and_frees_everything(how):
    h = Harness()
    toks = _tokens(16)
    req = h.req(toks)
    b = h.batch([req])
    if how == "copy_fails":
        h.ctl.backup_fault = lambda lid: lid == 2
    h.cache.prepare_batch(b)
    h.forward(draft=how != "draft_layer_missing")
    if how == "never_inserted":  # aborted with its step's result dropped: released, nothing committed
        h.alloc.free(h.r2t.read(req.req_pool_idx, 16))  # what Scheduler.free_uncommitted_kv does
        req.kv_committed_len = 0
    h.cache.cache_finished_req(req)
    h.cache.on_batch_done(b)
    h.settle()
    assert h.backup.stats["committed"] == 0 and h.backup.stats["rolled_back"] == 1
    assert h.host_visible(toks) == 0 and h.cache.host_total_size() == 0
    assert h.cache.host_allocator.available_size() == h.host_free0
    h.cache.evict(10**6)
    assert h.alloc.available_size() == h.dev_free0
    h.clean()


def test_pinned_until_ack_then_evicts_to_host():
    h = Harness()
    gate = threading.Event()
    copy = h.ctl._copy_to_host
    h.ctl._copy_to_host = lambda *a: (gate.wait(300), copy(*a))  # held until the test opens it
    toks = _tokens(16)
    req = h.req(toks)
    b = h.batch([req])
    h.cache.prepare_batch(b)
    h.forward()
    h.cache.cache_finished_req(req)
    h.cache.on_batch_done(b)
    assert h.cache.evict(10**6) == 0  # the copies still read these device pages
    assert h.cache.evictable_size() == 0  # and admission does not count on them
    assert h.host_visible(toks) == 0  # and nothing is visible before the final ack
    gate.set()
    h.settle()
    assert h.host_visible(toks) == 16
    assert h.cache.evict(10**6) == 16
    m = h.cache.match_prefix(toks)
    assert len(m.device_indices) == 0 and m.host_hit_length == 16
    h.clean()


def test_write_back_eviction_during_load_back_spares_the_host_pages_it_reads():
    """A load-back that must evict under write_back backs the victim up first; that backup's host
    allocation may evict host-only leaves, but never the pages the load-back is about to read."""
    h = Harness()
    h.cache.write_policy, h.cache.write_threshold, h.cache.backup = "write_back", None, NullBackup()
    h.cache.host_allocator = HostPageAllocator(32, P)  # room for exactly two 16-token prompts
    a, b = _tokens(16, 100), _tokens(16, 300)
    for toks in (a, b):
        h.cache.cache_finished_req(h.req(toks))
    h.cache.evict(10**6)  # both backed up on eviction: the host is full
    h.settle()
    assert h.cache.match_prefix(a).host_hit_length == 16 and h.cache.host_allocator.available_size() == 0
    host_a = h._path(a)[0].host_value[::P] // P
    snap = [host.payload(lid, "kv")[host_a].clone() for _, host in h.ctl.pairs for lid in (0,)]
    for toks in (_tokens(32, 700), _tokens(48, 800), _tokens(48, 900)):  # the device is full; the
        h.cache.cache_finished_req(h.req(toks))                         # 32-token one is the LRU victim
    assert h.alloc.available_size() == 0
    m = h.cache.init_load_back(h.cache.match_prefix(a))
    h.settle()
    assert len(m.device_indices) == 16
    for (pool, _), want in zip(h.ctl.pairs, snap):
        assert torch.equal(pool.page_payloads(0)[0].buffer[m.device_indices[::P] // P].cpu(), want)
    h.cache.check_invariants()


def test_host_eviction_is_lru_over_host_only_leaves():
    h = Harness()
    h.cache.backup = NullBackup()  # back up at insert (write_through), so each prompt is one backup op
    h.cache.host_allocator = HostPageAllocator(32, P)
    a, b, c = _tokens(16, 100), _tokens(16, 300), _tokens(16, 500)
    for toks in (a, b):
        h.cache.cache_finished_req(h.req(toks))
    h.settle()
    assert h.cache.evict(10**6) == 32  # both become host-only
    h.cache.match_prefix(a)  # a is now more recent than b
    h.cache.cache_finished_req(h.req(c))  # its backup needs 16 host tokens: b goes
    h.settle()
    assert h.cache.match_prefix(a).host_hit_length == 16
    assert h.cache.match_prefix(b).host_hit_length == 0 and h.host_visible(c) == 16
    h.cache.check_invariants()
    assert h.cache.host_leak_report() is None


def test_check_invariants_names_a_node_without_a_copy():
    """The checker the other tests lean on must fire: a host-only node that loses its host copy."""
    from sglang.srt.mem_cache.hiradix_cache import CacheInvariantError

    h = Harness()
    h.cache.backup = NullBackup()
    h.cache.cache_finished_req(h.req(_tokens(16, 100)))
    h.settle()
    assert h.cache.evict(10**6) == 16  # host-only now
    h.cache.check_invariants()
    node = next(x for x in h.cache._all_nodes() if x is not h.cache.root)
    node.host_value = None
    with pytest.raises(CacheInvariantError, match="neither a device nor a host copy"):
        h.cache.check_invariants()
