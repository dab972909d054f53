"""HiCacheController: byte-exact device -> host -> device round trips of MLA KV and index K (index
layers only), target + draft pairs sharing host slots, the layer-wise wait every getter goes
through (no getter reads a layer before its copy lands), the observer hooks and failure reports."""

from __future__ import annotations

import threading

import pytest
import torch

from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.memory_pool_host import HostKVPool

from test_memory_pool_host import DEVICE, nsa_pool

P = 4


def _fill(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for buf in pool.kv_buffer:
        buf.copy_(torch.randn(buf.shape, generator=g))
    for buf in pool.index_k_with_scale_buffer:
        buf.copy_(torch.randint(0, 256, buf.shape, generator=g, dtype=torch.uint8))


def _slots(pages: list[int]) -> torch.Tensor:
    return (torch.tensor(pages)[:, None] * P + torch.arange(P)).reshape(-1)


def _pages_of(pool, layer_id: int, pages: list[int]) -> dict:
    return {p.name: p.buffer[torch.tensor(pages)].clone() for p in pool.page_payloads(layer_id)}


def _wait(ctl, op):
    ctl.wait_idle()
    ctl.poll()
    assert op.done and op.error is None


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])  # kernel: sgl_kernel.page_copy (interpreted on CPU)
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_round_trip_is_byte_exact_for_target_and_draft(layout, io_backend):
    target, draft = nsa_pool(index_layer_ids=(0, 3)), nsa_pool(layers=1, index_layer_ids=(0,))
    _fill(target, 1)
    _fill(draft, 2)
    pairs = [(target, HostKVPool(target, 32, layout)), (draft, HostKVPool(draft, 32, layout))]
    ctl = HiCacheController(pairs, io_backend)
    src, host, dst = [2, 5, 7], _slots([6, 1, 3]), [9, 10, 4]
    want = {i: [_pages_of(pool, lid, src) for lid in range(pool.layer_num)] for i, (pool, _) in enumerate(pairs)}
    _wait(ctl, ctl.backup(_slots(src), host))
    for pool, _ in pairs:  # wipe the device: the load alone must restore every payload
        for b in pool.kv_buffer + pool.index_k_with_scale_buffer:
            b.zero_()
    op = ctl.load(host, _slots(dst))
    _wait(ctl, op)
    for i, (pool, _) in enumerate(pairs):
        for lid in range(pool.layer_num):
            got = _pages_of(pool, lid, dst)
            assert sorted(got) == sorted(want[i][lid])
            for name in got:
                assert torch.equal(got[name], want[i][lid][name]), (i, lid, name)
    assert target.layer_transfer_counter is None and draft.layer_transfer_counter is None  # unregistered at ack


def test_shared_layers_move_only_mla_kv():
    pool = nsa_pool(index_layer_ids=(1,))
    _fill(pool, 3)
    ctl = HiCacheController([(pool, HostKVPool(pool, 16))])
    seen = []
    ctl.on_backup_done = lambda pages, lid, name, rows: seen.append((lid, name, pages.tolist(), rows.shape[0]))
    _wait(ctl, ctl.backup(_slots([2]), _slots([3])))
    assert seen == [(0, "kv", [3], 1), (1, "kv", [3], 1), (1, "index_k", [3], 1), (2, "kv", [3], 1),
                    (3, "kv", [3], 1)]


def test_page_runs_are_planned_on_the_copy_threads_and_once_per_layerwise_backup(monkeypatch):
    """The scheduler thread only checks and cuts the slots; the PageRuns plan (O(pages), ~0.3 ms an
    op on an H100 host) runs on the copy threads, once for all the layer-end backups of a forward.
    Mismatched page counts still raise on the submitting thread."""
    pool = nsa_pool()
    _fill(pool, 5)
    ctl = HiCacheController([(pool, HostKVPool(pool, 16))])
    planned_on = []
    real = ctl._plan_pages
    monkeypatch.setattr(ctl, "_plan_pages", lambda hp, dp: planned_on.append(threading.current_thread().name)
                        or real(hp, dp))
    _wait(ctl, ctl.backup(_slots([1, 2]), _slots([0, 1])))
    _wait(ctl, ctl.load(_slots([0, 1]), _slots([3, 4])))
    assert planned_on == ["hicache-write", "hicache-load"]
    plan, done = ctl.plan_later(_slots([2]), _slots([1])), []  # host page 2 <- device page 1
    for lid in range(pool.layer_num):
        ctl.backup_layer(0, lid, _slots([1]), _slots([2]), None, done.append, plan)
    ctl.wait_idle()
    assert done == [None] * pool.layer_num and planned_on[2:] == ["hicache-write"]
    with pytest.raises(ValueError, match="one device page per host page"):
        ctl.backup(_slots([1, 2]), _slots([0]))
    ctl.shutdown()


