"""Control-plane messages of PD (pickled over ZMQ PUSH/PULL; one dataclass per message)."""

from __future__ import annotations

from dataclasses import dataclass

from sglang.srt.disaggregation.kv_layout import PoolsMeta


@dataclass
class Handshake:
    """decode -> prefill rank 0, when the decode server receives the request (before it has memory
    for it): a decode server will register `room`, so the prefill side keeps it queued past the
    bootstrap timeout, and knows where to send a failure that happens before the Register."""

    room: int
    notify_addr: str


@dataclass
class Register:
    """decode -> prefill rank 0 (rebroadcast to every CP rank): the decode server preallocated room's
    pages; only now does the prefill server compute the prompt."""

    room: int
    notify_addr: str  # the decode server's control PULL socket (tcp://host:port)
    session_id: str  # the decode server's transfer endpoint
    meta: PoolsMeta
    ptrs: list[int]
    dst_pages: list[int]  # the decode pool's pages for the prompt, in position order
    num_tokens: int  # prompt length the pages hold
    exported: bytes | None = None  # what the sender's engine needs to reach `ptrs` (CUDA IPC handles)


@dataclass
class AbortRoom:
    """decode -> prefill: the client went away; free the prefill side too."""

    room: int


@dataclass
class Done:
    """prefill rank -> decode: this rank's pages of `room` are written (or it failed: `error`, which
    may come before any Register: the decode side then drops the request from its queue)."""

    room: int
    rank: int
    cp_size: int
    first_token: int | None = None
    cached_tokens: int = 0
    bytes_sent: int = 0
    pages_sent: int = 0
    # speculative decoding: the draft's proposal for the next position and its last hidden state
    spec_state: tuple[int, bytes] | None = None
    error: str | None = None
    status_code: int = 500
