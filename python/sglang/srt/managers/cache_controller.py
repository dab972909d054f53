"""HiCacheController: moves KV pages between the device pools and their host mirrors.

Two background threads (and, on CUDA, one stream each) run the queued transfers:
- writes (device -> host backup): whole-op backups (all layers, after a forward) and per-layer
  backups enqueued by the pools' layer-end hooks (async backup, `managers/hicache_backup.py`);
- loads (host -> device), layer-wise: the controller registers a per-pool `LayerTransferCounter`
  on the target (and draft) pool while a load is in flight, so layer i of the forward waits only
  for layer i's copy -- MLA KV *and* index K, since every pool getter calls `_wait_layer`.
  On CUDA the wait is `current_stream.wait_event(...)` after the copy is enqueued (no host sync
  with the device); on CPU the copy itself is done when the wait returns.

Each transfer covers every (device pool, host pool) pair: the target's and, with EAGLE, the draft's
(same host slots). A layer moves exactly the payloads its pool names (`page_payloads`): MLA KV on
every layer, index K only on IndexCache "full" layers (the index-layer map is validated when the
pair is registered). The scheduler thread acknowledges finished ops with `poll()`; the radix tree
frees host pages only after the load that reads them is acknowledged.

Interfaces for the other parts of issue 20 (stable; None = off, no cost on the copy path):
- `trace`: an object with `record(event, fingerprint, layer_id, payload, tensor)` (the KV trace,
  `sglang.srt.debug.kv_trace`), called per page after a backup ("backup") and a load ("load")
  with `fingerprint = (host_page, content_key)`; content_key is the op's per-page prefix hash when
  the caller gave one (`page_keys`), else None. `tensor` is the page's host row of that payload.
- `on_backup_done(host_pages, layer_id, payload_name, tensor)` / `on_load_done(...)`: optional
  callables after each layer/payload copy (`tensor` = the host rows of those pages).
- `storage`: the L3 tier (`sglang.srt.mem_cache.storage.tier.StorageTier`), None by default.
  `store()` queues an L3 write of committed host pages on the write thread (op kind "store"); the
  radix tree reads the tier on a host miss at admission, inside `tree_cache.match_for_admission()`
  (the scheduler's one admission match; HiRadixCache reads L3 there, then starts the load-back).
- With `SGLANG_CP_HICACHE_KV_TRACE` >= 1 `trace` is the KV tracer's adapter
  (`debug.kv_trace.HiCacheTrace`): at backup it hashes the host rows just written, at load the
  device rows just written (so a corrupted host copy and a broken copy both show).
`--hicache-io-backend`: direct = one cudaMemcpyAsync per run of consecutive host pages per layer and
payload, scattered device pages through a staging buffer (`mem_cache/hicache_io.py`); kernel = one
Triton launch per layer and payload (`sgl_kernel.page_copy`) reading / writing the pinned host
mirror through its mapped pointer (GPU only; on CPU it runs under the Triton interpreter in tests).
Either way an op's page lists are planned and uploaded once (`PageRuns`), on the copy thread (the
scheduler thread only cuts the slots into pages: a plan costs it ~0.3 ms per op on an H100 host),
copies are queued without a host sync, and the copy thread waits only at the end of an op (or of a
layer's backup; layer-end backups share one plan per forward, made by the backup reservation).
Test hooks: `layer_load_delay_s` (seconds, or a callable(layer_id)) delays each layer's load;
`backup_fault` (callable(layer_id) -> bool) makes a backup of that layer fail.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import torch

from sglang.srt.mem_cache import hicache_io
from sglang.srt.mem_cache.cp_page_map import page_owner, physical_page
from sglang.srt.mem_cache.hicache_io import PageRuns
from sglang.srt.mem_cache.hicache_transfer import TransferOp
from sglang.srt.mem_cache.memory_pool import KVCache
from sglang.srt.mem_cache.memory_pool_host import HostKVPool

logger = logging.getLogger(__name__)

HAND_OVER_S = 0.002  # at most this long does load() wait for its copy thread to start


class _PoolCounter:
    """The LayerTransferCounter of one pool (pair index): waits for every in-flight load's layer."""

    def __init__(self, controller: "HiCacheController", pair: int) -> None:
        self.controller, self.pair = controller, pair

    def wait_until(self, layer_id: int) -> None:
        self.controller.wait_layer(self.pair, layer_id)


