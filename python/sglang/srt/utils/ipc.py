"""IPC plumbing: per-server ZMQ endpoints (never hard-coded), sockets, process hygiene."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import tempfile
import threading
from dataclasses import dataclass

import zmq


@dataclass(frozen=True)
class PortArgs:
    tokenizer_ipc_name: str  # scheduler + detokenizer -> tokenizer manager
    scheduler_input_ipc_name: str  # tokenizer manager -> scheduler (rank 0)
    detokenizer_ipc_name: str  # scheduler -> detokenizer
    dist_init_method: str  # torch.distributed rendezvous for TP ranks

    @classmethod
    def init_new(cls) -> "PortArgs":
        d = tempfile.mkdtemp(prefix="sglang-ipc-")
        return cls(
            tokenizer_ipc_name=f"ipc://{d}/tokenizer",
            scheduler_input_ipc_name=f"ipc://{d}/scheduler",
            detokenizer_ipc_name=f"ipc://{d}/detokenizer",
            dist_init_method=f"tcp://127.0.0.1:{free_port()}",
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_zmq_socket(context: zmq.Context, socket_type: int, endpoint: str, bind: bool) -> zmq.Socket:
    sock = context.socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)
    if socket_type in (zmq.PUSH, zmq.PUB):
        sock.setsockopt(zmq.SNDHWM, 0)
    if socket_type in (zmq.PULL, zmq.SUB):
        sock.setsockopt(zmq.RCVHWM, 0)
    (sock.bind if bind else sock.connect)(endpoint)
    return sock


def stop_event_on_sigterm() -> threading.Event:
    """An event SIGTERM sets (the launcher's request to stop): the process's loop checks it and
    exits 0 at a point it chooses, instead of dying mid-step by the signal's default action."""
    event = threading.Event()
    signal.signal(signal.SIGTERM, lambda _sig, _frame: event.set())
    return event


def kill_itself_when_parent_died() -> None:
    """Children die with the server: PR_SET_PDEATHSIG on Linux, a ppid watcher elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        return
    except OSError:
        pass
    parent = os.getppid()

    def watch() -> None:
        import time

        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(1)

    threading.Thread(target=watch, daemon=True).start()
