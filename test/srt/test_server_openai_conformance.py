"""OpenAI / upstream-SGLang API conformance through a real server and the official `openai`
client (issue 33): usage with n > 1, the default completion length, and the error body shape
every route returns."""

from __future__ import annotations

import json

import openai
import requests
import pytest

from sglang.srt.testing.server import ServerProcess

MODEL = "builtin:tiny-deepseek-v32"
CONTEXT = 112  # small, so a request without max_tokens runs to the context quickly on CPU
LONG = "The quick brown fox jumps over the lazy dog. " * 3


@pytest.fixture(scope="module")
def server():
    with ServerProcess(MODEL, "--max-total-tokens", "8192", "--context-length", str(CONTEXT),
                       "--random-seed", "0") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _stream_usage(stream):
    usage = [c.usage for c in stream if c.usage is not None]
    assert len(usage) == 1
    return usage[0]


# -- usage with n > 1 --------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_completions_usage_bills_each_prompt_and_its_cache_once(client, stream):
    one = client.completions.create(model="default", prompt=LONG, max_tokens=2, temperature=0)
    p = one.usage.prompt_tokens
    kw = dict(model="default", prompt=[LONG, LONG + " Again."], n=3, max_tokens=2, temperature=0,
              extra_body={"ignore_eos": True})
    if stream:
        u = _stream_usage(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    else:
        u = client.completions.create(**kw).usage
    p2 = client.completions.create(model="default", prompt=LONG + " Again.", max_tokens=1).usage.prompt_tokens
    assert u.prompt_tokens == p + p2 and u.completion_tokens == 2 * 3 * 2
    cached = u.prompt_tokens_details.cached_tokens
    assert 0 < cached <= u.prompt_tokens  # the first prompt was cached by `one`; was 6 x ~p before


@pytest.mark.parametrize("stream", [False, True])
def test_chat_usage_bills_the_prompt_and_its_cache_once(client, stream):
    msgs = [{"role": "user", "content": LONG}]
    one = client.chat.completions.create(model="default", messages=msgs, max_tokens=2, temperature=0)
    kw = dict(model="default", messages=msgs, n=4, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    if stream:
        u = _stream_usage(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                         **kw))
    else:
        u = client.chat.completions.create(**kw).usage
    assert u.prompt_tokens == one.usage.prompt_tokens and u.completion_tokens == 4 * 3
    assert 0 < u.prompt_tokens_details.cached_tokens <= u.prompt_tokens


# -- the default completion length --------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_chat_without_max_tokens_runs_to_the_context(client, stream):
    kw = dict(model="default", messages=[{"role": "user", "content": "Tell me a story."}], temperature=0,
              extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        u = _stream_usage(chunks)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        r = client.chat.completions.create(**kw)
        u, finish = r.usage, [r.choices[0].finish_reason]
    assert finish == ["length"]
    # was 128 completion tokens (cut there; a 400 here, where the prompt + 128 exceeds the context)
    assert u.prompt_tokens + u.completion_tokens == CONTEXT


def test_completions_default_to_16_tokens_as_openai(client):
    kw = dict(model="default", prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True})
    assert client.completions.create(**kw).usage.completion_tokens == 16
    assert client.completions.create(max_tokens=None, **kw).usage.completion_tokens == 16  # null: the default


def test_native_generate_null_max_new_tokens_is_the_context(server):
    def completion(sp: dict) -> dict:
        r = requests.post(server.base_url + "/generate", json={"text": "Once", "sampling_params": {
            "temperature": 0, "ignore_eos": True, **sp}}, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]

    assert completion({"max_new_tokens": 3})["completion_tokens"] == 3
    meta = completion({"max_new_tokens": None})  # null: upstream's "bounded by the context"
    assert meta["prompt_tokens"] + meta["completion_tokens"] == CONTEXT


# -- json_schema strings never hold raw control characters --------------------------------------------
def test_json_schema_output_parses_when_the_model_wants_control_characters(client, builtin_path):
    """A logit bias makes every control-character token the model's favourite; a length-bounded string
    used to take them raw (xgrammar#286), so json.loads failed on the reply."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(builtin_path("tiny-deepseek-v32"))
    # Not \t \n \r: they are JSON whitespace too, where the grammar may take them without end.
    control = [t for t in range(len(tok)) if any(ord(c) < 0x20 and c not in "\t\n\r" for c in tok.decode([t]))]
    assert control
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 12}}, "required": ["s"]}
    for seed in range(3):
        r = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Write tabs."}], max_tokens=60, seed=seed,
            logit_bias={str(t): 100 for t in control},
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert isinstance(json.loads(r.choices[0].message.content)["s"], str)


# -- one error body on every route ---------------------------------------------------------------------
def _assert_error_shape(body: dict, status: int, param: str | None = None) -> None:
    """Upstream SGLang's ErrorResponse at the top level, OpenAI's {"error": ...} beside it."""
    names = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}
    assert body["object"] == "error" and body["type"] == names[status] and body["code"] == status, body
    assert body["message"] and body["message"] == body["error"]["message"], body
    assert body["param"] == body["error"]["param"] and (param is None or body["param"] == param), body
    assert isinstance(body["error"]["type"], str) and body["error"]["type"].endswith("_error"), body


def test_score_error_is_upstreams_error_response(server):
    # upstream's TestOpenAIV1Score::test_score_error_handling, verbatim in what it asserts
    r = requests.post(server.base_url + "/v1/score", timeout=60, json={
        "model": "default", "query": "The capital of France is", "items": ["Paris", "London"],
        "label_token_ids": [999999], "apply_softmax": True})
    assert r.status_code == 400
    assert r.json()["type"] == "BadRequestError"
    assert "Token ID 999999 is out of vocabulary" in r.json()["message"]
    _assert_error_shape(r.json(), 400, "label_token_ids")


@pytest.mark.parametrize("method,path,body,status", [
    ("post", "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("post", "/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": 10**6}, 400),
    ("post", "/v1/completions", {"model": "default", "prompt": "hi", "temperature": "hot"}, 400),
    ("post", "/v1/chat/completions", "{not json", 400),
    ("post", "/generate", {"text": "hi", "sampling_params": {"tmperature": 1}}, 400),
    ("post", "/v1/score", {"query": "q", "items": ["a"], "label_token_ids": []}, 400),
    ("get", "/v1/no-such-route", None, 404),
    ("get", "/v1/models/nope", None, 404),
])
def test_every_route_returns_the_one_error_body(server, method, path, body, status):
    kw = {"data": body} if isinstance(body, str) else {"json": body} if body is not None else {}
    r = getattr(requests, method)(server.base_url + path, timeout=60, **kw)
    assert r.status_code == status, r.text
    _assert_error_shape(r.json(), status)
    assert server.internal_state() is not None  # still serving


def test_the_openai_client_parses_every_error(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_found" and e.value.type == "invalid_request_error" and "nope" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt="hi", max_tokens=10**6)
    assert e.value.param and e.value.code == "context_length_exceeded", e.value.body
    # Streamed, it is refused before the first event: the same 400 (the in-stream event: test_error_body).
    with pytest.raises(openai.BadRequestError) as e:
        list(client.completions.create(model="default", prompt="hi", max_tokens=10**6, stream=True))
    assert "maximum context length" in e.value.message, e.value.body
