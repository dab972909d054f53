"""Shared helpers of the OpenAI-compatible handlers: errors, SSE, fan-out of n choices."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from sglang.srt.entrypoints.request_io import SafeJSONResponse, dumps
from sglang.srt.managers.tokenizer_manager import RequestError
from sglang.srt.managers.tokenizer_utils import byte_level_decoder


# The exception the openai client raises for a status; upstream SGLang's ErrorResponse.type names it.
_ERROR_CLASSES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                  404: "NotFoundError", 409: "ConflictError", 422: "UnprocessableEntityError", 429: "RateLimitError"}


def error_class(status_code: int) -> str:
    if status_code >= 500:
        return "InternalServerError"
    return _ERROR_CLASSES.get(status_code, "BadRequestError")


def error_body(message: str, status_code: int = 400, err_type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """Every error this server returns, in a response or a stream event: upstream SGLang's
    ErrorResponse at the top level ({"object": "error", message, type: the error class, param, code:
    the HTTP status}) and OpenAI's own {"error": {message, type, param, code}} beside it. The openai
    client reads "error" first (its exception's type / code are OpenAI's); upstream's clients read the
    top level."""
    return {"object": "error", "message": message, "type": error_class(status_code), "param": param,
            "code": status_code, "error": {"message": message, "type": err_type, "param": param, "code": code}}


def request_error_body(e: RequestError) -> dict[str, Any]:
    return error_body(e.message, e.status_code, e.err_type, e.param, e.code)


def error_response(message: str, status_code: int = 400, err_type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> SafeJSONResponse:
    return SafeJSONResponse(error_body(message, status_code, err_type, param, code), status_code=status_code)


def request_error_response(e: RequestError) -> SafeJSONResponse:
    return SafeJSONResponse(request_error_body(e), status_code=e.status_code)


def abort_error(results: list[dict]) -> SafeJSONResponse | None:
    """A request the scheduler refused or aborted becomes an error response, not a choice."""
    for r in results:
        fr = r["meta_info"].get("finish_reason") or {}
        if fr.get("type") == "abort":
            status = fr.get("status_code", 400)
            return error_response(fr.get("message", "request aborted"), status,
                                  "server_error" if status >= 500 else "invalid_request_error")
    return None


def last_token_hidden(hidden: list) -> list:
    """The hidden states an OpenAI-route choice carries, upstream's: the last generated token's row
    ([] when only the prompt's block is there); /generate's meta_info keeps every row."""
    return hidden[-1] if len(hidden) > 1 else []


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def check_model(served_name: str, requested: str | None) -> None:
    if requested not in (None, "", "default", served_name):
        raise RequestError(f"The model `{requested}` does not exist; this server serves `{served_name}`.",
                           status_code=404, param="model", code="model_not_found")


async def merge_streams(streams: list[AsyncIterator[dict]]) -> AsyncIterator[tuple[int, dict]]:
    """Interleave several request streams as (index, update); cancels the rest on exit."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[dict]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
        except Exception as e:  # surface the error to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
                continue
            if isinstance(item, Exception):
                raise item
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def token_text(tokenizer, token_id: int) -> str:
    """A token's text; a token that is not valid UTF-8 alone (byte-level BPE) is spelled
    `bytes:\\xe2\\x80` as OpenAI does, so distinct tokens never share a key."""
    text = tokenizer.decode([token_id])
    if "\ufffd" in text:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in token_bytes(tokenizer, token_id))
    return text


def token_bytes(tokenizer, token_id: int) -> list[int]:
    """The token's raw bytes (byte-level BPE tokens can be partial UTF-8 sequences)."""
    tok = tokenizer.convert_ids_to_tokens(token_id)
    dec = byte_level_decoder()
    if isinstance(tok, str) and tok and all(ch in dec for ch in tok):
        return [dec[ch] for ch in tok]
    return list(token_text(tokenizer, token_id).encode("utf-8"))
