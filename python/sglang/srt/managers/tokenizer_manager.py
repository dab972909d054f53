"""TokenizerManager (main process): tokenizes requests, sends them to the scheduler and turns
the detokenizer's deltas into per-request async streams.

Rules: every request that reaches the scheduler ends with exactly one finished output (normal,
error or abort), so its state is always dropped; a client that goes away aborts its request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from typing import Any, AsyncIterator

import zmq
import zmq.asyncio

from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetLoadReq,
    SchedulerStats,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.request_state import RequestState
from sglang.srt.managers.tokenizer_utils import load_tokenizer
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.ipc import PortArgs, get_zmq_socket

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the server rejects: carries the HTTP status and OpenAI-style fields."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 code: str | None = None, err_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.status_code, self.param, self.code, self.err_type = message, status_code, param, code, err_type


@dataclasses.dataclass
class GenerateRequest:
    """One prompt (already expanded from batches / n) with its sampling parameters."""

    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: dict | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    rid: str | None = None


class _LiveState(RequestState):
    def __init__(self, rid: str, input_ids: list[int], logprob_start_len: int) -> None:
        super().__init__(rid, input_ids, logprob_start_len)
        self.event = asyncio.Event()
        self.deltas: list[str] = []
        self.error: dict | None = None


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, scheduler_info: dict, metrics=None) -> None:
        self.server_args = server_args
        self.scheduler_info = scheduler_info
        self.context_len = scheduler_info["context_len"]
        self.max_total_num_tokens = scheduler_info["max_total_num_tokens"]
        self.vocab_size = scheduler_info["vocab_size"]
        self.tokenizer = load_tokenizer(server_args.tokenizer_path, server_args.trust_remote_code)
        ctx = zmq.asyncio.Context(2)
        self.recv_from_workers = get_zmq_socket(ctx, zmq.PULL, port_args.tokenizer_ipc_name, True)
        self.send_to_scheduler = get_zmq_socket(ctx, zmq.PUSH, port_args.scheduler_input_ipc_name, False)
        self.states: dict[str, _LiveState] = {}
        self.control_waiters: dict[type, list[asyncio.Future]] = {}
        self.metrics = metrics
        self._loop_task: asyncio.Task | None = None

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_event_loop().create_task(self._handle_loop())

    async def _handle_loop(self) -> None:
        while True:
            msg = await self.recv_from_workers.recv_pyobj()
            try:
                self._dispatch(msg)
            except Exception:  # never let one bad message stop the loop
                logger.exception("error handling %s", type(msg).__name__)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, BatchStrOut):
            for item in msg.outputs:
                state = self.states.get(item.out.rid)
                if state is None:
                    continue
                state.apply(item.out, item.text_delta)
                state.deltas.append(item.text_delta)
                if self.metrics is not None:
                    self.metrics.observe_output(state, item.out)
                state.event.set()
            return
        waiters = self.control_waiters.get(type(msg))
        if waiters:
            fut = waiters.pop(0)
            if not fut.done():
                fut.set_result(msg)

    async def _control(self, req: Any, reply_type: type, timeout: float = 30.0):
        fut = asyncio.get_event_loop().create_future()
        self.control_waiters.setdefault(reply_type, []).append(fut)
        await self.send_to_scheduler.send_pyobj(req)
        return await asyncio.wait_for(fut, timeout)

    async def flush_cache(self) -> FlushCacheReqOutput:
        return await self._control(FlushCacheReq(), FlushCacheReqOutput)

    async def get_load(self) -> SchedulerStats:
        return await self._control(GetLoadReq(), SchedulerStats)

    # -- requests -------------------------------------------------------------------------------------
    def tokenize(self, req: GenerateRequest) -> list[int]:
        if req.input_ids is not None:
            ids = list(req.input_ids)
            if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in ids):
                raise RequestError(f"input_ids must be token ids in [0, {self.vocab_size})", param="input_ids")
            return ids
        if req.text is None:
            raise RequestError("either text (prompt) or input_ids is required", param="prompt")
        return self.tokenizer.encode(req.text, add_special_tokens=False)

    def build_sampling_params(self, params: dict | None) -> SamplingParams:
        try:
            sp = SamplingParams.from_dict(dict(params or {}))
            sp.normalize(self.tokenizer)
            sp.verify(self.vocab_size)
        except (TypeError, ValueError) as e:
            raise RequestError(str(e), param=_param_of(str(e))) from None
        return sp

    def check_length(self, n_input: int, max_new_tokens: int | None) -> None:
        if n_input == 0:
            raise RequestError("the prompt is empty", param="prompt")
        total = n_input + (max_new_tokens or 0)
        if total > self.context_len:
            raise RequestError(
                f"This model's maximum context length is {self.context_len} tokens. However, you requested "
                f"{total} tokens ({n_input} in the prompt, {max_new_tokens or 0} for the completion).",
                param="prompt" if n_input >= self.context_len else "max_tokens", code="context_length_exceeded")
        if n_input + 1 > self.max_total_num_tokens - self.scheduler_info["page_size"]:
            raise RequestError(f"the prompt ({n_input} tokens) cannot fit in the KV cache "
                               f"({self.max_total_num_tokens} tokens)", param="prompt",
                               code="context_length_exceeded")

    def prepare(self, req: GenerateRequest) -> tuple[str, list[int], SamplingParams]:
        """Validate and tokenize; raises RequestError before anything is sent."""
        sp = self.build_sampling_params(req.sampling_params)
        ids = self.tokenize(req)
        self.check_length(len(ids), sp.max_new_tokens)
        return req.rid or uuid.uuid4().hex, ids, sp

    async def generate(self, req: GenerateRequest, prepared=None, is_disconnected=None) -> AsyncIterator[dict]:
        """Yields {"text_delta", "result"} updates; the last one has meta_info.finish_reason set.
        `is_disconnected`: async callable; when it turns true the request is aborted."""
        rid, ids, sp = prepared or self.prepare(req)
        if rid in self.states:
            raise RequestError(f"duplicate request id {rid!r}", param="rid")
        state = _LiveState(rid, ids, req.logprob_start_len if req.return_logprob else -1)
        self.states[rid] = state
        if self.metrics is not None:
            self.metrics.observe_request(len(ids))
        if self.server_args.log_requests:
            logger.info("request %s: %d prompt tokens, sampling %s, logprob=%s stream=%s", rid, len(ids),
                        sp.to_dict(), req.return_logprob, req.stream)
        await self.send_to_scheduler.send_pyobj(TokenizedGenerateReqInput(
            rid, ids, sp, req.return_logprob, req.logprob_start_len, req.top_logprobs_num, req.stream, req.text))
        try:
            while True:
                try:
                    await asyncio.wait_for(state.event.wait(), timeout=1.0)
                except asyncio.TimeoutError:
                    if is_disconnected is not None and await is_disconnected():
                        self.abort(rid)
                        return
                    continue
                state.event.clear()
                delta, state.deltas = "".join(state.deltas), []
                yield {"text_delta": delta, "result": state.result()}
                if state.finished:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            if not state.finished:
                self.abort(rid)
            raise
        finally:
            if state.finished:
                self.states.pop(rid, None)
                if self.server_args.log_requests:
                    m = state.meta
                    logger.info("finished %s: %s, %d completion tokens, %d cached, %.3fs", rid, m["finish_reason"],
                                m["completion_tokens"], m["cached_tokens"], m.get("e2e_latency", 0.0))

    def abort(self, rid: str) -> None:
        """Ask the scheduler to drop `rid`; its final (abort) output will clean up the state."""
        state = self.states.get(rid)
        if state is None or state.finished:
            return
        asyncio.ensure_future(self.send_to_scheduler.send_pyobj(AbortReq(rid)))
        # The scheduler answers with an abort output; if the request already finished in flight,
        # nothing comes back, so forget the state here (late outputs for unknown rids are ignored).
        self.states.pop(rid, None)

    async def generate_full(self, req: GenerateRequest, prepared=None, is_disconnected=None) -> dict:
        result = None
        async for update in self.generate(req, prepared, is_disconnected):
            result = update["result"]
        if result is None:
            raise asyncio.CancelledError("client disconnected")
        return result


def _param_of(message: str) -> str | None:
    # SamplingParams.verify messages look like "sampling_params.<name> ...".
    if message.startswith("sampling_params."):
        return message.split()[0].split(".", 1)[1]
    return None

