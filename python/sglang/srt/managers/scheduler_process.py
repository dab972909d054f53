"""The scheduler process: receives requests over ZMQ, steps the Scheduler, ships outputs.

Rank 0 owns the sockets; with TP it broadcasts each iteration's received messages to the other
ranks, so every rank schedules the same batches. Outputs go to the detokenizer; control replies
(flush, stats) go straight back to the tokenizer manager.
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from typing import Callable

import zmq

from sglang.srt.distributed.parallel_state import bind_rank_gpu, init_distributed
from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FlushCacheReq,
    GetLoadReq,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.scheduler import IDLE_POLL_MS, Scheduler
from sglang.srt.managers.tokenizer_utils import load_tokenizer
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.common import configure_logger
from sglang.srt.utils.ipc import PortArgs, get_zmq_socket, kill_itself_when_parent_died, stop_event_on_sigterm

logger = logging.getLogger(__name__)

WAKE = "wake"  # rank 0 saw input on one of the scheduler's wake sources: step, even when idle


def scheduler_class(server_args: ServerArgs) -> type[Scheduler]:
    """The Scheduler class of this server's --disaggregation-mode (chosen here, by the process entry
    that builds it: the PD schedulers subclass Scheduler, so scheduler.py cannot name them)."""
    if server_args.disaggregation_mode == "prefill":
        from sglang.srt.disaggregation.prefill import PrefillScheduler

        return PrefillScheduler
    if server_args.disaggregation_mode == "decode":
        from sglang.srt.disaggregation.decode import DecodeScheduler

        return DecodeScheduler
    return Scheduler


class Shutdown:
    """Rank 0's stop, sent in the iteration's broadcast so every TP rank leaves the loop at the same
    iteration (a rank that stopped on its own would leave the others blocked in a collective)."""


class SchedulerProcess:
    def __init__(self, scheduler: Scheduler, port_args: PortArgs, tp_rank: int,
                 stopping: threading.Event | None = None) -> None:
        self.scheduler, self.tp_rank = scheduler, tp_rank
        self.stopping = stopping or threading.Event()  # rank 0's is set by SIGTERM; other ranks' is unused
        self.tp_group = scheduler.tp_worker.world_group  # every rank of the server
        if tp_rank == 0:
            ctx = zmq.Context(2)
            self.recv_from_tokenizer = get_zmq_socket(ctx, zmq.PULL, port_args.scheduler_input_ipc_name, True)
            self.send_to_detokenizer = get_zmq_socket(ctx, zmq.PUSH, port_args.detokenizer_ipc_name, False)
            self.send_to_tokenizer = get_zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_ipc_name, False)

    def recv_requests(self, block: bool, timeout_ms: int = IDLE_POLL_MS, wake_sources: list = ()) -> list:
        """This iteration's messages (the same on every rank). Blocking sleeps until a message, input
        on one of `wake_sources` (then WAKE is among the messages) or the timeout."""
        msgs = []
        if self.tp_rank == 0:
            if block and wake_sources:
                poller = zmq.Poller()
                for src in (self.recv_from_tokenizer, *wake_sources):
                    poller.register(src, zmq.POLLIN)
                if any(src is not self.recv_from_tokenizer for src, _ in poller.poll(timeout_ms)):
                    msgs.append(WAKE)
            elif block:
                self.recv_from_tokenizer.poll(timeout_ms)  # sleep until a message (or timeout)
            while True:
                try:
                    msgs.append(self.recv_from_tokenizer.recv_pyobj(zmq.NOBLOCK))
                except zmq.ZMQError:
                    break
            if self.stopping.is_set():
                msgs.append(Shutdown())
        # control messages: over the gloo cpu_group, so no iteration waits on a device round trip
        return self.tp_group.broadcast_object(msgs) if not self.tp_group.is_single else msgs

    def process(self, msg) -> list:
        s = self.scheduler
        if msg == WAKE:
            return []
        if isinstance(msg, TokenizedGenerateReqInput):
            return s.add_request(msg)
        if isinstance(msg, AbortReq):
            return s.abort_request(msg.rid)
        if isinstance(msg, FlushCacheReq):
            self.reply(s.flush_cache())
        elif isinstance(msg, GetLoadReq):
            self.reply(s.get_stats())
        else:
            logger.error("unknown message %r", type(msg))
        return []

    def reply(self, obj) -> None:
        if self.tp_rank == 0:
            self.send_to_tokenizer.send_pyobj(obj)

    def ship(self, outputs: list) -> None:
        if outputs and self.tp_rank == 0:
            self.send_to_detokenizer.send_pyobj(BatchTokenIDOut(outputs))

    def event_loop(self, stop: Callable[[], bool] = lambda: False) -> None:
        """Serve until `stop()` (never, in the scheduler process; in-process test servers stop).
        Idle, or stalled (the last step did nothing while work remains: nothing fits, or requests
        wait on another server), it sleeps on its sockets instead of stepping in a busy loop."""
        s = self.scheduler
        while not stop():
            outputs = []
            busy = s.has_work()
            # Work that made no progress last time (requests waiting for KV, transfers): wait briefly
            # on the socket and the scheduler's wake sources instead of spinning a core.
            msgs = self.recv_requests(block=not busy or not s.last_step_progressed, timeout_ms=s.poll_timeout_ms(busy),
                                      wake_sources=s.wake_sources() if self.tp_rank == 0 else ())
            if any(isinstance(m, Shutdown) for m in msgs):
                return  # the server stopped taking requests and aborted those in flight first
            for msg in msgs:
                outputs += self.process(msg)
            if s.has_work() or WAKE in msgs:
                outputs += s.step()
            else:
                s.poll_idle()
            self.ship(outputs)


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, tp_rank: int, pipe_writer) -> None:
    kill_itself_when_parent_died()
    stopping = stop_event_on_sigterm()
    configure_logger(server_args.log_level, prefix=f" TP{tp_rank}")
    if server_args.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        import torch

        # Ranks share the cores: oversubscribed OpenMP threads spin and slow everyone down.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) * server_args.nnodes // server_args.tp_size))
    try:
        if server_args.device == "cuda" and server_args.tp_size > 1:
            bind_rank_gpu(tp_rank, server_args.tp_size, server_args.nnodes)
        init = f"tcp://{server_args.dist_init_addr}" if server_args.nnodes > 1 else port_args.dist_init_method
        tp_group = init_distributed(server_args.tp_size, tp_rank, init, timeout_s=server_args.dist_timeout)
        tokenizer = load_tokenizer(server_args.tokenizer_path, server_args.trust_remote_code)
        scheduler = scheduler_class(server_args)(server_args, tokenizer=tokenizer, tp_group=tp_group)
        proc = SchedulerProcess(scheduler, port_args, tp_rank, stopping)
        pipe_writer.send({
            "status": "ready",
            "max_total_num_tokens": scheduler.max_total_num_tokens,
            "max_running_requests": scheduler.max_running_requests,
            "context_len": scheduler.context_len,
            "page_size": scheduler.page_size,
            "tokens_per_step": scheduler.tp_worker.num_tokens_per_req,
            "vocab_size": scheduler.vocab_size,
        })
    except Exception as e:  # start-up failure: tell the launcher why, then exit non-zero
        msg = f"{type(e).__name__}: {e}"
        logger.error("scheduler start-up failed: %s\n%s", msg, traceback.format_exc())
        pipe_writer.send({"status": "error", "message": msg})
        os._exit(1)
    try:
        proc.event_loop()
    except BaseException:
        logger.error("scheduler crashed:\n%s", traceback.format_exc())
        os._exit(1)
    logger.info("scheduler stopped")
    logging.shutdown()
    # Skip interpreter teardown: device and process-group objects (NCCL, copy threads) need not be
    # torn down in order by a process that is leaving anyway.
    os._exit(0)
