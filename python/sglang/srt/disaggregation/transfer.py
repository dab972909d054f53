"""The PD data plane: write byte ranges of local registered memory into a peer's registered memory.

One interface (`TransferBackend`) so another engine (NIXL, ...) can plug in: `session_id` names
this endpoint to peers, `register_tensor(t)` exposes a region (a KV buffer), `export()` is what a peer
needs besides the session id to reach those regions (None for engines with their own handshake),
`connect(peer, exported)` takes it on the writer's side, and `write(peer, srcs, dsts, lens)` copies
synchronously and raises `TransferError` on failure (a dead peer), so the caller can free its pages
and fail the request instead of hanging.

`TransferWorker` runs the writes on a thread of their own, so a scheduler never waits on the
network: the engines release the GIL while they copy. A write is idempotent (the same bytes to the
same addresses), so a failed one is retried whole: backpressure (`TransferBusy`) until
`BUSY_RETRY_S`, any other failure `TRANSFER_RETRIES` times, with exponential backoff; only then is
it reported, and the caller frees both sides.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import itertools
import logging
import os
import pickle
import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

TRANSFER_RETRIES = int(os.environ.get("SGLANG_DISAGGREGATION_TRANSFER_RETRIES", "3"))
BUSY_RETRY_S = float(os.environ.get("SGLANG_DISAGGREGATION_TRANSFER_BUSY_S", "60"))
# Ranges one Mooncake write keeps submitted at once: its TCP lanes reject what exceeds their
# per-peer queue ("TCP lane queue-full", ~1K) and can then stay wedged for that peer.
MOONCAKE_MAX_INFLIGHT = int(os.environ.get("SGLANG_MOONCAKE_MAX_INFLIGHT", "256"))


class TransferError(RuntimeError):
    """A write failed; it moved some, all or none of its bytes."""


class TransferBusy(TransferError):
    """Backpressure: the engine refused the write for now (a full queue); retry it later."""


class TransferBackend(ABC):
    session_id: str

    @abstractmethod
    def register(self, ptr: int, nbytes: int) -> None: ...

    def register_tensor(self, t: torch.Tensor) -> None:
        self.register(t.data_ptr(), t.numel() * t.element_size())

    def export(self) -> bytes | None:
        return None

    def connect(self, peer: str, exported: bytes | None) -> None:
        pass

    @abstractmethod
    def write(self, peer: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None: ...

    def close(self) -> None:
        pass


_FAKE_PEERS: dict[str, "FakeBackend"] = {}
_fake_ids = itertools.count()
_fake_lock = threading.Lock()


@dataclass
class FakeFaults:
    """Failures the fake backend injects (tests): the next `busy` writes raise TransferBusy (a full
    queue), the next `fail` writes raise TransferError after copying half their ranges (a torn
    write); `fail_always` fails every write."""

    busy: int = 0
    fail: int = 0
    fail_always: bool = False
    writes: int = 0  # attempted writes, failed ones included

    def take(self) -> str | None:
        with _fake_lock:
            self.writes += 1
            if self.busy > 0:
                self.busy -= 1
                return "busy"
            if self.fail > 0 or self.fail_always:
                self.fail = max(self.fail - 1, 0)
                return "fail"
        return None


FAKE_FAULTS = FakeFaults()


class FakeBackend(TransferBackend):
    """In-process endpoints (tests only): a write is a memmove, checked against the peer's
    registered regions so a wrong address fails loudly instead of corrupting memory; `FAKE_FAULTS`
    injects backpressure and failures."""

    def __init__(self, hostname: str = "127.0.0.1") -> None:
        with _fake_lock:
            self.session_id = f"fake:{next(_fake_ids)}"
            _FAKE_PEERS[self.session_id] = self
        self.regions: list[tuple[int, int]] = []

    def register(self, ptr: int, nbytes: int) -> None:
        self.regions.append((ptr, ptr + nbytes))

    def register_tensor(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu":  # memmove of a device address segfaults the process
            raise ValueError(f"the fake transfer backend copies host memory; got a {t.device} tensor")
        super().register_tensor(t)

    def _check(self, ptr: int, n: int) -> bool:
        return any(lo <= ptr and ptr + n <= hi for lo, hi in self.regions)

    def write(self, peer: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        dst = _FAKE_PEERS.get(peer)
        if dst is None:
            raise TransferError(f"fake transfer peer {peer} is gone")
        fault = FAKE_FAULTS.take()
        if fault == "busy":
            raise TransferBusy(f"fake transfer to {peer}: queue full")
        ranges = list(zip(srcs, dsts, lens))
        for i, (s, d, n) in enumerate(ranges):
            if fault == "fail" and i >= len(ranges) // 2:
                raise TransferError(f"fake transfer to {peer} failed after {i} of {len(ranges)} ranges")
            if not (self._check(s, n) and dst._check(d, n)):
                raise TransferError(f"fake transfer of {n} bytes outside the registered regions")
            ctypes.memmove(d, s, n)
        if fault == "fail":
            raise TransferError(f"fake transfer to {peer} failed")

    def close(self) -> None:
        _FAKE_PEERS.pop(self.session_id, None)


class MooncakeBackend(TransferBackend):
    """Mooncake Transfer Engine in P2P-handshake mode (no metadata server): the session id is
    host:rpc_port; protocol tcp on CPU machines, rdma where NICs exist.

    A write keeps at most MOONCAKE_MAX_INFLIGHT ranges submitted (more overflow the TCP lanes'
    per-peer queue). After a failed write the engine is replaced by a fresh one with the same
    registrations: Mooncake 0.3.13's TCP lanes can stay wedged after a queue-full (every later write
    to that peer fails, the decode server had to be restarted), and a fresh engine opens new lanes.
    Only writers replace their engine, so a receiver's session id (sent in Register) never changes."""

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "") -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise ImportError("--disaggregation-transfer-backend mooncake needs the Mooncake transfer engine: "
                              "pip install mooncake-transfer-engine (mooncake-transfer-engine-non-cuda on CPU "
                              f"machines; it needs libibverbs1 librdmacm1 libnuma1) ({e})") from None
        self._engine_cls, self._init = TransferEngine, (hostname, "P2PHANDSHAKE", protocol, device_name)
        self.regions: list[tuple[int, int]] = []
        self.resets = 0
        self.engine = self._new_engine()
        self.session_id = f"{hostname}:{self.engine.get_rpc_port()}"

    def _new_engine(self):
        engine = self._engine_cls()
        rc = engine.initialize(*self._init)
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize failed ({rc})")
        for ptr, nbytes in self.regions:
            if engine.register_memory(ptr, nbytes) != 0:
                raise RuntimeError(f"Mooncake register_memory failed on a new engine ({ptr:#x}, {nbytes} bytes)")
        return engine

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self.engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory failed ({rc})")
        self.regions.append((ptr, nbytes))

    def _reset(self) -> None:
        """Destroy the engine (~1 s, wedged or not: its lanes close, so nothing it still holds can
        land late in pages the decode side reuses once the failure is reported), then a new one."""
        try:
            engine = self._new_engine()
        except RuntimeError as e:  # keep the old one: the next write fails and retries again
            logger.error("Mooncake engine reset failed: %s", e)
            return
        old, self.engine, self.resets = self.engine, engine, self.resets + 1
        del old
        logger.warning("Mooncake transfer engine replaced after a failed write (%d so far)", self.resets)

    def write(self, peer: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        """Submit the ranges, at most MOONCAKE_MAX_INFLIGHT at a time, and poll with short naps.
        Mooncake's own waits (batch_transfer_sync_write, get_batch_transfer_status) spin on a core
        for the whole copy, which on a small host takes CPU from the engine's I/O threads."""
        if not srcs:
            return
        error = self._submit_windowed(peer, list(zip(srcs, dsts, lens)), deadline=time.monotonic() + 30.0 +
                                      sum(lens) / 1e9)  # like Mooncake's sync write
        if error:
            self._reset()
            raise TransferError(error)

    def _submit_windowed(self, peer: str, ranges: list[tuple[int, int, int]], deadline: float) -> str | None:
        """The first failure's message, or None. After a failure nothing more is submitted, and what
        was is waited for (never free pages still being read)."""
        pending: list[int] = []
        error, i = None, 0
        while i < len(ranges) or pending:
            while error is None and i < len(ranges) and len(pending) < MOONCAKE_MAX_INFLIGHT:
                s, d, n = ranges[i]
                bid = self.engine.transfer_submit_write(peer, s, d, n)
                if bid in (0, -1, (1 << 64) - 1):
                    error = f"Mooncake could not submit a transfer to {peer}"
                    break
                pending.append(bid)
                i += 1
            if error is not None:
                i = len(ranges)
            left = []
            for bid in pending:
                rc = self.engine.transfer_check_status(bid)  # 1 done, 0 running, -1 failed, -2 timed out
                if rc == 0 or (rc == -2 and time.monotonic() < deadline):
                    left.append(bid)
                elif rc != 1:
                    error = error or f"Mooncake transfer to {peer} failed ({rc})"
            pending = left
            if pending and time.monotonic() > deadline:
                return error or f"Mooncake transfer to {peer} timed out"
            if pending:
                time.sleep(2e-4)  # ~3% of a 10 MB copy at most; 5k wake-ups/s cost little CPU
        return error


class _Regions:
    """Registered regions as uint8 tensors, found by address (sorted starts, no overlaps)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.views: list[torch.Tensor] = []

    def add(self, ptr: int, view: torch.Tensor) -> None:
        i = bisect.bisect(self.starts, ptr)
        self.starts.insert(i, ptr)
        self.views.insert(i, view)

    def slice(self, ptr: int, n: int) -> torch.Tensor:
        i = bisect.bisect(self.starts, ptr) - 1
        if i < 0 or ptr + n > self.starts[i] + self.views[i].numel():
            raise TransferError(f"{n} bytes at {ptr:#x} are outside the registered regions")
        off = ptr - self.starts[i]
        return self.views[i][off:off + n]


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class CudaIpcBackend(TransferBackend):
    """Servers on one host's GPUs (two processes on one GPU too): the receiver exports CUDA IPC
    handles of its KV buffers, the writer maps them once per peer and copies device to device on a
    stream of its own (NVLink / the GPU's own memory, no host bounce)."""

    def __init__(self, hostname: str = "127.0.0.1") -> None:
        import os
        import uuid

        self.session_id = f"cuda_ipc:{hostname}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.local = _Regions()
        self.tensors: list[torch.Tensor] = []
        self.peers: dict[str, _Regions] = {}
        self.stream = None

    def register(self, ptr: int, nbytes: int) -> None:
        raise TypeError("CudaIpcBackend exposes tensors: use register_tensor")

    def register_tensor(self, t: torch.Tensor) -> None:
        if t.device.type != "cuda":
            raise ValueError("--disaggregation-transfer-backend cuda_ipc needs the KV pools on a CUDA device")
        self.local.add(t.data_ptr(), _byte_view(t))
        self.tensors.append(t)

    def export(self) -> bytes:
        from torch.multiprocessing.reductions import reduce_tensor

        return pickle.dumps([(t.data_ptr(), reduce_tensor(_byte_view(t))) for t in self.tensors])

    @staticmethod
    def _open(exported: bytes) -> list[tuple[int, torch.Tensor]]:
        """(the peer's address, this process's mapping) of every exported buffer."""
        return [(ptr, rebuild(*args)) for ptr, (rebuild, args) in pickle.loads(exported)]

    def connect(self, peer: str, exported: bytes | None) -> None:
        if peer in self.peers:
            return
        if exported is None:
            raise TransferError(f"peer {peer} exported no CUDA IPC handles (--disaggregation-transfer-backend must "
                                "match on both servers)")
        regions = _Regions()
        for ptr, view in self._open(exported):
            regions.add(ptr, view)
        self.peers[peer] = regions

    def write(self, peer: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        remote = self.peers.get(peer)
        if remote is None:
            raise TransferError(f"CUDA IPC peer {peer} is not connected")
        if not srcs:
            return
        first = self.local.slice(srcs[0], lens[0])
        if first.device.type == "cuda" and self.stream is None:
            self.stream = torch.cuda.Stream(first.device)
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with ctx:
            for s, d, n in zip(srcs, dsts, lens):
                remote.slice(d, n).copy_(self.local.slice(s, n), non_blocking=True)
        if self.stream is not None:
            self.stream.synchronize()


@dataclass
class TransferTask:
    """One request's writes on one rank; `done` is set when they finished (`error` None) or failed."""

    room: int
    peer: str
    srcs: list[int]
    dsts: list[int]
    lens: list[int]
    ready: object | None = None  # a CUDA event recorded after the forward that wrote the pages
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    seconds: float = 0.0  # inside backend.write, retries included
    retries: int = 0

    @property
    def nbytes(self) -> int:
        return sum(self.lens)


class TransferWorker:
    """A thread that runs a backend's writes in submission order, retrying failed ones (module
    docstring); `on_done(task)` runs on this thread after each task ends (a scheduler's wake-up)."""

    def __init__(self, backend: TransferBackend, on_done=None) -> None:
        self.backend, self.on_done = backend, on_done
        self.retries = 0  # writes retried, since start
        self._q: queue.SimpleQueue[TransferTask | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pd-transfer", daemon=True)
        self._thread.start()

    def submit(self, task: TransferTask) -> TransferTask:
        self._q.put(task)
        return task

    def _run(self) -> None:
        while (task := self._q.get()) is not None:
            try:
                if task.ready is not None:
                    task.ready.synchronize()
                t0 = time.perf_counter()
                self._write(task)
                task.seconds = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 -- any failure fails this request, never the thread
                task.error = f"{type(e).__name__}: {e}" if not isinstance(e, TransferError) else str(e)
            task.done.set()
            if self.on_done is not None:
                self.on_done(task)

    def _write(self, task: TransferTask) -> None:
        busy_until, failures = None, 0
        while True:
            try:
                return self.backend.write(task.peer, task.srcs, task.dsts, task.lens)
            except TransferError as e:
                now = time.monotonic()
                if isinstance(e, TransferBusy):
                    busy_until = busy_until or now + BUSY_RETRY_S
                    if now >= busy_until:
                        raise TransferError(f"{e} (still busy after {BUSY_RETRY_S:.0f}s of retries)") from None
                else:
                    failures += 1
                    if failures > TRANSFER_RETRIES:
                        raise TransferError(f"{e} (after {TRANSFER_RETRIES} retries)") from None
                task.retries += 1
                self.retries += 1
                log = logger.debug if isinstance(e, TransferBusy) else logger.warning
                log("PD transfer for room %d failed (%s): retry %d", task.room, e, task.retries)
                time.sleep(min(0.01 * 2 ** min(task.retries, 7), 1.0))

    def close(self) -> None:
        self._q.put(None)


def create_backend(name: str, hostname: str = "127.0.0.1") -> TransferBackend:
    if name == "fake":
        return FakeBackend(hostname)
    if name == "mooncake":
        return MooncakeBackend(hostname)
    if name == "cuda_ipc":
        return CudaIpcBackend(hostname)
    raise ValueError(f"unknown disaggregation transfer backend {name!r}")


def mooncake_import_error() -> str | None:
    """Why the mooncake backend cannot start here (None when it can): checked at start-up."""
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as e:
        return (f"mooncake needs the 'mooncake-transfer-engine' package (mooncake-transfer-engine-non-cuda on "
                f"CPU machines), which is not importable: {e}")
    return None
