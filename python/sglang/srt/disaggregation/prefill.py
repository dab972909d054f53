"""The prefill server's scheduler: prefill as usual, then ship the KV instead of decoding.

Life of a request with a `bootstrap_room` (upstream's order and names):
1. Bootstrap queue (`bootstrap_queue`): it waits, holding no KV, until its decode server's
   `Register` says the decode side has preallocated its pages -- so no prompt is computed that no
   decode server can take, and a burst waits here instead of failing. A room no decode server has
   even announced (`Handshake`) within the bootstrap timeout fails with 503.
2. Waiting queue: admitted and prefilled like any request (the Register is validated first: a
   layout mismatch is refused before any compute, with a `Done` naming the field).
3. Sending (`pd_sending`, upstream's inflight queue): `on_prefill_finished(req)` hands each CP
   rank's writes of only the pages it owns (cp_page_map) to its transfer thread (which retries
   failed writes); when every rank's writes have ended each sends `Done` with the first token (or
   the error), and the request is released into the radix cache (later prompts hit it here; its
   pages are never reused while a write reads them). The prefill's first token never finishes a
   request here: the decode server applies the stop rules to it.
Whenever this side drops a room (abort, failure, timeout) it tells the decode side at once, if it
knows where (Handshake / Register), so the decode side frees its pages without waiting.

Every rank must take the same decisions: rank 0 reads the control socket, decides timeouts, and
rebroadcasts both to all CP ranks each iteration (like requests in scheduler_process); a transfer
ends on the iteration where an all-reduce over the ranks' write states says no rank still writes
(then success only if none failed), so no rank frees pages another still sends from, and the decode
side never frees pages a slower rank still writes into.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass

import torch
import zmq

from sglang.srt.disaggregation.common import BOOTSTRAP_TIMEOUT_S, STALL_POLL_MS, PushSockets, TransferEndpoint, drain
from sglang.srt.disaggregation.kv_layout import copy_ops, layout_mismatch, rank_pages, request_pages
from sglang.srt.disaggregation.messages import AbortRoom, Done, Handshake, Register
from sglang.srt.disaggregation.transfer import TransferError, TransferTask
from sglang.srt.managers.io_struct import ReqOutput, TokenizedGenerateReqInput
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.utils.ipc import get_zmq_socket

logger = logging.getLogger(__name__)


def _wake(fd: int, _task) -> None:
    """On the transfer thread, after a write ended: wake the event loop. A module function over the
    pipe's fd only: a bound method would keep the scheduler alive for as long as the thread runs."""
    try:
        os.write(fd, b"x")
    except OSError:  # the pipe is full (the loop is awake anyway) or closed
        pass


class _Timeout:
    """Rank 0's decision, rebroadcast: `room` waited past the bootstrap timeout."""

    def __init__(self, room: int) -> None:
        self.room = room


@dataclass
class _KVSend:
    """A prefilled request whose KV this rank's transfer thread writes to the decode side."""

    req: Req
    reg: Register
    task: TransferTask
    pages: int
    abort: tuple[str, int] | None = None  # (message, status): aborted mid-write, failed once it ended


# A rank's write state in the per-iteration all-reduce (MIN: anyone still writing; MAX: anyone failed).
_WRITING, _WRITTEN, _FAILED = 0, 1, 2


