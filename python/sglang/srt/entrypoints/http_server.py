"""FastAPI app: OpenAI-compatible routes plus SGLang's native ones.

Every error has one body (openai/utils.error_body: upstream SGLang's ErrorResponse at the top
level, OpenAI's {"error": {...}} beside it) with a 4xx status for bad requests; unexpected exceptions become a 500 and the server keeps serving. Every route
reads its body through request_io (one parsing path) and writes JSON through it (no NaN).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    TokenizeRequest,
    now_s,
)
from sglang.srt.entrypoints.openai.serving_chat import ChatHandler
from sglang.srt.entrypoints.openai.serving_completions import CompletionHandler
from sglang.srt.entrypoints.openai.serving_responses import ResponsesHandler, ResponsesRequest
from sglang.srt.entrypoints.openai.serving_score import OpenAIServingScore, ScoringRequest
from sglang.srt.entrypoints.openai.serving_base import CLIENT_CLOSED_REQUEST
from sglang.srt.entrypoints.openai.serving_tokenize import OpenAIServingDetokenize, OpenAIServingTokenize
from sglang.srt.entrypoints.openai.utils import (
    SSE_DONE,
    abort_error,
    error_response,
    request_error_body,
    request_error_response,
    sse,
)
from sglang.srt.entrypoints.request_io import (
    ClientDisconnected,
    SafeJSONResponse,
    read_json,
    read_model,
    unless_disconnected,
)
from sglang.srt.managers.tokenizer_manager import GenerateRequest, RequestError, TokenizerManager
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error"}
_GENERATE_KEYS = {"text", "input_ids", "sampling_params", "stream", "return_logprob", "logprob_start_len",
                  "top_logprobs_num", "rid", "return_text_in_logprobs", "return_hidden_states",
                  "custom_logit_processor", "bootstrap_host", "bootstrap_port", "bootstrap_room"}


def create_app(tm: TokenizerManager, server_args: ServerArgs, metrics=None, version: str = "") -> FastAPI:
    """The app: the guard middleware, one JSON error body for every failure, then the routes by group
    (registration order is match order: a fixed path before its `{param}` sibling)."""
    app = FastAPI(title="sglang (DSA)", version=version, default_response_class=SafeJSONResponse)

    @app.on_event("startup")
    async def _start() -> None:
        tm.start()

    app.add_middleware(GuardMiddleware, api_key=server_args.api_key, max_payload_size=server_args.max_payload_size)
    _register_error_handlers(app)
    chat = _register_openai_routes(app, tm, server_args)
    _register_responses_routes(app, ResponsesHandler(chat))
    _register_generate_routes(app, tm)
    _register_info_routes(app, tm, server_args, metrics, version)
    return app


def _register_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):  # keep serving; report as JSON
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(f"internal server error: {type(exc).__name__}: {exc}", 500, "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(str(exc.detail), exc.status_code, _STATUS_TYPES.get(exc.status_code, "server_error"))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):  # upstream: 400, not FastAPI's 422
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return error_response(f"invalid request: {loc}: {first.get('msg', 'invalid value')}", 400, param=loc or None)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return request_error_response(exc)


def _register_openai_routes(app: FastAPI, tm: TokenizerManager, server_args: ServerArgs) -> ChatHandler:
    """/v1/models, tokenize / detokenize, score, completions and chat; returns the chat handler (the
    Responses API runs on it)."""
    served = server_args.served_model_name
    completions = CompletionHandler(tm, served)
    chat = ChatHandler(tm, served, server_args.reasoning_parser, server_args.tool_call_parser)
    tokenize, detokenize = OpenAIServingTokenize(tm, served), OpenAIServingDetokenize(tm, served)
    score = OpenAIServingScore(tm, served)

    def model_card() -> dict:
        return ModelCard(id=served, created=now_s(), root=server_args.model_path,
                         max_model_len=tm.context_len).model_dump()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")  # ids may contain '/' (a model path)
    async def retrieve_model(model_id: str):
        if model_id != served:
            return error_response(f"The model `{model_id}` does not exist; this server serves `{served}`.", 404,
                                  param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/tokenize")
    @app.post("/tokenize")
    async def v1_tokenize(raw: Request):
        return await tokenize.handle(await read_model(raw, TokenizeRequest))

    @app.post("/v1/detokenize")
    @app.post("/detokenize")
    async def v1_detokenize(raw: Request):
        return await detokenize.handle(await read_model(raw, DetokenizeRequest))

    @app.post("/v1/score")
    async def v1_score(raw: Request):
        return await score.handle(await read_model(raw, ScoringRequest))

    @app.post("/v1/completions")
    async def v1_completions(raw: Request):
        return await completions.handle(await read_model(raw, CompletionRequest), raw)

    @app.post("/v1/chat/completions")
    async def v1_chat(raw: Request):
        return await chat.handle(await read_model(raw, ChatCompletionRequest), raw)
    return chat


def _register_responses_routes(app: FastAPI, responses: ResponsesHandler) -> None:
    """The Responses API: create, retrieve, cancel, delete, input items."""
    @app.post("/v1/responses")
    async def v1_responses(raw: Request):
        return await responses.create(await read_model(raw, ResponsesRequest))

    @app.get("/v1/responses/{response_id}")
    async def v1_responses_get(response_id: str):
        return responses.retrieve(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def v1_responses_cancel(response_id: str):
        return responses.cancel(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def v1_responses_delete(response_id: str):
        return responses.delete(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def v1_responses_input_items(response_id: str):
        return responses.input_items(response_id)


def _register_generate_routes(app: FastAPI, tm: TokenizerManager) -> None:
    """SGLang's native /generate and the health checks."""
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(raw: Request):
        body = await read_json(raw)
        reqs, single = await asyncio.to_thread(_native_requests, body)  # O(len(input_ids)) checks
        with_text = bool(body.get("return_text_in_logprobs"))
        prepared = await asyncio.gather(*map(tm.prepare, reqs))
        reqs, prepared, single = _expand_choices(reqs, prepared, single)
        if body.get("stream"):
            if not single:
                return error_response("stream=true takes a single prompt with n = 1", 400, param="stream")
            tm.check_can_start(prepared[0][0])
            return StreamingResponse(_native_stream(tm, reqs[0], prepared[0], with_text),
                                     media_type="text/event-stream")
        try:
            results = await unless_disconnected(raw, asyncio.gather(*[tm.generate_full(r, p)
                                                                      for r, p in zip(reqs, prepared)]))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        aborted = abort_error(results) if len(results) == 1 else None  # a batch reports aborts per item
        if aborted is not None:
            return aborted
        if with_text:
            await tm.run_in_pool(lambda: [add_logprob_texts(r["meta_info"], tm.tokenizer) for r in results])
        return results[0] if single else results

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        try:
            stall = (await tm.get_load()).admission_stall
        except asyncio.TimeoutError:
            return error_response("generation health check failed: the scheduler does not answer", 503,
                                  "server_error")
        if stall is not None:  # a generation would wait behind the stalled queue
            return error_response(f"generation health check failed: {stall}", 503, "server_error")
        req = GenerateRequest(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
        try:
            await asyncio.wait_for(tm.generate_full(req), timeout=60)
        except Exception as e:
            return error_response(f"generation health check failed: {e}", 503, "server_error")
        return Response(status_code=200)


def _register_info_routes(app: FastAPI, tm: TokenizerManager, server_args: ServerArgs, metrics,
                          version: str) -> None:
    """Model / server info, cache flush and Prometheus metrics."""
    served = server_args.served_model_name

    @app.get("/get_model_info")
    @app.get("/model_info")  # newer upstream's name (get_ kept, as upstream does)
    async def model_info():
        return {"model_path": server_args.model_path, "tokenizer_path": server_args.tokenizer_path,
                "is_generation": True, "served_model_name": served,
                "architecture": tm.scheduler_info.get("architecture")}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        info: dict[str, Any] = dataclasses.asdict(server_args)
        info.pop("api_key", None)
        info.update({k: v for k, v in tm.scheduler_info.items() if k != "status"})
        info["version"] = version
        try:
            info["internal_states"] = [dataclasses.asdict(await tm.get_load())]
        except asyncio.TimeoutError:
            info["internal_states"] = []
        return info

    @app.post("/abort_request")
    async def abort_request(request: Request):
        """Upstream's: {"rid": ...} or {"abort_all": true}; the request's client gets an abort finish."""
        body = await request.json()
        if not isinstance(body, dict) or not (isinstance(body.get("rid"), str) or body.get("abort_all") is True):
            return error_response('abort_request takes {"rid": "<id>"} or {"abort_all": true}', 400, param="rid")
        tm.abort_request(body.get("rid"), bool(body.get("abort_all")))
        return Response(status_code=200)

    @app.get("/get_load")
    async def get_load():
        """Upstream's load report for routers: one entry per DP rank (one here)."""
        try:
            st = await tm.get_load()
        except asyncio.TimeoutError:
            return error_response("the scheduler does not answer", 503, "server_error")
        return [{"dp_rank": 0, "num_reqs": st.num_running_reqs + st.num_waiting_reqs,
                 "num_waiting_reqs": st.num_waiting_reqs, "num_tokens": st.num_used_tokens}]

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        out = await tm.flush_cache()
        if not out.success:
            return error_response(out.message, 400)
        return Response(content="Cache flushed.\n", status_code=200)

    @app.get("/metrics")
    async def metrics_route():
        if metrics is None:
            return error_response("metrics are disabled; start the server with --enable-metrics", 404)
        try:
            metrics.observe_scheduler(await tm.get_load())
        except asyncio.TimeoutError:
            pass
        return Response(content=metrics.render(), media_type="text/plain; version=0.0.4")


class GuardMiddleware:
    """Pure ASGI (streams and client disconnects pass through untouched): rejects bodies over
    --max-payload-size (413; a declared length at once, a chunked body as soon as it passes the
    limit) and, with --api-key, requests without the bearer token (401), except /health."""

    def __init__(self, app, api_key: str | None, max_payload_size: int) -> None:
        self.app, self.api_key, self.max_payload_size = app, api_key, max_payload_size

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        length = headers.get("content-length", "")
        reject = None
        if length.isdigit() and int(length) > self.max_payload_size:
            reject = self._too_large()
        elif self.api_key and scope.get("path") != "/health" and headers.get("authorization") != f"Bearer {self.api_key}":
            reject = error_response("Incorrect or missing API key (Authorization: Bearer ...).", 401,
                                    "authentication_error", code="invalid_api_key")
        if reject is not None:
            return await reject(scope, receive, send)
        if length.isdigit():
            return await self.app(scope, receive, send)
        return await self._counted(scope, receive, send)

    def _too_large(self):
        return error_response(f"Payload Too Large: the request body is larger than --max-payload-size "
                              f"({self.max_payload_size} bytes)", 413, param="max_payload_size")

    async def _counted(self, scope, receive, send):
        """A body without Content-Length (chunked): count it as it arrives."""
        seen, started = 0, False

        async def counted_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_payload_size:
                    raise _PayloadTooLarge()
            return msg

        async def tracked_send(msg):
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            return await self.app(scope, counted_receive, tracked_send)
        except _PayloadTooLarge:
            if not started:
                return await self._too_large()(scope, receive, send)


class _PayloadTooLarge(Exception):
    pass


def _typed(body: dict, key: str, types: tuple, default, check=None):
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
        names = "/".join(t.__name__ for t in types)
        raise RequestError(f"{key} must be {names}, got {type(v).__name__}", param=key)
    if check is not None and not check(v):
        raise RequestError(f"{key} has an invalid value {v!r}", param=key)
    return v


def _is_str_list(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, str) for t in x)


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _native_requests(body: dict) -> tuple[list[GenerateRequest], bool]:
    """Validate a native /generate body (types included: a bad one is a 400, never a 500)."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    unknown = sorted(set(body) - _GENERATE_KEYS)
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}", param=unknown[0])
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("exactly one of text or input_ids is required", param="text")
    if text is not None:
        if not (isinstance(text, str) or (_is_str_list(text) and text)):
            raise RequestError("text must be a string or a non-empty list of strings", param="text")
        single = isinstance(text, str)
        prompts = [{"text": t} for t in ([text] if single else text)]
    else:
        single = _is_ids(ids) and bool(ids)
        if not single and not (isinstance(ids, list) and ids and all(_is_ids(x) and x for x in ids)):
            raise RequestError("input_ids must be a list of token ids or a list of such lists", param="input_ids")
        prompts = [{"input_ids": x} for x in ([ids] if single else ids)]
    sp = _typed(body, "sampling_params", (dict, list), {})
    sps = sp if isinstance(sp, list) else [sp] * len(prompts)
    if len(sps) != len(prompts) or not all(isinstance(x, dict) for x in sps):
        raise RequestError(f"sampling_params must be an object or a list of {len(prompts)} objects",
                           param="sampling_params")
    rid = _typed(body, "rid", (str, list), None, lambda r: isinstance(r, str) or (
        _is_str_list(r) and len(r) == len(prompts) and len(set(r)) == len(r)))
    if isinstance(rid, str) and not single:
        raise RequestError("rid must be a list of distinct ids, one per prompt, for a batch", param="rid")
    rids = rid if isinstance(rid, list) else [rid] * len(prompts)
    return_logprob = _typed(body, "return_logprob", (bool,), False)
    start = _typed(body, "logprob_start_len", (int,), -1, lambda v: v >= -1)
    top_n = _typed(body, "top_logprobs_num", (int,), 0, lambda v: 0 <= v <= 20)
    stream = _typed(body, "stream", (bool,), False)
    _typed(body, "return_text_in_logprobs", (bool,), False)
    hidden = _typed(body, "return_hidden_states", (bool,), False)
    # Upstream: one processor string for all prompts, or a list with one (or null) per prompt.
    clp = _typed(body, "custom_logit_processor", (str, list), None, lambda c: isinstance(c, str) or (
        len(c) == len(prompts) and all(x is None or isinstance(x, str) for x in c)))
    clps = clp if isinstance(clp, list) else [clp] * len(prompts)
    # PD disaggregation (set by the router): one room per prompt
    bs_host = _typed(body, "bootstrap_host", (str,), None)
    bs_port = _typed(body, "bootstrap_port", (int,), None)
    room = _typed(body, "bootstrap_room", (int, list), None, lambda r: isinstance(r, int) or len(r) == len(prompts))
    rooms = room if isinstance(room, list) else [room] * len(prompts)
    reqs = [GenerateRequest(text=p.get("text"), input_ids=p.get("input_ids"), sampling_params=s,
                            return_logprob=return_logprob, logprob_start_len=start, top_logprobs_num=top_n,
                            stream=stream, rid=r if single or isinstance(rid, list) else None,
                            return_hidden_states=hidden, custom_logit_processor=c, bootstrap_host=bs_host,
                            bootstrap_port=bs_port, bootstrap_room=rm)
            for p, s, r, c, rm in zip(prompts, sps, rids, clps, rooms)]
    return reqs, single


def _expand_choices(reqs: list[GenerateRequest], prepared: list, single: bool) -> tuple[list, list, bool]:
    """sampling_params.n > 1: n choices of each prompt, prompt-major (upstream's parallel sampling
    order); the answer is then a list, for a single prompt too. Seeded choices differ
    (SamplingParams.for_choice)."""
    if all(sp.n == 1 for _, _, sp in prepared):
        return reqs, prepared, single
    out_r, out_p = [], []
    for r, (rid, ids, sp) in zip(reqs, prepared):
        for j in range(sp.n):
            out_r.append(r)
            out_p.append((f"{rid}-{j}" if sp.n > 1 else rid, ids, sp.for_choice(j)))
    return out_r, out_p, False


async def _native_stream(tm: TokenizerManager, req: GenerateRequest, prepared, with_text: bool = False):
    """Upstream /generate streaming: each event carries the whole text so far."""
    texts: dict[int, str] = {}
    try:
        async for update in tm.generate(req, prepared):
            if with_text:
                add_logprob_texts(update["result"]["meta_info"], tm.tokenizer, texts)
            yield sse(update["result"])
    except RequestError as e:
        yield sse(request_error_body(e))
    yield SSE_DONE


_LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs")
_TOP_KEYS = ("input_top_logprobs", "output_top_logprobs")


def add_logprob_texts(meta: dict, tokenizer, cache: dict[int, str] | None = None) -> None:
    """return_text_in_logprobs: each (logprob, id, None) becomes (logprob, id, text), the text of
    that token alone (upstream's shape)."""
    cache = {} if cache is None else cache

    def text(tid: int) -> str:
        if tid not in cache:
            cache[tid] = tokenizer.decode([tid])
        return cache[tid]

    for key in _LOGPROB_KEYS:
        if meta.get(key) is not None:
            meta[key] = [(lp, tid, text(tid)) for lp, tid, *_ in meta[key]]
    for key in _TOP_KEYS:
        if meta.get(key) is not None:
            meta[key] = [None if row is None else [(lp, tid, text(tid)) for lp, tid, *_ in row] for row in meta[key]]
