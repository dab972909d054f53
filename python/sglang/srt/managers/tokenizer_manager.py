"""TokenizerManager (main process): tokenizes requests, sends them to the scheduler and turns
the detokenizer's deltas into per-request async streams.

Rules: every request that reaches the scheduler ends with exactly one finished output (normal,
error or abort), so its state is always dropped; a client that goes away aborts its request.
Requests are keyed by an internal id (never the client's `rid`), so an abort or a late output
of one request can never reach another that reuses its `rid`; a `rid` still in flight is refused.
Tokenization runs in a thread pool, never on the HTTP event loop, and a prompt whose byte length
already proves it too long is refused before it is tokenized.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, TypeVar

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
from sglang.srt.constrained import KIND_TO_FIELD, STRUCTURED_OUTPUTS_DISABLED
from sglang.srt.constrained.base_grammar_backend import grammar_key
from sglang.srt.constrained.grammar_registry import create_grammar_backend
from sglang.srt.managers.request_limits import request_length_error
from sglang.srt.managers.request_state import RequestState
from sglang.srt.managers.tokenizer_utils import load_tokenizer, max_input_bytes_per_token
from sglang.srt.sampling.custom_logit_processor import CUSTOM_LOGIT_PROCESSOR_DISABLED, load_custom_logit_processor
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.ipc import PortArgs, get_zmq_socket

logger = logging.getLogger(__name__)
T = TypeVar("T")


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
    return_hidden_states: bool = False
    custom_logit_processor: str | None = None  # CustomLogitProcessor.to_str() (upstream's top-level field)
    bootstrap_host: str | None = None  # PD disaggregation (set by the router)
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


class _LiveState(RequestState):
    def __init__(self, rid: str, input_ids: list[int], logprob_start_len: int) -> None:
        super().__init__(rid, input_ids, logprob_start_len)
        self.event = asyncio.Event()
        self.deltas: list[str] = []

    def finish_here(self, reason: dict) -> None:
        """End the request without waiting for the scheduler (server shutdown)."""
        self.meta["finish_reason"] = reason
        self.meta["e2e_latency"] = time.monotonic() - self.created
        self.finished = True
        self.event.set()


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, scheduler_info: dict, metrics=None) -> None:
        self.server_args = server_args
        self.scheduler_info = scheduler_info
        self.context_len = scheduler_info["context_len"]
        self.max_total_num_tokens = scheduler_info["max_total_num_tokens"]
        self.vocab_size = scheduler_info["vocab_size"]
        self.tokenizer = load_tokenizer(server_args.tokenizer_path, server_args.trust_remote_code)
        if server_args.chat_template is not None:
            with open(server_args.chat_template, encoding="utf-8") as f:
                self.tokenizer.chat_template = f.read()
        ctx = zmq.asyncio.Context(2)
        self.recv_from_workers = get_zmq_socket(ctx, zmq.PULL, port_args.tokenizer_ipc_name, True)
        self.send_to_scheduler = get_zmq_socket(ctx, zmq.PUSH, port_args.scheduler_input_ipc_name, False)
        self.states: dict[str, _LiveState] = {}  # internal id -> state
        self.rid_in_flight: dict[str, str] = {}  # client rid -> internal id
        self.control_waiters: dict[type, list[asyncio.Future]] = {}
        self.metrics = metrics
        self._loop_task: asyncio.Task | None = None
        self.bytes_per_token_bound = max_input_bytes_per_token(self.tokenizer)
        self._pool = ThreadPoolExecutor(max_workers=min(8, max(2, os.cpu_count() or 1)),
                                        thread_name_prefix="tokenize")
        self.shutting_down = False
        # Grammars are compiled here too (cached, in the backend's pool) so that a bad one is a 400
        # before anything is sent; the scheduler compiles its own copy (its own cache).
        self.grammar_backend = create_grammar_backend(server_args, self.tokenizer, self.vocab_size)

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

    async def run_in_pool(self, fn: Callable[..., T], *args: Any) -> T:
        """CPU work of a request (tokenizing, chat templates) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def flush_cache(self) -> FlushCacheReqOutput:
        return await self._control(FlushCacheReq(), FlushCacheReqOutput)

    async def get_load(self) -> SchedulerStats:
        return await self._control(GetLoadReq(), SchedulerStats)

    # -- requests -------------------------------------------------------------------------------------
    def _checked_ids(self, input_ids: list) -> list[int]:
        ids = list(input_ids)
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in ids):
            raise RequestError(f"input_ids must be token ids in [0, {self.vocab_size})", param="input_ids")
        return ids

    def min_prompt_tokens(self, text: str) -> int:
        """A lower bound on len(tokenize(text)) from its UTF-8 length alone (0 if none is known)."""
        if self.bytes_per_token_bound is None:
            return 0
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.bytes_per_token_bound)

    def build_sampling_params(self, params: dict | None) -> SamplingParams:
        try:
            sp = SamplingParams.from_dict(dict(params or {}))
            sp.normalize(self.tokenizer)
            sp.verify(self.vocab_size)
        except (TypeError, ValueError) as e:
            raise RequestError(str(e), param=_param_of(str(e))) from None
        return sp

    def check_length(self, n_input: int, max_new_tokens: int | None, at_least: bool = False) -> None:
        """The context and KV-cache limits; `at_least`: n_input is only a lower bound (pre-check)."""
        err = request_length_error(n_input, max_new_tokens, self.context_len, self.max_total_num_tokens,
                                   self.scheduler_info["page_size"], at_least,
                                   self.scheduler_info.get("tokens_per_step", 1))
        if err is not None:
            raise RequestError(err.message, param=err.param, code=err.code)

    def prepare_sync(self, req: GenerateRequest) -> tuple[str, list[int], SamplingParams]:
        """Validate and tokenize (blocking: call through `prepare`); raises RequestError."""
        sp = self.build_sampling_params(req.sampling_params)
        if req.input_ids is not None:
            self.check_length(len(req.input_ids), sp.max_new_tokens)
            ids = self._checked_ids(req.input_ids)
        elif req.text is not None:
            self.check_length(self.min_prompt_tokens(req.text), sp.max_new_tokens, at_least=True)
            ids = self.tokenizer.encode(req.text, add_special_tokens=False)
            self.check_length(len(ids), sp.max_new_tokens)
        else:
            raise RequestError("either text (prompt) or input_ids is required", param="prompt")
        self.check_constraints(req, sp)
        if req.bootstrap_room is not None and self.server_args.disaggregation_mode == "null":
            raise RequestError("bootstrap_room is for PD disaggregation: this server was not started with "
                               "--disaggregation-mode prefill or decode", param="bootstrap_room")
        if req.bootstrap_room is not None and (req.bootstrap_host is None or req.bootstrap_port is None):
            raise RequestError("bootstrap_room needs bootstrap_host and bootstrap_port", param="bootstrap_host")
        return req.rid or uuid.uuid4().hex, ids, sp

    def check_constraints(self, req: GenerateRequest, sp: SamplingParams) -> None:
        """custom_logit_processor allowed and loadable; the grammar (if any) compiles (blocking,
        cached: run it in the pool, as prepare does); hidden states only where the server allows."""
        if req.return_hidden_states and not self.server_args.enable_return_hidden_states:
            raise RequestError("return_hidden_states needs the server started with --enable-return-hidden-states",
                               param="return_hidden_states")
        if req.custom_logit_processor is not None:
            if not self.server_args.enable_custom_logit_processor:
                raise RequestError(CUSTOM_LOGIT_PROCESSOR_DISABLED, param="custom_logit_processor")
            try:
                load_custom_logit_processor(req.custom_logit_processor)
            except ValueError as e:
                raise RequestError(str(e), param="custom_logit_processor") from None
        key = grammar_key(sp)
        if key is None:
            return
        field = KIND_TO_FIELD[key[0]]
        if self.grammar_backend is None:
            raise RequestError(STRUCTURED_OUTPUTS_DISABLED, param=field)
        error = self.grammar_backend.validate(key)
        if error is not None:
            raise RequestError(error, param=field)

    async def prepare(self, req: GenerateRequest) -> tuple[str, list[int], SamplingParams]:
        """Validate and tokenize in the pool; raises RequestError before anything is sent."""
        return await self.run_in_pool(self.prepare_sync, req)

    def check_can_start(self, rid: str) -> None:
        if self.shutting_down:
            raise RequestError("the server is shutting down", 503, err_type="server_error")
        if rid in self.rid_in_flight:
            raise RequestError(f"request id (rid) {rid!r} is still in flight; use another rid or wait for it "
                               "to finish", param="rid")

    async def generate(self, req: GenerateRequest, prepared=None) -> AsyncIterator[dict]:
        """Yields {"text_delta", "result"} updates; the last one has meta_info.finish_reason set.
        Cancelling the consumer (a client that went away) aborts the request."""
        rid, ids, sp = prepared or await self.prepare(req)
        self.check_can_start(rid)
        iid = uuid.uuid4().hex
        state = _LiveState(rid, ids, req.logprob_start_len if req.return_logprob else -1)
        self.states[iid], self.rid_in_flight[rid] = state, iid
        if self.metrics is not None:
            self.metrics.observe_request(len(ids))
        if self.server_args.log_requests:
            logger.info("request %s: %d prompt tokens, sampling %s, logprob=%s stream=%s", rid, len(ids),
                        sp.to_dict(), req.return_logprob, req.stream)
        await self.send_to_scheduler.send_pyobj(TokenizedGenerateReqInput(
            iid, ids, sp, req.return_logprob, req.logprob_start_len, req.top_logprobs_num, req.stream, req.text,
            return_hidden_states=req.return_hidden_states, custom_logit_processor=req.custom_logit_processor,
            bootstrap_host=req.bootstrap_host, bootstrap_port=req.bootstrap_port, bootstrap_room=req.bootstrap_room))
        try:
            while True:
                await state.event.wait()
                state.event.clear()
                delta, state.deltas = "".join(state.deltas), []
                yield {"text_delta": delta, "result": state.result()}
                if state.finished:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            if not state.finished:
                self.abort(iid)
            raise
        finally:
            if state.finished:
                self._forget(iid)
                if self.server_args.log_requests:
                    m = state.meta
                    logger.info("finished %s: %s, %d completion tokens, %d cached, %.3fs", rid, m["finish_reason"],
                                m["completion_tokens"], m["cached_tokens"], m.get("e2e_latency", 0.0))

    def _forget(self, iid: str) -> None:
        state = self.states.pop(iid, None)
        if state is not None and self.rid_in_flight.get(state.rid) == iid:
            del self.rid_in_flight[state.rid]

    def abort(self, iid: str) -> None:
        """Ask the scheduler to drop request `iid` (an internal id) and forget it here: its abort
        output, or a late normal one, finds no state and is ignored."""
        if iid not in self.states:
            return
        self._forget(iid)
        asyncio.ensure_future(self.send_to_scheduler.send_pyobj(AbortReq(iid)))

    def abort_request(self, rid: str | None, abort_all: bool = False) -> int:
        """/abort_request: ask the scheduler to end request `rid` (or every one); unlike `abort`, the
        state stays, so its client is answered by the scheduler's abort output (finish reason abort:
        a 400 for a single request, the item's finish reason in a batch or a stream). Returns how
        many were asked."""
        iids = list(self.states) if abort_all else [self.rid_in_flight[rid]] if rid in self.rid_in_flight else []
        for iid in iids:
            asyncio.ensure_future(self.send_to_scheduler.send_pyobj(AbortReq(iid)))
        return len(iids)

    def abort_all(self, message: str, status_code: int = 503) -> int:
        """End every request in flight now (each client gets an abort finish), e.g. at shutdown."""
        n = len(self.states)
        for iid, state in list(self.states.items()):
            self.abort(iid)
            state.finish_here({"type": "abort", "message": message, "status_code": status_code})
        return n

    async def generate_full(self, req: GenerateRequest, prepared=None) -> dict:
        result = None
        async for update in self.generate(req, prepared):
            result = update["result"]
        return result


def _param_of(message: str) -> str | None:
    # SamplingParams.verify messages look like "sampling_params.<name> ...".
    if message.startswith("sampling_params."):
        return message.split()[0].split(".", 1)[1]
    return None

