"""The decode server's scheduler: receive a prompt's KV from a prefill server, then decode.

A request with a `bootstrap_room` skips local prefill (upstream's queues): on arrival a `Handshake`
tells its prefill server a decode server has it; it waits in the prealloc queue (`pd_queue`, FCFS)
until memory allows, then its prompt's pages are preallocated (request slot + KV, like admission)
and a `Register` goes to the prefill server, which only then computes the prompt; it waits in the
transfer queue (`pd_transfers`) until every prefill CP rank's `Done` has arrived, and is then
committed -- KV length = prompt, first token = the prefill's, into `running`. Until then its pages
are not readable by any step. A `Done` with an error (a failed transfer, the prefill side's abort
or refusal) fails the request and frees its pages at once, in either queue.
An abort here answers the client at once but keeps the pages until the prefill side has answered
(or the bootstrap timeout passed), so no late write lands in pages another request reuses.
A request retracted after its commit is recomputed here (plain prefill of prompt + outputs).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import zmq

from sglang.srt.disaggregation.common import (
    BOOTSTRAP_TIMEOUT_S,
    STALL_POLL_MS,
    PushSockets,
    TransferEndpoint,
    drain,
    local_host,
)
from sglang.srt.disaggregation.kv_layout import bytes_per_page, request_pages
from sglang.srt.disaggregation.messages import AbortRoom, Done, Handshake, Register
from sglang.srt.managers.io_struct import ReqOutput, TokenizedGenerateReqInput
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req, ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.utils.common import cdiv

logger = logging.getLogger(__name__)


@dataclass
class _Transfer:
    req: Req
    prefill_addr: str
    started: float
    dones: dict[int, Done] = field(default_factory=dict)
    aborting: bool = False


class DecodeScheduler(Scheduler):
    def __init__(self, server_args, *args, **kwargs) -> None:
        super().__init__(server_args, *args, **kwargs)
        self.pd = TransferEndpoint(server_args.disaggregation_transfer_backend, self.tp_worker)
        self._exported = self.pd.backend.export()
        self.ctx = zmq.Context(1)
        self.push = PushSockets(self.ctx)
        self.notify = self.ctx.socket(zmq.PULL)
        self.notify.setsockopt(zmq.LINGER, 0)
        host = local_host()
        self.notify_addr = f"tcp://{host}:{self.notify.bind_to_random_port(f'tcp://{host}')}"
        self.pd_queue: list[Req] = []  # waiting for preallocation
        self.pd_transfers: dict[int, _Transfer] = {}  # registered, waiting for every rank's Done
        self.pd_out: list[ReqOutput] = []
        self.pd_bytes = self.pd_pages = self.pd_committed = 0

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, recv: TokenizedGenerateReqInput) -> list[ReqOutput]:
        outs = super().add_request(recv)
        room = recv.bootstrap_room
        req = next((r for r in self.waiting_queue if r.rid == recv.rid), None) if room is not None else None
        if req is None:
            req = next((r for r in self.grammar_manager.grammar_queue if r.rid == recv.rid), None) \
                if room is not None else None
        if req is not None:
            req.bootstrap_room = room
            req.pd_prefill_addr = f"tcp://{recv.bootstrap_host}:{recv.bootstrap_port}"
            self.push.send(req.pd_prefill_addr, Handshake(room, self.notify_addr))
        elif room is not None and outs:  # refused here: the prefill side drops it from its queue too
            self.push.send(f"tcp://{recv.bootstrap_host}:{recv.bootstrap_port}", AbortRoom(room))
        return outs

    def abort_request(self, rid: str) -> list[ReqOutput]:
        for i, req in enumerate(self.pd_queue):
            if req.rid == rid:
                del self.pd_queue[i]
                self.push.send(req.pd_prefill_addr, AbortRoom(req.bootstrap_room))
                req.finished_reason = FINISH_ABORT("aborted by client")
                return [self._make_output(req, [])]
        for room, st in self.pd_transfers.items():
            if st.req.rid == rid and not st.aborting:
                st.aborting = True
                self.push.send(st.prefill_addr, AbortRoom(room))
                st.req.finished_reason = FINISH_ABORT("aborted by client")
                return [self._make_output(st.req, [])]
        return super().abort_request(rid)

    def has_work(self) -> bool:
        return super().has_work() or bool(self.pd_queue or self.pd_transfers)

    def wake_sources(self) -> list:
        return [self.notify]

    def stall_timeout_ms(self) -> int:  # the prefill servers' messages wake it (`notify`)
        return STALL_POLL_MS

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        # Requests whose KV comes from a prefill server never prefill here (a retracted one does).
        take = [r for r in self.waiting_queue if r.bootstrap_room is not None and not r.pd_done]
        if take:
            ids = {id(r) for r in take}
            self.waiting_queue = [r for r in self.waiting_queue if id(r) not in ids]
            self.pd_queue += take
        return super().get_next_batch_to_run()

    # -- one iteration ------------------------------------------------------------------------------
    def step(self) -> list[ReqOutput]:
        events = self._poll()
        events += self._prealloc()
        outs = super().step()
        events += self._prealloc()  # requests moved out of the waiting queue this step
        outs, self.pd_out = self.pd_out + outs, []
        self.last_step_progressed = self.last_step_progressed or bool(events or outs)
        return outs

    def _prealloc(self) -> int:
        """Preallocate the prealloc queue's head requests while memory allows; how many."""
        done = 0
        while self.pd_queue:
            req = self.pd_queue[0]
            n, ps = len(req.origin_input_ids), self.page_size
            if len(self.running) + len(self.pd_transfers) >= self.max_running_requests:
                return done
            if self.req_to_token_pool.available_size() == 0:
                return done
            # Growth to keep free: the running requests', those whose KV is on the way (they run
            # next), and this one's -- else a burst of PD requests is admitted only to be retracted.
            reserve = self.decode_manager.reserved_tokens(self.running) + sum(
                int(r.sampling_params.max_new_tokens * self.decode_manager.new_token_ratio)
                for r in [st.req for st in self.pd_transfers.values()] + [req])
            if self.allocator.available_size() + self.tree_cache.evictable_size() - reserve < cdiv(n, ps) * ps:
                return done
            req.req_pool_idx = self.req_to_token_pool.alloc(1)[0]
            req.kv_committed_len = req.kv_allocated_len = 0
            if self.cache_manager.alloc_kv([req], [0], [n], decode=False) is None:
                self.req_to_token_pool.free(req.req_pool_idx)
                req.req_pool_idx = None
                return done
            self.pd_queue.pop(0)
            done += 1
            if not req.admitted:
                req.admitted = True
                self.prefill_manager.num_prompt_tokens += n
            pages = request_pages(self.req_to_token_pool.read(req.req_pool_idx, n), ps)
            self.push.send(req.pd_prefill_addr, Register(req.bootstrap_room, self.notify_addr, self.pd.backend.session_id,
                                                         self.pd.desc.meta, self.pd.desc.ptrs, pages.tolist(), n,
                                                         self._exported))
            self.pd_transfers[req.bootstrap_room] = _Transfer(req, req.pd_prefill_addr, time.monotonic())
        return done

    def _poll(self) -> int:
        """Apply the prefill servers' messages and the KV timeouts; how many there were."""
        msgs = drain(self.notify)
        for d in msgs:
            if not isinstance(d, Done):
                continue
            st = self.pd_transfers.get(d.room)
            if st is None:
                if d.error is not None:
                    self._fail_queued(d.room, d.error, d.status_code)
                continue
            if d.error is not None:
                if not st.aborting:
                    logger.error("PD request %s failed on the prefill server: %s", st.req.rid, d.error)
                    st.req.finished_reason = FINISH_ABORT(d.error, d.status_code)
                    self.pd_out.append(self._make_output(st.req, []))
                self._drop(d.room)
                continue
            st.dones[d.rank] = d
            if len(st.dones) == d.cp_size:
                self._commit(d.room)
        now = time.monotonic()
        expired = [room for room, st in self.pd_transfers.items() if now - st.started > BOOTSTRAP_TIMEOUT_S]
        for room in expired:
            st = self.pd_transfers[room]
            if not st.aborting:
                st.req.finished_reason = FINISH_ABORT(
                    f"the prefill server did not send the KV within {BOOTSTRAP_TIMEOUT_S:.0f}s", 503)
                self.pd_out.append(self._make_output(st.req, []))
            self._drop(room)
        return len(msgs) + len(expired)

    def _fail_queued(self, room: int, error: str, status: int) -> None:
        """The prefill side dropped a request this side has not preallocated yet: fail it now."""
        for queue in (self.pd_queue, self.waiting_queue):
            for i, req in enumerate(queue):
                if req.bootstrap_room == room and not req.pd_done:
                    del queue[i]
                    logger.error("PD request %s failed on the prefill server: %s", req.rid, error)
                    req.finished_reason = FINISH_ABORT(error, status)
                    self.pd_out.append(self._make_output(req, []))
                    return

    def _drop(self, room: int) -> None:
        st = self.pd_transfers.pop(room)
        self.cache_manager.release_req(st.req)  # kv_committed_len is 0: every preallocated page is freed

    def _commit(self, room: int) -> None:
        st = self.pd_transfers.pop(room)
        req, dones = st.req, list(st.dones.values())
        self.pd_bytes += sum(d.bytes_sent for d in dones)
        self.pd_pages += sum(d.pages_sent for d in dones)
        if st.aborting:
            self.cache_manager.release_req(req)
            return
        self.pd_committed += 1
        first = dones[0].first_token
        req.kv_committed_len = len(req.origin_input_ids)
        req.cached_tokens = dones[0].cached_tokens
        req.pd_done = True
        req.output_ids.append(first)
        req.first_token_time = time.monotonic()
        self.tp_worker.token_table.store(torch.tensor([req.req_pool_idx]), torch.tensor([first]))
        self.tp_worker.import_req_state(req.req_pool_idx, req.kv_committed_len,
                                        next((d.spec_state for d in dones if d.rank == 0), None))
        if req.grammar is not None and not req.grammar.accept_token(first):
            req.finished_reason = FINISH_ABORT(f"token {first} from the prefill server is not allowed by the grammar",
                                               500)
        req.check_finished(self.eos_token_ids, self.tokenizer)
        if req.finished():
            self.cache_manager.release_req(req)
        else:
            self.running.append(req)
        self.pd_out.append(self._make_output(req, [first]))

    def get_stats(self):
        stats = super().get_stats()
        stats.num_decode_prealloc_queue_reqs = len(self.pd_queue)
        stats.num_decode_transfer_queue_reqs = len(self.pd_transfers)
        stats.disaggregation = {"mode": "decode", "bytes_received": self.pd_bytes, "pages_received": self.pd_pages,
                                "bytes_per_page": bytes_per_page(self.pd.desc.meta), "committed": self.pd_committed,
                                "queued": len(self.pd_queue), "transferring": len(self.pd_transfers)}
        return stats
