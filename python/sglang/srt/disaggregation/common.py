"""Pieces both PD schedulers share: the transfer endpoint over this server's pools, and the
control sockets."""

from __future__ import annotations

import os
import socket

import torch
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


def server_pools(worker) -> dict:
    """The KV pools that move: the target's, and the draft's with speculative decoding (target and
    draft share request slots, so one page list addresses both)."""
    pools = {"target": worker.model_runner.token_to_kv_pool}
    draft = getattr(worker, "draft_runner", None)
    if draft is not None:
        pools["draft"] = draft.token_to_kv_pool
    return pools


def spec_state(worker, slot: int) -> tuple[int, bytes] | None:
    """The per-request state an EAGLE worker keeps after a prefill (its first proposal d1 and the
    draft's last hidden state), which the decode side's worker needs before its first verify."""
    if not hasattr(worker, "next_draft"):
        return None
    hidden = worker.draft_hidden[slot].detach().to("cpu").contiguous()
    return int(worker.next_draft[slot]), hidden.view(torch.uint8).numpy().tobytes()


def set_spec_state(worker, slot: int, kv_len: int, state: tuple[int, bytes] | None) -> None:
    if not hasattr(worker, "next_draft"):
        return
    if state is None:
        raise RuntimeError("the prefill server sent no draft state: --speculative-algorithm must match on both")
    draft, raw = state
    hidden = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(worker.draft_hidden.dtype)
    worker.kv_len[slot] = kv_len
    worker.next_draft[slot] = draft
    worker.draft_hidden[slot] = hidden.to(worker.draft_hidden.device)


class TransferEndpoint:
    """This rank's transfer backend with every pool buffer registered; a sender's writes run on
    its `TransferWorker` thread."""

    def __init__(self, backend_name: str, worker, sender: bool = False, on_done=None) -> None:
        self.desc: PoolsDesc = describe_pools(server_pools(worker))
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
