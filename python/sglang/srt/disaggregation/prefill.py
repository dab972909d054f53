"""The prefill server's scheduler: prefill as usual, then ship the KV instead of decoding.

`on_prefill_finished(req)` parks the request until its decode server's `Register` (arriving on the
bootstrap port, any time before or after) is validated; then each CP rank hands the writes of only
the pages it owns (cp_page_map) to its transfer thread and goes on scheduling. When every rank's
writes have finished, each sends `Done` with the first token, and the request is released into the
radix cache (later prompts hit it here; its pages are never reused while a write reads them). The
prefill's first token never finishes a request here: the decode server applies the stop rules to it.

Every rank must take the same decisions: rank 0 reads the control socket, decides timeouts, and
rebroadcasts both to all CP ranks each iteration (like requests in scheduler_process); a transfer
ends on the iteration where an all-reduce over the ranks' write states says no rank still writes
(then success only if none failed), so no rank frees pages another still sends from, and the decode
side never frees pages a slower rank still writes into.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import zmq

from sglang.srt.disaggregation.common import BOOTSTRAP_TIMEOUT_S, PushSockets, TransferEndpoint, drain, spec_state
from sglang.srt.disaggregation.kv_layout import copy_ops, layout_mismatch, rank_pages, request_pages
from sglang.srt.disaggregation.messages import AbortRoom, Done, Register
from sglang.srt.disaggregation.transfer import TransferError, TransferTask
from sglang.srt.managers.io_struct import ReqOutput, TokenizedGenerateReqInput
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.utils.ipc import get_zmq_socket

logger = logging.getLogger(__name__)


class _Timeout:
    def __init__(self, room: int) -> None:
        self.room = room


@dataclass
class _Inflight:
    req: Req
    reg: Register
    task: TransferTask
    pages: int
    abort: tuple[str, int, bool] | None = None  # (message, status, notify decode): aborted mid-write


# A rank's write state in the per-iteration all-reduce (MIN: anyone still writing; MAX: anyone failed).
_WRITING, _WRITTEN, _FAILED = 0, 1, 2


def _check_abort_only(req: Req, *args, **kwargs) -> None:
    """A prefill request's stop rules: only an abort finishes it here (the decode server applies
    EOS / stop / length to the first token)."""
    if req.to_abort is not None and req.finished_reason is None:
        req.finished_reason = FINISH_ABORT(req.to_abort)


class PrefillScheduler(Scheduler):
    def __init__(self, server_args, *args, **kwargs) -> None:
        super().__init__(server_args, *args, **kwargs)
        group = self.tp_worker.world_group
        cp = self.tp_worker.model_runner.cp_group
        self.cp_rank, self.cp_size = (cp.rank, cp.world_size) if cp is not None else (0, 1)
        self.group = group
        self.pd = TransferEndpoint(server_args.disaggregation_transfer_backend, self.tp_worker, sender=True)
        self.ctx = zmq.Context(1)
        self.push = PushSockets(self.ctx)
        self.bootstrap = None
        if group.rank == 0:
            self.bootstrap = get_zmq_socket(self.ctx, zmq.PULL, f"tcp://*:{server_args.disaggregation_bootstrap_port}",
                                            True)
        self.pd_rooms: dict[int, Req] = {}  # every live request with a room
        self.pd_waiting: dict[int, tuple[Req, float]] = {}  # prefilled, waiting for Register
        self.pd_inflight: dict[int, _Inflight] = {}  # handed to the transfer thread (same order on every rank)
        self.pd_regs: dict[int, Register] = {}
        self.pd_gone: dict[int, None] = {}  # rooms this side dropped: a late Register gets an error back
        self.pd_out: list[ReqOutput] = []
        self.pd_transfers = 0

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, recv: TokenizedGenerateReqInput) -> list[ReqOutput]:
        outs = super().add_request(recv)
        room = getattr(recv, "bootstrap_room", None)
        if room is not None and self.waiting_queue and self.waiting_queue[-1].rid == recv.rid:
            req = self.waiting_queue[-1]
            req.bootstrap_room = room
            req.check_finished = _check_abort_only.__get__(req)
            self.pd_rooms[room] = req
        return outs

    def abort_request(self, rid: str) -> list[ReqOutput]:
        for room, (req, _) in list(self.pd_waiting.items()):
            if req.rid == rid:
                self._fail(room, "aborted by client", 400, notify=True)
                return self._take_out()
        for f in self.pd_inflight.values():
            if f.req.rid == rid:  # a write cannot be recalled: fail it once every rank's write ended
                f.abort = f.abort or ("aborted by client", 400, True)
                return []
        return super().abort_request(rid)

    def on_prefill_finished(self, req: Req) -> None:
        room = getattr(req, "bootstrap_room", None)
        if room is None:  # no decode server paired (warm-up, health checks): the first token is all
            req.finished_reason = FINISH_LENGTH(len(req.output_ids))
            self.release_req(req)
            return
        self.pd_waiting[room] = (req, time.monotonic())

    def has_work(self) -> bool:
        return super().has_work() or bool(self.pd_waiting or self.pd_inflight)

    # -- one iteration ------------------------------------------------------------------------------
    def step(self) -> list[ReqOutput]:
        self._poll_control()
        outs = super().step()
        self._progress()
        return outs + self._take_out()

    def _take_out(self) -> list[ReqOutput]:
        outs, self.pd_out = self.pd_out, []
        return outs

    def _poll_control(self) -> None:
        msgs = []
        idle = not super().has_work()
        if idle and self.pd_inflight:  # only transfers to finish: wait for the oldest, do not spin
            next(iter(self.pd_inflight.values())).task.done.wait(0.005)
        if self.bootstrap is not None:
            wait = idle and self.pd_waiting and not self.pd_inflight
            msgs = drain(self.bootstrap, timeout_ms=5 if wait else 0)
            now = time.monotonic()
            msgs += [_Timeout(room) for room, (_, t) in self.pd_waiting.items()
                     if room not in self.pd_regs and now - t > BOOTSTRAP_TIMEOUT_S]
        if not self.group.is_single:
            msgs = self.group.broadcast_object(msgs)
        for m in msgs:
            if isinstance(m, Register):
                if m.room in self.pd_gone:
                    self.push.send(m.notify_addr, Done(m.room, self.cp_rank, self.cp_size,
                                                       error="the request was dropped on the prefill server",
                                                       status_code=503))
                else:
                    self.pd_regs[m.room] = m
            elif isinstance(m, AbortRoom):
                req = self.pd_rooms.get(m.room)
                if m.room in self.pd_inflight:
                    f = self.pd_inflight[m.room]
                    f.abort = f.abort or ("aborted on the decode server", 400, True)
                elif m.room in self.pd_waiting:  # the answer lets the decode side free its pages now
                    self._fail(m.room, "aborted on the decode server", 400, notify=True)
                elif req is not None:  # its Register stays: the loop below answers once it is finished
                    self.pd_out += super().abort_request(req.rid)
            elif isinstance(m, _Timeout) and m.room in self.pd_waiting:
                self._fail(m.room, f"no decode server registered for the request within {BOOTSTRAP_TIMEOUT_S:.0f}s",
                           503, notify=False)
        for room in [r for r, q in self.pd_rooms.items() if q.finished() and r not in self.pd_waiting
                     and r not in self.pd_inflight]:
            req = self.pd_rooms.pop(room)  # finished before its KV was ready (abort, error)
            reg = self.pd_regs.pop(room, None)
            if reg is not None:
                self.push.send(reg.notify_addr, Done(room, self.cp_rank, self.cp_size, error=req.finished_reason.message
                                                     if isinstance(req.finished_reason, FINISH_ABORT) else "dropped",
                                                     status_code=503))
            self._forget(room)

    def _forget(self, room: int) -> None:
        self.pd_gone[room] = None
        while len(self.pd_gone) > 100_000:  # bounded: only late Registers need it
            del self.pd_gone[next(iter(self.pd_gone))]

    def _progress(self) -> None:
        for room in [r for r in self.pd_waiting if r in self.pd_regs]:
            self._start(room)
        if self.pd_inflight:
            self._reap()

    # -- transfer -----------------------------------------------------------------------------------
    def _start(self, room: int) -> None:
        """Validate the decode side's pages and hand this rank's writes to the transfer thread."""
        req, _ = self.pd_waiting[room]
        reg = self.pd_regs[room]
        n = len(req.origin_input_ids)
        error = layout_mismatch(self.pd.desc.meta, reg.meta)
        if error is None and reg.num_tokens != n:
            error = f"prompt length mismatch: prefill has {n} tokens, decode preallocated {reg.num_tokens}"
        if error is not None:
            logger.error("PD handshake refused for room %d: %s", room, error)
            self._fail(room, f"PD handshake failed: {error}", 500, notify=True)
            return
        logical = request_pages(self.req_to_token_pool.read(req.req_pool_idx, n), self.page_size)
        dst = torch.tensor(reg.dst_pages, dtype=torch.int64)
        if len(dst) != len(logical):
            self._fail(room, f"decode preallocated {len(dst)} pages for {len(logical)}", 500, notify=True)
            return
        src_pages, dst_pages = rank_pages(logical, dst, self.cp_rank, self.cp_size)
        srcs, dsts, lens = copy_ops(self.pd.desc, reg.ptrs, src_pages, dst_pages)
        task = TransferTask(room, reg.session_id, srcs, dsts, lens)
        try:
            self.pd.backend.connect(reg.session_id, reg.exported)
        except TransferError as e:  # every rank fails it in the same iteration of _reap
            task.error = str(e)
            task.done.set()
        else:
            if self.pd.desc.tensors[0].is_cuda:  # the writes read what this stream's forward wrote
                task.ready = torch.cuda.current_stream().record_event()
            self.pd.worker.submit(task)
        self.pd.ops += len(lens)
        del self.pd_waiting[room]
        self.pd_inflight[room] = _Inflight(req, reg, task, len(src_pages))

    def _reap(self) -> None:
        """End the transfers no rank still writes (the same rooms on every rank)."""
        rooms = list(self.pd_inflight)
        state = torch.tensor([_WRITING if not f.task.done.is_set() else _FAILED if f.task.error else _WRITTEN
                              for f in self.pd_inflight.values()], dtype=torch.int32)
        lo_hi = self.group.all_reduce_host(torch.cat([state, -state]), "min")
        for room, lo, hi in zip(rooms, lo_hi[:len(rooms)].tolist(), (-lo_hi[len(rooms):]).tolist()):
            if lo == _WRITING:
                continue
            f = self.pd_inflight.pop(room)
            if f.abort is not None:
                self._fail(room, f.abort[0], f.abort[1], notify=f.abort[2], req=f.req, reg=f.reg)
            elif hi == _FAILED:
                error = f.task.error or "the KV transfer failed on another CP rank"
                logger.error("PD transfer for room %d failed: %s", room, error)
                self._fail(room, f"KV transfer to the decode server failed: {error}", 503, notify=False, req=f.req,
                           reg=f.reg)
            else:
                self._sent(room, f)

    def _sent(self, room: int, f: _Inflight) -> None:
        req, nbytes = f.req, f.task.nbytes
        self.pd.seconds += f.task.seconds
        self.pd.bytes_moved += nbytes
        self.pd.pages_moved += f.pages
        self.pd_transfers += 1
        self.push.send(f.reg.notify_addr, Done(room, self.cp_rank, self.cp_size, req.output_ids[0], req.cached_tokens,
                                               nbytes, f.pages, spec_state(self.tp_worker, req.req_pool_idx)))
        req.finished_reason = FINISH_LENGTH(len(req.output_ids))
        self._finish(room, req)

    def _fail(self, room: int, message: str, status: int, notify: bool, req: Req | None = None,
              reg: Register | None = None) -> None:
        req = req if req is not None else self.pd_waiting[room][0]
        reg = reg if reg is not None else self.pd_regs.get(room)
        if notify and reg is not None:
            self.push.send(reg.notify_addr, Done(room, self.cp_rank, self.cp_size, error=message, status_code=status))
        req.finished_reason = FINISH_ABORT(message, status)
        self._finish(room, req)

    def _finish(self, room: int, req: Req) -> None:
        self.pd_waiting.pop(room, None)
        self.pd_regs.pop(room, None)
        self.pd_rooms.pop(room, None)
        self._forget(room)
        self.release_req(req)  # the one release place: into the radix cache (prefix hits here)
        self.pd_out.append(self._make_output(req, []))

    def get_stats(self):
        stats = super().get_stats()
        stats.disaggregation = {"mode": "prefill", "bytes_sent": self.pd.bytes_moved, "pages_sent": self.pd.pages_moved,
                                "transfers": self.pd_transfers, "waiting": len(self.pd_waiting),
                                "inflight": len(self.pd_inflight),
                                "transfer_seconds": self.pd.seconds, "copy_ops": self.pd.ops}
        return stats