class PrefillScheduler(Scheduler):
    def __init__(self, server_args, *args, **kwargs) -> None:
        super().__init__(server_args, *args, **kwargs)
        group = self.tp_worker.world_group
        cp = self.tp_worker.model_runner.cp_group
        self.cp_rank, self.cp_size = (cp.rank, cp.world_size) if cp is not None else (0, 1)
        self.group = group
        # A finished write wakes the event loop through this pipe (the loop sleeps on its sockets).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.pd = TransferEndpoint(server_args.disaggregation_transfer_backend, self.tp_worker, sender=True,
                                   on_done=functools.partial(_wake, self._wake_w))
        self.ctx = zmq.Context(1)
        self.push = PushSockets(self.ctx)
        self.bootstrap = None
        if group.rank == 0:
            self.bootstrap = get_zmq_socket(self.ctx, zmq.PULL, f"tcp://*:{server_args.disaggregation_bootstrap_port}",
                                            True)
        self.pd_rooms: dict[int, Req] = {}  # every live request with a room
        self.bootstrap_queue: dict[int, tuple[Req, float]] = {}  # waiting for Register (no KV held), arrival
        self.pd_waiting: dict[int, Req] = {}  # prefilled, its transfer starts this iteration
        self.pd_sending: dict[int, _KVSend] = {}  # handed to the transfer thread (same order on every rank)
        self.pd_regs: dict[int, Register] = {}
        self.pd_peers: dict[int, tuple[str, float]] = {}  # room -> (decode notify address, first heard)
        self.pd_gone: dict[int, None] = {}  # rooms this side dropped: a late Register gets an error back
        self.pd_out: list[ReqOutput] = []
        self.pd_num_sent = self.pd_num_failed = 0

    def wake_sources(self) -> list:
        return [self.bootstrap, self._wake_r] if self.bootstrap is not None else [self._wake_r]

    def stall_timeout_ms(self) -> int:
        # Other CP ranks' writes end without waking rank 0, whose loop waits: poll for them.
        if self.pd_sending and not self.group.is_single:
            return 5
        return STALL_POLL_MS

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, recv: TokenizedGenerateReqInput) -> list[ReqOutput]:
        outs = super().add_request(recv)
        room = recv.bootstrap_room
        req = next((r for r in reversed(self.waiting_queue) if r.rid == recv.rid), None) if room is not None else None
        if req is None and room is not None:
            req = next((r for r in self.grammar_manager.grammar_queue if r.rid == recv.rid), None)
        if req is not None:
            req.bootstrap_room = room
            req.abort_only_stop_rules = True
            self.pd_rooms[room] = req
            self._hold_new()
        elif room is not None and outs:  # refused here (too long, ...): the decode side drops it too
            self._tell_decode(room, outs[-1].finished_reason.get("message", "refused"),
                              outs[-1].finished_reason.get("status_code", 400))
            self._finish_room(room)
        return outs

    def abort_request(self, rid: str) -> list[ReqOutput]:
        for room, (req, _) in list(self.bootstrap_queue.items()):
            if req.rid == rid:
                self._fail(room, req, "aborted by client", 400)
                return self._pop_outputs()
        for room, req in list(self.pd_waiting.items()):
            if req.rid == rid:
                self._fail(room, req, "aborted by client", 400)
                return self._pop_outputs()
        for f in self.pd_sending.values():
            if f.req.rid == rid:  # a write cannot be recalled: fail it once every rank's write ended
                f.abort = f.abort or ("aborted by client", 400)
                return []
        return super().abort_request(rid)

    def on_prefill_finished(self, req: Req) -> None:
        room = req.bootstrap_room
        if room is None:  # no decode server paired (warm-up, health checks): the first token is all
            req.finished_reason = FINISH_LENGTH(len(req.output_ids))
            self.cache_manager.release_req(req)
            return
        self.pd_waiting[room] = req

    def has_work(self) -> bool:
        return super().has_work() or bool(self.bootstrap_queue or self.pd_waiting or self.pd_sending)

    def get_next_batch_to_run(self):
        self._hold_new()  # requests whose grammar just compiled
        return super().get_next_batch_to_run()

    def _hold_new(self) -> None:
        """Move new PD requests from the waiting queue into the bootstrap queue: they are computed
        only once their decode server's Register has arrived and been validated."""
        hold = [r for r in self.waiting_queue
                if r.bootstrap_room is not None and not r.pd_registered]
        if hold:
            ids = {id(r) for r in hold}
            self.waiting_queue = [r for r in self.waiting_queue if id(r) not in ids]
            now = time.monotonic()
            for r in hold:
                self.bootstrap_queue[r.bootstrap_room] = (r, now)

    def _admit_registered(self) -> int:
        """Registered requests leave the bootstrap queue (arrival order) for the waiting queue, once
        their Register is valid: a refused one fails before any compute."""
        rooms = [room for room in self.bootstrap_queue if room in self.pd_regs]
        for room in rooms:
            req, _ = self.bootstrap_queue.pop(room)
            error = self._register_error(req, self.pd_regs[room])
            if error is not None:
                logger.error("PD handshake refused for room %d: %s", room, error)
                self._fail(room, req, f"PD handshake failed: {error}", 500)
            else:
                req.pd_registered = True
                self.waiting_queue.append(req)
        return len(rooms)

    def _register_error(self, req: Req, reg: Register) -> str | None:
        n = len(req.origin_input_ids)
        error = layout_mismatch(self.pd.desc.meta, reg.meta)
        if error is None and reg.num_tokens != n:
            error = f"prompt length mismatch: prefill has {n} tokens, decode preallocated {reg.num_tokens}"
        return error

    # -- one iteration ------------------------------------------------------------------------------
    def step(self) -> list[ReqOutput]:
        events = self._poll_control()
        events += self._admit_registered()
        outs = super().step()
        events += self._advance_sends()
        outs += self._pop_outputs()
        self.last_step_progressed = self.last_step_progressed or bool(events or outs)
        return outs

    def _pop_outputs(self) -> list[ReqOutput]:
        """The outputs of requests this side finished (sent, failed, aborted) since the last call."""
        outs, self.pd_out = self.pd_out, []
        return outs

    def _poll_control(self) -> int:
        """Read (rank 0) and rebroadcast the decode servers' messages and the timeouts; apply them.
        Returns how many there were."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        msgs = []
        if self.bootstrap is not None:
            msgs = drain(self.bootstrap)
            now = time.monotonic()
            msgs += [_Timeout(room) for room, (_, t) in self.bootstrap_queue.items()
                     if room not in self.pd_peers and now - t > BOOTSTRAP_TIMEOUT_S]
            msgs += [_Timeout(room) for room, (_, t) in self.pd_peers.items()  # never reached this server
                     if room not in self.pd_rooms and now - t > BOOTSTRAP_TIMEOUT_S]
        if not self.group.is_single:
            msgs = self.group.broadcast_object(msgs)
        for m in msgs:
            if isinstance(m, (Register, Handshake)):
                if m.room in self.pd_gone:
                    self.push.send(m.notify_addr, Done(m.room, self.cp_rank, self.cp_size,
                                                       error="the request was dropped on the prefill server",
                                                       status_code=503))
                    continue
                self.pd_peers.setdefault(m.room, (m.notify_addr, time.monotonic()))
                if isinstance(m, Register):
                    self.pd_regs[m.room] = m
            elif isinstance(m, AbortRoom):
                self._on_abort_room(m.room)
            elif isinstance(m, _Timeout):
                self._on_timeout(m.room)
        for room in [r for r, q in self.pd_rooms.items() if q.finished() and r not in self.pd_waiting
                     and r not in self.pd_sending]:
            req = self.pd_rooms.pop(room)  # finished before its KV was ready (abort, error)
            self._tell_decode(room, req.finished_reason.message if isinstance(req.finished_reason, FINISH_ABORT)
                              else "dropped", 503)
            self._finish_room(room)
        return len(msgs)

    def _on_abort_room(self, room: int) -> None:
        req = self.pd_rooms.get(room)
        if room in self.pd_sending:
            f = self.pd_sending[room]
            f.abort = f.abort or ("aborted on the decode server", 400)
        elif room in self.bootstrap_queue:
            self._fail(room, self.bootstrap_queue[room][0], "aborted on the decode server", 400)
        elif room in self.pd_waiting:  # the answer lets the decode side free its pages now
            self._fail(room, self.pd_waiting[room], "aborted on the decode server", 400)
        elif req is not None:  # its Register stays: the loop in _poll_control answers once it is finished
            self.pd_out += super().abort_request(req.rid)
        else:  # never reached this server (or already gone): answer, so the decode side frees now
            self._tell_decode(room, "aborted on the decode server", 400)
            self._finish_room(room)

    def _on_timeout(self, room: int) -> None:
        if room in self.bootstrap_queue and room not in self.pd_peers:
            self._fail(room, self.bootstrap_queue[room][0],
                       f"no decode server took the request within {BOOTSTRAP_TIMEOUT_S:.0f}s", 503)
        elif room in self.pd_peers and room not in self.pd_rooms:
            self._tell_decode(room, f"the prefill server did not receive the request within {BOOTSTRAP_TIMEOUT_S:.0f}s",
                              503)
            self._finish_room(room)

    def _tell_decode(self, room: int, message: str, status: int) -> None:
        """A failure of `room` to its decode server, if this side knows where it is."""
        peer = self.pd_peers.get(room)
        if peer is not None:
            self.push.send(peer[0], Done(room, self.cp_rank, self.cp_size, error=message, status_code=status))

    def _finish_room(self, room: int) -> None:
        self.bootstrap_queue.pop(room, None)
        self.pd_waiting.pop(room, None)
        self.pd_regs.pop(room, None)
        self.pd_peers.pop(room, None)
        self.pd_rooms.pop(room, None)
        self.pd_gone[room] = None
        while len(self.pd_gone) > 100_000:  # bounded: only late Registers need it
            del self.pd_gone[next(iter(self.pd_gone))]

    def _advance_sends(self) -> int:
        """Start the sends of this iteration's prefilled requests, end those no rank still writes."""
        events = len(self.pd_waiting)
        for room in list(self.pd_waiting):
            self._send_kv(room)
        if self.pd_sending:
            events += self._end_finished_sends()
        return events

    # -- transfer -----------------------------------------------------------------------------------
    def _send_kv(self, room: int) -> None:
        """Hand this rank's writes of a prefilled request to the transfer thread."""
        req = self.pd_waiting.pop(room)
        reg = self.pd_regs.get(room)
        if reg is None:  # admission requires it; never computed without one
            self._fail(room, req, "internal error: the prompt was prefilled before its decode server registered", 500)
            return
        n = len(req.origin_input_ids)
        logical = request_pages(self.req_to_token_pool.read(req.req_pool_idx, n), self.page_size)
        dst = torch.tensor(reg.dst_pages, dtype=torch.int64)
        if len(dst) != len(logical):
            self._fail(room, req, f"decode preallocated {len(dst)} pages for {len(logical)}", 500)
            return
        src_pages, dst_pages = rank_pages(logical, dst, self.cp_rank, self.cp_size)
        srcs, dsts, lens = copy_ops(self.pd.desc, reg.ptrs, src_pages, dst_pages)
        task = TransferTask(room, reg.session_id, srcs, dsts, lens)
        try:
            self.pd.backend.connect(reg.session_id, reg.exported)
        except TransferError as e:  # every rank fails it in the same iteration (_end_finished_sends)
            task.error = str(e)
            task.done.set()
        else:
            if self.pd.desc.tensors[0].is_cuda:  # the writes read what this stream's forward wrote
                task.ready = torch.cuda.current_stream().record_event()
            self.pd.worker.submit(task)
        self.pd.ops += len(lens)
        self.pd_sending[room] = _KVSend(req, reg, task, len(src_pages))

    def _end_finished_sends(self) -> int:
        """End the transfers no rank still writes (the same rooms on every rank); how many ended."""
        rooms = list(self.pd_sending)
        state = torch.tensor([_WRITING if not f.task.done.is_set() else _FAILED if f.task.error else _WRITTEN
                              for f in self.pd_sending.values()], dtype=torch.int32)
        lo_hi = self.group.all_reduce_host(torch.cat([state, -state]), "min")
        ended = 0
        for room, lo, hi in zip(rooms, lo_hi[:len(rooms)].tolist(), (-lo_hi[len(rooms):]).tolist()):
            if lo == _WRITING:
                continue
            ended += 1
            f = self.pd_sending.pop(room)
            if f.abort is not None:
                self._fail(room, f.req, *f.abort)
            elif hi == _FAILED:  # retried on the transfer thread already: report it, both sides free now
                error = f.task.error or "the KV transfer failed on another CP rank"
                logger.error("PD transfer for room %d failed: %s", room, error)
                self.pd_num_failed += 1
                self._fail(room, f.req, f"KV transfer to the decode server failed: {error}", 503)
            else:
                self._complete_send(room, f)
        return ended

    def _complete_send(self, room: int, f: _KVSend) -> None:
        """Every rank wrote its pages: Done (with the first token) to the decode side, then release."""
        req, nbytes = f.req, f.task.nbytes
        self.pd.seconds += f.task.seconds
        self.pd.bytes_moved += nbytes
        self.pd.pages_moved += f.pages
        self.pd_num_sent += 1
        self.push.send(f.reg.notify_addr, Done(room, self.cp_rank, self.cp_size, req.output_ids[0], req.cached_tokens,
                                               nbytes, f.pages, self.tp_worker.export_req_state(req.req_pool_idx)))
        req.finished_reason = FINISH_LENGTH(len(req.output_ids))
        self._finish(room, req)

    def _fail(self, room: int, req: Req, message: str, status: int) -> None:
        """Fail a request this side holds (bootstrap queue, prefilled, or written): tell the decode
        side, free the pages, answer the client."""
        self._tell_decode(room, message, status)
        req.finished_reason = FINISH_ABORT(message, status)
        self._finish(room, req)

    def _finish(self, room: int, req: Req) -> None:
        self._finish_room(room)
        self.cache_manager.release_if_held(req)  # the one release place: into the radix cache (prefix hits here)
        self.pd_out.append(self._make_output(req, []))

    def get_stats(self):
        stats = super().get_stats()
        stats.num_prefill_bootstrap_queue_reqs = len(self.bootstrap_queue)
        stats.num_prefill_inflight_queue_reqs = len(self.pd_waiting) + len(self.pd_sending)
        stats.disaggregation = {"mode": "prefill", "bytes_sent": self.pd.bytes_moved, "pages_sent": self.pd.pages_moved,
                                "transfers": self.pd_num_sent, "failed": self.pd_num_failed,
                                "retries": self.pd.worker.retries, "bootstrapping": len(self.bootstrap_queue),
                                "waiting": len(self.pd_waiting), "inflight": len(self.pd_sending),
                                "transfer_seconds": self.pd.seconds, "copy_ops": self.pd.ops}
        return stats