class _CopyThread:
    """A daemon thread running callables in order (one per direction, so a backup never delays a load),
    on its own CUDA stream when given one: the thread enters the stream (and its device: a new thread's
    current device is 0, wrong for a rank on cuda:1) once, not per op (two context managers per op
    cost ~50-100 us of a slow host's Python, on the path of every load)."""

    def __init__(self, name: str, stream: "torch.cuda.Stream | None" = None) -> None:
        self.q: queue.Queue = queue.Queue()
        self.stream = stream
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        self.q.put(fn)

    def _loop(self) -> None:
        if self.stream is None:
            self._serve()
            return
        with torch.cuda.device(self.stream.device), torch.cuda.stream(self.stream):
            self._serve()

    def _serve(self) -> None:
        while True:
            fn = self.q.get()
            if fn is None:
                return
            fn()

    def stop(self) -> None:
        self.q.put(None)


class PagePlan:
    """A transfer's (host, device) pages, checked when made; its PageRuns are made on first use, on
    the copy thread (the layer-end backups of one forward share one)."""

    def __init__(self, controller: "HiCacheController", hp: torch.Tensor, dp: torch.Tensor) -> None:
        self._controller, self._pages, self._runs = controller, (hp, dp), None

    def get(self) -> PageRuns:
        if self._runs is None:  # only the write thread calls this: no lock needed
            self._runs = self._controller._plan_pages(*self._pages)
        return self._runs


