"""Pieces both PD schedulers share: the transfer endpoint over this server's pools, and the
control sockets."""

from __future__ import annotations

import os
import socket

import zmq

from sglang.srt.disaggregation.kv_layout import PoolsDesc, describe_pools
from sglang.srt.disaggregation.transfer import TransferBackend, TransferWorker, create_backend
from sglang.srt.utils.ipc import get_zmq_socket

# Seconds a prefill request waits for any decode server to announce it (Handshake) before it fails;
# a preallocated decode request waits this long for its KV (and an abort for the prefill's answer).
BOOTSTRAP_TIMEOUT_S = float(os.environ.get("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "120"))
# A PD scheduler whose step made no progress (requests wait for the other server, or for memory)
# sleeps this long on its sockets -- the tokenizer's, the other server's messages, the transfer
# thread's wake-up pipe -- instead of spinning; any of them ends the wait at once.
STALL_POLL_MS = 50


def local_host() -> str:
    return os.environ.get("SGLANG_DISAGGREGATION_HOST", "127.0.0.1")


class TransferEndpoint:
    """This rank's transfer backend with every pool buffer registered; a sender's writes run on
    its `TransferWorker` thread."""

    def __init__(self, backend_name: str, worker, sender: bool = False, on_done=None) -> None:
        self.desc: PoolsDesc = describe_pools(worker.kv_pools())
        self.backend: TransferBackend = create_backend(backend_name, local_host())
        for t in self.desc.tensors:
            self.backend.register_tensor(t)
        self.worker = TransferWorker(self.backend, on_done) if sender else None
        self.bytes_moved = 0
        self.pages_moved = 0
        self.ops = 0
        self.seconds = 0.0  # in backend.write (this rank)


class PushSockets:
    """One PUSH socket per peer address (created on first use)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx, self.socks = ctx, {}

    def send(self, addr: str, msg) -> None:
        sock = self.socks.get(addr)
        if sock is None:
            sock = self.socks[addr] = get_zmq_socket(self.ctx, zmq.PUSH, addr, False)
        sock.send_pyobj(msg)


def drain(sock: zmq.Socket, timeout_ms: int = 0) -> list:
    msgs = []
    if timeout_ms and not sock.poll(timeout_ms):
        return msgs
    while True:
        try:
            msgs.append(sock.recv_pyobj(zmq.NOBLOCK))
        except zmq.ZMQError:
            return msgs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
