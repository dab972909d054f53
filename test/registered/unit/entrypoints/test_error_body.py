"""The one error body (openai/utils.error_body) as the official `openai` client parses it, with no
server: an httpx MockTransport answers the client's requests with our bodies, so the client's own
status -> exception mapping and its SSE error handling run on exactly what the server sends."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from sglang.srt.entrypoints.openai.utils import error_body, error_response, request_error_body, sse
from sglang.srt.managers.tokenizer_manager import RequestError


def _client(status: int, content: bytes, content_type: str) -> openai.OpenAI:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=content, headers={"content-type": content_type})

    return openai.OpenAI(base_url="http://test/v1", api_key="x", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(answer)))


@pytest.mark.parametrize("status,cls,name", [
    (400, openai.BadRequestError, "BadRequestError"), (401, openai.AuthenticationError, "AuthenticationError"),
    (404, openai.NotFoundError, "NotFoundError"), (413, openai.APIStatusError, "BadRequestError"),
    (422, openai.UnprocessableEntityError, "UnprocessableEntityError"), (429, openai.RateLimitError, "RateLimitError"),
    (500, openai.InternalServerError, "InternalServerError"), (503, openai.InternalServerError, "InternalServerError"),
])
def test_the_openai_client_parses_every_status(status, cls, name):
    resp = error_response("no good", status, "invalid_request_error", param="max_tokens", code="some_code")
    body = json.loads(resp.body)
    # upstream SGLang's ErrorResponse, top level
    assert (body["object"], body["message"], body["type"], body["param"], body["code"]) == (
        "error", "no good", name, "max_tokens", status)
    with pytest.raises(cls) as e:
        _client(status, resp.body, "application/json").completions.create(model="m", prompt="p")
    assert e.value.status_code == status
    assert (e.value.type, e.value.code, e.value.param) == ("invalid_request_error", "some_code", "max_tokens")
    assert "no good" in e.value.message


def test_a_stream_error_event_is_raised_by_the_client():
    err = RequestError("the server is shutting down", 503, err_type="server_error")
    stream = (sse({"id": "c", "object": "text_completion", "created": 0, "model": "m",
                   "choices": [{"index": 0, "text": "a", "finish_reason": None, "logprobs": None}]})
              + sse(request_error_body(err))).encode()
    chunks = []
    with pytest.raises(openai.APIError) as e:
        for c in _client(200, stream, "text/event-stream").completions.create(model="m", prompt="p", stream=True):
            chunks.append(c)
    assert [c.choices[0].text for c in chunks] == ["a"]  # the event before the error still arrived
    assert e.value.message == "the server is shutting down" and e.value.type == "server_error"


def test_error_body_is_one_shape():
    b = error_body("m", 404, "not_found_error", "model", "model_not_found")
    assert b == {"object": "error", "message": "m", "type": "NotFoundError", "param": "model", "code": 404,
                 "error": {"message": "m", "type": "not_found_error", "param": "model", "code": "model_not_found"}}
