"""The PD data plane: write byte ranges of local registered memory into a peer's registered memory.

One interface (`TransferBackend`) so another engine (NIXL, a GPU IPC copy) can plug in:
`session_id` names this endpoint to peers, `register(ptr, nbytes)` exposes a region (a KV buffer),
`write(peer, srcs, dsts, lens)` copies synchronously and raises `TransferError` on failure (a dead
peer), so the caller can free its pages and fail the request instead of hanging.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from abc import ABC, abstractmethod


class TransferError(RuntimeError):
    pass


class TransferBackend(ABC):
    session_id: str

    @abstractmethod
    def register(self, ptr: int, nbytes: int) -> None: ...

    @abstractmethod
    def write(self, peer: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None: ...

    def close(self) -> None:
        pass


_FAKE_PEERS: dict[str, "FakeBackend"] = {}
_fake_ids = itertools.count()
_fake_lock = threading.Lock()


class FakeBackend(TransferBackend):
    """In-process endpoints (tests only): a write is a memmove, checked against the peer's
    registered regions so a wrong address fails loudly instead of corrupting memory."""

    def __init__(self, hostname: str = "127.0.0.1") -> None:
        with _fake_lock:
            self.session_id = f"fake:{next(_fake_ids)}"
            _FAKE_PEERS[self.session_id] = self
        self.regions: list[tuple[int, int]] = []

    def register(self, ptr: int, nbytes: int) -> None:
        self.regions.append((ptr, ptr + nbytes))

    def _check(self, ptr: int, n: int) -> bool:
        return any(lo <= ptr and ptr + n <= hi for lo, hi in self.regions)

    def write(self, peer: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        dst = _FAKE_PEERS.get(peer)
        if dst is None:
            raise TransferError(f"fake transfer peer {peer} is gone")
        for s, d, n in zip(srcs, dsts, lens):
            if not (self._check(s, n) and dst._check(d, n)):
                raise TransferError(f"fake transfer of {n} bytes outside the registered regions")
            ctypes.memmove(d, s, n)

    def close(self) -> None:
        _FAKE_PEERS.pop(self.session_id, None)


class MooncakeBackend(TransferBackend):
    """Mooncake Transfer Engine in P2P-handshake mode (no metadata server): the session id is
    host:rpc_port; protocol tcp on CPU machines, rdma where NICs exist."""

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "") -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise ImportError("--disaggregation-transfer-backend mooncake needs the Mooncake transfer engine: "
                              "pip install mooncake-transfer-engine (mooncake-transfer-engine-non-cuda on CPU "
                              f"machines; it needs libibverbs1 librdmacm1 libnuma1) ({e})") from None
        self.engine = TransferEngine()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize failed ({rc})")
        self.session_id = f"{hostname}:{self.engine.get_rpc_port()}"

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self.engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory failed ({rc})")

    def write(self, peer: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        if not srcs:
            return
        rc = self.engine.batch_transfer_sync_write(peer, srcs, dsts, lens)
        if rc != 0:
            raise TransferError(f"Mooncake transfer to {peer} failed ({rc})")


def create_backend(name: str, hostname: str = "127.0.0.1") -> TransferBackend:
    if name == "fake":
        return FakeBackend(hostname)
    if name == "mooncake":
        return MooncakeBackend(hostname)
    raise ValueError(f"unknown disaggregation transfer backend {name!r}")


def mooncake_import_error() -> str | None:
    """Why the mooncake backend cannot start here (None when it can): checked at start-up."""
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as e:
        return (f"mooncake needs the 'mooncake-transfer-engine' package (mooncake-transfer-engine-non-cuda on "
                f"CPU machines), which is not importable: {e}")
    return None