def test_no_getter_reads_a_layer_before_its_load():
    """Loads are held at a gate per layer: every getter of layer i (MLA KV and index K) blocks until
    layer i is released, and then sees the loaded bytes."""
    pool = nsa_pool()
    _fill(pool, 4)
    host = HostKVPool(pool, 16)
    ctl = HiCacheController([(pool, host)])
    _wait(ctl, ctl.backup(_slots([1]), _slots([0])))
    want = _pages_of(pool, 1, [1])
    for b in pool.kv_buffer + pool.index_k_with_scale_buffer:
        b.zero_()
    gates = [threading.Event() for _ in range(4)]
    ctl.layer_load_delay_s = lambda lid: gates[lid].wait(300)  # held until the test opens it
    ctl.load(_slots([0]), _slots([1]))
    getters = {
        "get_key_buffer": lambda: pool.get_key_buffer(1)[P : 2 * P].clone(),
        "get_kv_store_buffer": lambda: pool.get_kv_store_buffer(1)[P : 2 * P].clone(),
        "get_kv_pages": lambda: pool.get_kv_pages(1, torch.tensor([1])).clone(),
        "get_index_k_buffer": lambda: pool.get_index_k_buffer(1)[1].clone(),
        "get_index_k_store_buffer": lambda: pool.get_index_k_store_buffer(1)[1].clone(),
        "get_index_k_pages": lambda: pool.get_index_k_pages(1, torch.tensor([1])).clone(),
        "page_payloads": lambda: pool.page_payloads(1)[1].buffer[1].clone(),
    }
    results, threads = {}, []
    for name, fn in getters.items():
        t = threading.Thread(target=lambda n=name, f=fn: results.__setitem__(n, f()))
        t.start()
        threads.append(t)
    gates[0].set()
    for t in threads:
        t.join(0.2)
    assert not results, f"read layer 1 before its load: {sorted(results)}"
    gates[1].set()
    for t in threads:
        t.join(30)
    assert sorted(results) == sorted(getters)
    assert torch.equal(results["get_kv_pages"], want["kv"].view(1, P, -1))
    assert torch.equal(results["get_index_k_pages"], want["index_k"])
    assert float(results["get_key_buffer"].abs().sum()) > 0
    for g in gates[2:]:
        g.set()
    ctl.wait_idle()
    ctl.poll()
    assert pool.layer_transfer_counter is None


def test_trace_and_failure_reports():
    pool = nsa_pool(index_layer_ids=(0,))
    _fill(pool, 5)
    ctl = HiCacheController([(pool, HostKVPool(pool, 16))])
    events = []

    class Trace:
        def record(self, event, fingerprint, layer_id, payload, tensor):
            events.append((event, fingerprint, layer_id, payload, tuple(tensor.shape)))

    ctl.trace = Trace()
    _wait(ctl, ctl.backup(_slots([1]), _slots([2]), page_keys=["k1"]))
    _wait(ctl, ctl.load(_slots([2]), _slots([3]), page_keys=["k1"]))
    backups = [e for e in events if e[0] == "backup"]
    loads = [e for e in events if e[0] == "load"]
    assert len(backups) == len(loads) == 5  # 4 layers of KV + index K on layer 0
    assert all(e[1] == (2, "k1") for e in events)
    ctl.trace = None
    ctl.backup_fault = lambda lid: lid == 2
    op = ctl.backup(_slots([1]), _slots([0]))
    ctl.wait_idle()
    assert [o.id for o in ctl.poll()] == [op.id] and "injected backup fault" in str(op.error)


@pytest.mark.skipif(DEVICE != "cuda", reason="queued vs landed copies exist only with CUDA streams")
@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
def test_load_queues_every_layer_before_the_device_runs_it(io_backend):
    """A layer-wise load only queues copies: while the compute stream is still busy with work queued
    before the load (which its copies wait for), the load thread has already queued every layer, so
    the forward's layer i waits on the device for layer i's copy alone. (Fails on a copy path that
    syncs the host per layer, e.g. a pageable page-list upload: it would wait for the busy stream.)"""
    pool = nsa_pool()
    _fill(pool, 6)
    ctl = HiCacheController([(pool, HostKVPool(pool, 16))], io_backend)
    _wait(ctl, ctl.backup(_slots([1, 2]), _slots([0, 3])))
    _wait(ctl, ctl.load(_slots([0, 3]), _slots([5, 9])))  # warm-up (kernel compile, staging)
    torch.cuda._sleep(int(1e10))  # several seconds of GPU time on the compute stream
    busy = torch.cuda.Event()
    busy.record()
    op = ctl.load(_slots([0, 3]), _slots([6, 7]))
    with ctl._cv:
        queued = ctl._cv.wait_for(lambda: op.progress[0] == pool.layer_num or op.done, timeout=60)
    assert queued and not busy.query(), "the load thread waited for the device before queuing its layers"
    _wait(ctl, op)
    for lid in range(pool.layer_num):
        for p in pool.page_payloads(lid):
            assert torch.equal(p.buffer[torch.tensor([6, 7])].cpu(), p.buffer[torch.tensor([1, 2])].cpu())
