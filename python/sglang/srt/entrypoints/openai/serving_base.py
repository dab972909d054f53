"""The request flow both OpenAI handlers share: build -> stream, or gather -> error check -> render."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from sglang.srt.entrypoints.openai.utils import abort_error, request_error_response
from sglang.srt.entrypoints.request_io import ClientDisconnected, SafeJSONResponse, unless_disconnected
from sglang.srt.managers.tokenizer_manager import RequestError, TokenizerManager

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody reads it


class OpenAIServingBase:
    """Subclasses give `async _build(req) -> [(GenerateRequest, prepared, prompt_index)]`,
    `_stream(req, items)` (an async SSE generator) and `_render(req, items, results) -> dict`."""

    def __init__(self, tm: TokenizerManager, served_model_name: str) -> None:
        self.tm, self.served_model_name = tm, served_model_name

    async def handle(self, req, raw: Request):
        try:
            items = await self._build(req)
        except RequestError as e:
            return request_error_response(e)
        if req.stream:
            try:  # refuse now with a status code, not inside a 200 stream
                for _, (rid, _, _), _ in items:
                    self.tm.check_can_start(rid)
            except RequestError as e:
                return request_error_response(e)
            return StreamingResponse(self._stream(req, items), media_type="text/event-stream")
        work = asyncio.gather(*[self.tm.generate_full(base, prepared) for base, prepared, _ in items])
        try:
            results = await unless_disconnected(raw, work)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except RequestError as e:
            return request_error_response(e)
        aborted = abort_error(results)
        if aborted is not None:
            return aborted
        for (_, _, pi), res in zip(items, results):
            res["meta_info"]["prompt_index"] = pi  # usage bills each distinct prompt once
        return SafeJSONResponse(self._render(req, items, results))