class HiCacheController:
    def __init__(self, pairs: list[tuple[KVCache, HostKVPool]], io_backend: str = "direct",
                 cp_rank: int = 0, cp_size: int = 1) -> None:
        """`cp_rank` / `cp_size`: under CP with shared KV the slots given to transfers are logical;
        this rank moves only the pages it owns (cp_page_map), at their physical index in its pool."""
        if io_backend not in ("direct", "kernel"):
            raise ValueError(f"hicache io backend {io_backend!r} is not one of direct, kernel")
        self.io_backend = io_backend
        if io_backend == "kernel":
            from sgl_kernel.page_copy import copy_pages

            self._copy_pages = copy_pages
        for dev, host in pairs:
            host.check_device_pool(dev)
        self.pairs = pairs
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.page_size = pairs[0][1].page_size
        widest = max(max(h.layout_info.kv_bytes_per_page, h.layout_info.index_k_bytes_per_page) for _, h in pairs)
        self.max_staged_pages = max(1, hicache_io.STAGING_BYTES // widest)
        self.use_cuda = any(torch.device(d.device).type == "cuda" for d, _ in pairs)
        self._cv = threading.Condition()
        self._loads: list[TransferOp] = []  # in flight (not yet acknowledged)
        self._finished: list[TransferOp] = []  # done, waiting for poll()
        self._counters = [_PoolCounter(self, i) for i in range(len(pairs))]
        self._counters_on = False
        self._unacked = 0  # ops submitted, not yet returned by poll (scheduler thread only)
        self._load_stream = torch.cuda.Stream() if self.use_cuda else None
        self._write_stream = torch.cuda.Stream() if self.use_cuda else None
        self._load_thread = _CopyThread("hicache-load", self._load_stream)
        self._write_thread = _CopyThread("hicache-write", self._write_stream)
        # a load's staged scatters (direct io, device pages not consecutive) run beside its copies
        self._scatter_stream = torch.cuda.Stream() if self.use_cuda else None
        self.trace = None
        self.storage = None
        self.on_backup_done: Callable | None = None
        self.on_load_done: Callable | None = None
        self.layer_load_delay_s: float | Callable[[int], None] | None = None
        self.backup_fault: Callable[[int], bool] | None = None
        self.hand_over_loads = True  # load(): wait for the load thread to start (off: bench_handoff's baseline)

    # -- submission (scheduler thread) ----------------------------------------------------------------
    def _pages(self, slots: torch.Tensor) -> torch.Tensor:
        if slots.numel() % self.page_size:
            raise ValueError(f"transfers move whole pages: {slots.numel()} slots, page {self.page_size}")
        return slots.reshape(-1, self.page_size)[:, 0].to("cpu", torch.int64) // self.page_size

    def _local(self, hp: torch.Tensor, dp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(host pages, device pages in this rank's pool) of the logical pages this rank stores."""
        if self.cp_size == 1:
            return hp, dp
        mine = page_owner(dp, self.cp_size) == self.cp_rank
        return hp[mine], physical_page(dp[mine], self.cp_size)

    def plan(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> PageRuns:
        """The page runs this rank copies for these slots (host and device slots in the same order)."""
        return self._plan_pages(*self._page_pair(host_indices, device_indices))

    def plan_later(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> PagePlan:
        """`plan` deferred to the copy thread that first needs it (checked now, planned there)."""
        return PagePlan(self, *self._page_pair(host_indices, device_indices))

    def _page_pair(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(host pages, device pages) of a transfer, checked on the submitting thread (a bad request
        raises there); the run plan itself is made on the copy thread (`_plan_pages`)."""
        hp, dp = self._pages(host_indices), self._pages(device_indices)
        if hp.numel() != dp.numel():
            raise ValueError(f"one device page per host page: {hp.numel()} vs {dp.numel()}")
        return hp, dp

    def _plan_pages(self, hp: torch.Tensor, dp: torch.Tensor) -> PageRuns:
        return PageRuns(*self._local(hp, dp), self.max_staged_pages)

    def _compute_event(self):
        """An event on the compute stream now: copies wait for the work queued so far."""
        if not self.use_cuda:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor, page_keys: list | None = None,
             on_done: Callable[[TransferOp], None] | None = None) -> TransferOp:
        """Queue a layer-wise host -> device load; getters of the pools wait per layer until it lands."""
        t0 = time.perf_counter()
        self._unacked += 1
        op = TransferOp("load", host_indices, device_indices, page_keys, on_done=on_done)
        op.progress = [0] * len(self.pairs)
        op.events = [[None] * dev.layer_num for dev, _ in self.pairs]
        pages = self._page_pair(host_indices, device_indices)
        op.timeline["submit"] = t0
        ready = self._compute_event()
        with self._cv:
            self._loads.append(op)
            if not self._counters_on:  # costs the getters a lock only while loads are in flight
                for (dev, _), c in zip(self.pairs, self._counters):
                    dev.register_layer_transfer_counter(c)
                self._counters_on = True
        started = threading.Event()

        def job() -> None:
            started.set()
            self._run_load(op, pages, ready)

        self._load_thread.submit(job)
        if self.hand_over_loads:
            # The forward about to run waits on this load's first layer. Left to the interpreter, the
            # woken copy thread gets the GIL only when the busy submitting thread is forced to drop it
            # (sys.getswitchinterval(): 5 ms); blocking here lets it plan and queue its copies now
            # (bench_handoff.py: it starts 0.13 ms after submit instead of 5.3; load() returns 0.12 ms later).
            started.wait(HAND_OVER_S)
        return op

    def backup(self, device_indices: torch.Tensor, host_indices: torch.Tensor, page_keys: list | None = None,
               on_done: Callable[[TransferOp], None] | None = None) -> TransferOp:
        """Queue a device -> host backup of every layer of every pair (the device KV is complete)."""
        t0 = time.perf_counter()
        self._unacked += 1
        op = TransferOp("backup", host_indices, device_indices, page_keys, on_done=on_done)
        op.progress = [0] * len(self.pairs)
        pages = self._page_pair(host_indices, device_indices)
        op.timeline["submit"] = t0
        ready = self._compute_event()

        def run() -> None:
            op.timeline["start"] = time.perf_counter()
            try:
                # planned here, not on the scheduler thread: a few hundred us per op there (issue 29)
                runs = self._plan_pages(*pages)
                op.timeline["planned"] = time.perf_counter()
                for i, (dev, host) in enumerate(self.pairs):
                    for layer in range(dev.layer_num):
                        self._copy_to_host(i, layer, runs, op.page_keys)
                op.timeline["queued"] = time.perf_counter()
                self._sync(self._write_stream)
                op.timeline["synced"] = time.perf_counter()
            except BaseException as e:  # reported to the scheduler thread via poll()
                op.error = e
            self._finish(op)

        self._write_thread.submit(lambda: self._on_stream(self._write_stream, ready, run))
        return op

    def backup_layer(self, pair: int, layer_id: int, device_indices: torch.Tensor, host_indices: torch.Tensor,
                     page_keys: list | None, done: Callable[[BaseException | None], None],
                     runs: PagePlan | None = None) -> None:
        """Queue one layer's backup (a layer-end hook); `done(error)` runs on the copy thread. The
        forward thread only records an event here. `runs`: the slots' plan, shared by all layers
        (`plan_later(host_indices, device_indices)`); without it the copy thread plans each layer."""
        ready = self._compute_event()

        def run() -> None:
            err = None
            try:
                plan = runs.get() if runs is not None else self.plan(host_indices, device_indices)
                self._copy_to_host(pair, layer_id, plan, page_keys)
                self._sync(self._write_stream)
            except BaseException as e:
                err = e
            done(err)

        self._write_thread.submit(lambda: self._on_stream(self._write_stream, ready, run))

    def store(self, host_indices: torch.Tensor, page_keys: list[str],
              on_done: Callable[[TransferOp], None] | None = None) -> TransferOp:
        """Queue an L3 write of committed host pages (`storage`) on the write thread, after the
        backups queued before it; the caller keeps the host pages pinned until the op is acked."""
        self._unacked += 1
        op = TransferOp("store", host_indices, torch.empty(0, dtype=torch.int64), page_keys, on_done=on_done)
        pages = self._pages(host_indices)

        def run() -> None:
            try:
                self.storage.store(pages, page_keys)
            except BaseException as e:  # a backend failure loses L3 copies, never host or device KV
                op.error = e
            self._finish(op)

        self._write_thread.submit(run)
        return op

    # -- copy threads ---------------------------------------------------------------------------------
    @staticmethod
    def _on_stream(stream, ready, fn: Callable[[], None]) -> None:
        """Run `fn` on the copy thread (already on `stream`) after the compute work `ready` marks."""
        if stream is not None and ready is not None:
            stream.wait_event(ready)
        fn()

    @staticmethod
    def _sync(stream) -> None:
        if stream is not None:
            stream.synchronize()  # the copy thread waits, never the scheduler

    def _copy_to_host(self, pair: int, layer_id: int, runs: PageRuns, keys) -> None:
        if self.backup_fault is not None and self.backup_fault(layer_id):
            raise RuntimeError(f"injected backup fault at layer {layer_id}")
        dev, host = self.pairs[pair]
        for payload in dev.page_payloads(layer_id):
            dst = host.payload(layer_id, payload.name)
            if self.io_backend == "kernel":  # one launch; the host side through its mapped pointer
                hp_d, dp_d = runs.pages_on(payload.buffer.device)
                self._copy_pages(payload.buffer, dst, dp_d, hp_d)
            else:  # queued on the write stream; the copy thread syncs it, never the forward
                hicache_io.backup_pages(runs, payload.buffer, dst)
            self._observe("backup", self.on_backup_done, runs.host_pages, layer_id, payload.name, dst, keys)

    def _copy_to_device(self, pair: int, layer_id: int, runs: PageRuns, keys) -> None:
        hp, dp = runs.host_pages, runs.device_pages
        dev, host = self.pairs[pair]
        names = host.payload_names(layer_id)
        # The raw buffers, not the waiting getters: this copy is what the getters wait for.
        bufs = {"kv": dev.kv_buffer[layer_id].view(-1, dev.page_size * dev.kv_cache_dim)}
        if "index_k" in names:
            bufs["index_k"] = dev.index_k_with_scale_buffer[dev.index_buffer_id(layer_id)]
        for name in names:
            buf, src = bufs[name], host.payload(layer_id, name)
            if self.io_backend == "kernel":
                hp_d, dp_d = runs.pages_on(buf.device)
                self._copy_pages(src, buf, hp_d, dp_d)
            else:
                hicache_io.load_pages(runs, src, buf, self._scatter_stream)
            if self.trace is not None and self._scatter_stream is not None:
                torch.cuda.current_stream().wait_stream(self._scatter_stream)
            # the trace hashes what landed on the device (a broken copy shows), the hook the host rows
            rows = buf[dp.to(buf.device)] if self.trace is not None else None
            self._observe("load", self.on_load_done, hp, layer_id, name, src, keys, rows)

    def _observe(self, event: str, hook, hp: torch.Tensor, layer_id: int, name: str, host_buf: torch.Tensor,
                 keys, rows: torch.Tensor | None = None) -> None:
        if hook is None and self.trace is None:
            return
        if self.use_cuda and event == "backup":
            torch.cuda.current_stream().synchronize()  # the queued host writes must have landed
        if hook is not None:
            hook(hp, layer_id, name, host_buf[hp])
        if self.trace is not None:
            for j, page in enumerate(hp.tolist()):
                fp = (page, keys[j] if keys is not None else None)
                self.trace.record(event, fp, layer_id, name, host_buf[page] if rows is None else rows[j])

    def _run_load(self, op: TransferOp, pages: tuple[torch.Tensor, torch.Tensor], ready) -> None:
        def run() -> None:
            op.timeline["start"] = time.perf_counter()
            try:
                runs = self._plan_pages(*pages)
                op.timeline["planned"] = time.perf_counter()
                depth = max(dev.layer_num for dev, _ in self.pairs)
                for layer in range(depth):
                    self._delay(layer)
                    for i, (dev, _) in enumerate(self.pairs):
                        if layer >= dev.layer_num:
                            continue
                        self._copy_to_device(i, layer, runs, op.page_keys)
                        if self.use_cuda:  # after the layer's copies and its scatters
                            op.events[i][layer] = hicache_io.ready_after_scatter(self._scatter_stream)
                        with self._cv:
                            op.progress[i] = layer + 1
                            self._cv.notify_all()
                op.timeline["queued"] = time.perf_counter()
                self._sync(self._load_stream)
                self._sync(self._scatter_stream)
                op.timeline["synced"] = time.perf_counter()
            except BaseException as e:
                op.error = e
            self._finish(op)

        self._on_stream(self._load_stream, ready, run)

    def _delay(self, layer_id: int) -> None:
        d = self.layer_load_delay_s
        if d is None:
            return
        if callable(d):
            d(layer_id)
        elif d > 0:
            time.sleep(d)

    def _finish(self, op: TransferOp) -> None:
        op.timeline["finish"] = time.perf_counter()
        with self._cv:
            op.done = True
            if op.kind == "load" and op.error is not None:
                # Release waiters: a failed load must not hang the forward (the cache drops the node).
                op.progress = [dev.layer_num for dev, _ in self.pairs]
            self._finished.append(op)
            self._cv.notify_all()

    # -- the pools' per-layer wait (forward thread) ---------------------------------------------------
    def wait_layer(self, pair: int, layer_id: int) -> None:
        with self._cv:
            while True:
                pending = [op for op in self._loads if op.progress[pair] <= layer_id]
                if not pending:
                    break
                self._cv.wait()
            events = [op.events[pair][layer_id] for op in self._loads if op.events]
        for ev in events:
            if ev is not None:
                torch.cuda.current_stream().wait_event(ev)

    # -- acknowledgement (scheduler thread) -----------------------------------------------------------
    def poll(self) -> list[TransferOp]:
        """Finished ops since the last poll; loads leave the in-flight set here, and the pools'
        counters are unregistered once no load is in flight."""
        with self._cv:
            done, self._finished = self._finished, []
            self._unacked -= len(done)
            for op in done:
                if op.kind == "load":
                    self._loads.remove(op)
            if self._counters_on and not self._loads:
                for dev, _ in self.pairs:
                    dev.register_layer_transfer_counter(None)
                self._counters_on = False
        for op in done:
            if op.on_done is not None:
                op.on_done(op)
        return done

    def wait_done(self, op: TransferOp, timeout: float = 60.0) -> None:
        """Block until `op` has finished (it is acknowledged by the next poll)."""
        with self._cv:
            if not self._cv.wait_for(lambda: op.done, timeout):
                raise TimeoutError(f"HiCache {op.kind} op {op.id} did not finish in {timeout} s")

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Block until both copy threads have drained their queues (tests, flush, shutdown)."""
        deadline = time.monotonic() + timeout
        for t in (self._load_thread, self._write_thread):
            flag = threading.Event()
            t.submit(flag.set)
            if not flag.wait(max(deadline - time.monotonic(), 0.0)):
                raise TimeoutError("HiCache copy thread did not drain")

    def unacked_ops(self) -> int:
        return self._unacked

    def in_flight_loads(self) -> int:
        with self._cv:
            return len(self._loads)

    def shutdown(self) -> None:
        self._load_thread.stop()
        self._write_thread.stop()
