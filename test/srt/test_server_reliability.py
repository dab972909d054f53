"""Regression cases from outside testing (issue 9), through real server processes: --help,
malformed bodies that used to be 500s, abandoned non-stream requests, rid reuse, max_tokens 0,
huge prompts, SIGTERM with a stream in flight, and 100+ concurrent mixed clients.
Every wait is on a condition (the server's own state), never a fixed sleep."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import openai
import pytest
import requests

from sglang.srt.server_args import ServerArgs
from sglang.srt.testing.server import ServerProcess

MODEL = "builtin:tiny-deepseek-v32"
CAPACITY = 8192
CONTEXT = 512  # small, so "a prompt at the context length" is a cheap prefill
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(MODEL, "--max-total-tokens", str(CAPACITY), "--context-length", str(CONTEXT),
                       "--random-seed", "0") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _serving(server: ServerProcess) -> None:
    r = requests.post(server.base_url + "/generate", json={"text": "still here", "sampling_params": {
        "max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}, timeout=120)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2, r.text


def _kv_whole(server: ServerProcess) -> dict:
    st = server.wait_idle(timeout=120)
    assert st["kv_protected_tokens"] == 0 and st["kv_leak"] is None, st
    assert st["kv_free_tokens"] + st["kv_cached_tokens"] == CAPACITY, st
    return st


# -- start-up ----------------------------------------------------------------------------------------
def test_help_exits_0_and_lists_every_flag():
    r = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    for f in dataclasses.fields(ServerArgs):
        assert "--" + f.name.replace("_", "-") in r.stdout, f.name
    assert "% freq" in r.stdout and "(default: 8192)" in r.stdout  # literal % survives; defaults shown


# -- malformed bodies: 4xx naming the parameter, never a 500 ------------------------------------------
def _raw(obj) -> bytes:
    return json.dumps(obj).encode()  # ensure_ascii: "\ud800" goes out as the escape a client would send


SURROGATE = "bad \ud800 text"
BIG_BIAS = {"logit_bias": {"5": 1e39}}
BAD_BODIES = [
    # (path, raw body, status, param prefix)
    ("/v1/completions", _raw({"model": "default", "prompt": SURROGATE}), 400, "prompt"),
    ("/v1/completions", _raw({"model": "default", "prompt": ["ok", SURROGATE]}), 400, "prompt[1]"),
    ("/v1/completions", _raw({"model": "default", "prompt": "x", "stop": [SURROGATE]}), 400, "stop"),
    ("/v1/chat/completions", _raw({**CHAT, "messages": [{"role": "user", "content": SURROGATE}]}), 400, "messages"),
    ("/generate", _raw({"text": SURROGATE}), 400, "text"),
    ("/generate", _raw({"text": "x", "sampling_params": {"stop": SURROGATE}}), 400, "sampling_params.stop"),
    ("/v1/completions", _raw({"model": "default", "prompt": "x", "logprobs": 2, **BIG_BIAS}), 400, "logit_bias"),
    ("/v1/completions", _raw({"model": "default", "prompt": "x", "logprobs": 2, "stream": True, **BIG_BIAS}), 400,
     "logit_bias"),
    ("/v1/chat/completions", _raw({**CHAT, "logprobs": True, **BIG_BIAS}), 400, "logit_bias"),
    ("/v1/chat/completions", _raw({**CHAT, "logprobs": True, "stream": True, **BIG_BIAS}), 400, "logit_bias"),
    ("/generate", _raw({"text": "x", "return_logprob": True, "sampling_params": BIG_BIAS}), 400, "logit_bias"),
    ("/generate", _raw({"text": "x", "stream": True, "sampling_params": {"logit_bias": {"5": 101}}}), 400,
     "logit_bias"),
]
for _path in ("/v1/completions", "/v1/chat/completions", "/generate"):
    BAD_BODIES += [(_path, b'{"text": ' * 50_000 + b"1" + b"}" * 50_000, 400, None),  # RecursionError before
                   (_path, b'{"prompt": "\xff\xfe"}', 400, None)]  # UnicodeDecodeError before


@pytest.mark.parametrize("path,body,status,param", BAD_BODIES,
                         ids=[f"{p}-{i}" for i, (p, *_) in enumerate(BAD_BODIES)])
def test_malformed_bodies_get_4xx_naming_the_param(server, path, body, status, param):
    r = requests.post(server.base_url + path, data=body, headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")  # an error, not a stream of NaN
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["param"] or "").startswith(param or ""), err
    assert "Error" not in err["message"] and "argument" not in err["message"], err  # no tokenizer internals
    _serving(server)


def test_in_range_logit_bias_with_logprobs_is_strict_json(server, client):
    # The bias limit itself: 100 makes token 5 certain; every float in the answer is finite JSON.
    r = requests.post(server.base_url + "/v1/completions", json={
        "model": "default", "prompt": "x", "max_tokens": 3, "logprobs": 5, "logit_bias": {"5": 100}, "temperature": 0})
    assert r.status_code == 200, r.text
    json.loads(r.text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert client.completions.create(model="default", prompt="x", max_tokens=3, logit_bias={"5": -100},
                                     temperature=0).choices[0].finish_reason == "length"
