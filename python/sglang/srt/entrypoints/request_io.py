"""Request bodies in and JSON out, one path for every HTTP route.

In: the body must be UTF-8 JSON that Python's json can parse (not nested past the recursion
limit) and hold no lone UTF-16 surrogate (JSON lets `"\\ud800"` through, no tokenizer can encode
it); OpenAI-shaped models are then validated by pydantic. Every failure is a `RequestError`
(400 naming the field, as upstream answers validation errors -- not FastAPI's 422). Parsing runs
in a worker thread, so a large body does not stall the loop.
Out: JSON has no NaN / Infinity, so non-finite floats are written as OpenAI does for impossible
tokens (-inf -> -9999.0) or as null (NaN), in responses and in SSE events alike.
While a non-streaming request runs, its client's disconnect is watched so the request is
aborted at once (streams get the same from Starlette's disconnect listener).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any, Awaitable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from sglang.srt.managers.tokenizer_manager import RequestError

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

# A lone surrogate can only arrive as a \uD800-\uDFFF escape (raw surrogate bytes are not UTF-8),
# so bodies without such an escape skip the walk over the parsed value.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
LOGPROB_FLOOR = -9999.0  # OpenAI's value for "impossible"


# -- in ----------------------------------------------------------------------------------------------
def parse_json_body(body: bytes) -> Any:
    """Bytes -> JSON value, or RequestError (400)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise RequestError(f"request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise RequestError("request body is not valid JSON (nested too deeply)") from None
    if _SURROGATE_ESCAPE.search(body):
        path = _first_surrogate(value)
        if path is not None:
            raise RequestError(f"{path or 'request body'} contains a lone UTF-16 surrogate, which is not valid "
                               "Unicode text", param=path or None)
    return value


def validate_model(model: type[M], value: Any) -> M:
    """JSON value -> pydantic model, or RequestError (400, as upstream, naming the first bad field)."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        first = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if not _is_union_tag(x))
        raise RequestError(f"invalid request: {loc}: {first.get('msg', 'invalid value')}", 400,
                           param=loc or None) from None
    except RecursionError:
        raise RequestError("request body is nested too deeply", 400) from None


# pydantic names the union member an error came from inside `loc` ("tokens.list[int].0"); the
# client's field path is what the error should name ("tokens.0").
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "tuple"}


def _is_union_tag(x: Any) -> bool:
    return isinstance(x, str) and ("[" in x or x in _TYPE_TAGS)


async def read_json(raw: Request) -> Any:
    return await asyncio.to_thread(parse_json_body, await raw.body())


async def read_model(raw: Request, model: type[M]) -> M:
    body = await raw.body()
    return await asyncio.to_thread(lambda: validate_model(model, parse_json_body(body)))


def _first_surrogate(value: Any) -> str | None:
    """Path (`messages[0].content`) of the first string, key or value, with a lone surrogate."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return path
        elif isinstance(v, dict):
            for k, x in reversed(list(v.items())):
                sub = f"{path}.{k}" if path else str(k)
                if _SURROGATE.search(k):
                    return sub
                stack.append((sub, x))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in reversed(list(enumerate(v))))
    return None


# -- out ---------------------------------------------------------------------------------------------
def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else (LOGPROB_FLOOR if obj < 0 else -LOGPROB_FLOOR)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """Strict JSON (never NaN / Infinity); the sanitising copy is made only when needed."""
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(obj), ensure_ascii=False, allow_nan=False)


class SafeJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8", "replace")


# -- disconnects -------------------------------------------------------------------------------------
class ClientDisconnected(Exception):
    pass


async def _until_disconnect(raw: Request) -> None:
    # The body is already read, so the next ASGI message is the disconnect (or nothing).
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(raw: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client goes away first, cancel it (which aborts its requests) and
    raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnect(raw))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled: take the work with it
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()
