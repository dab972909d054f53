"""Regression cases from outside testing (issue 9), through real server processes: --help,
malformed bodies that used to be 500s, abandoned non-stream requests, rid reuse, max_tokens 0,
huge prompts, SIGTERM with a stream in flight, and 100+ concurrent mixed clients.
Every wait is on a condition (the server's own state), never a fixed sleep."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

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


# -- a non-stream client that goes away ----------------------------------------------------------------
def test_abandoned_non_stream_request_is_aborted_at_once(server):
    """The client disconnects while its 2000-token request runs: the request must stop within a
    step or so (the KV it leaves in the prefix cache shows how far it got), not run to the end."""
    requests.post(server.base_url + "/flush_cache", timeout=60)
    prompt = list(range(10, 26))
    sock = server.open_request("/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": CONTEXT - len(prompt), "temperature": 0, "ignore_eos": True}})
    server.wait_state(lambda st: st["num_running_reqs"] == 1, "running the request")
    sock.close()
    st = _kv_whole(server)
    generated = st["kv_cached_tokens"] - len(prompt)
    assert 0 <= generated < (CONTEXT - len(prompt)) // 2, st  # aborted, not run to completion


# -- rid ------------------------------------------------------------------------------------------------
def test_rid_reuse_right_after_cancel(server):
    """Cancel a stream, then reuse its rid at once: the new request must never get the old one's
    abort; at most it is told (400, param rid) that the rid is still in flight."""
    url = server.base_url + "/generate"
    long = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    outcomes = []
    for i in range(10):
        rid = f"reuse-{i}"
        with requests.post(url, json={"text": "count:", "rid": rid, "stream": True, "sampling_params": long},
                           stream=True, timeout=120) as resp:
            assert resp.status_code == 200
            next(line for line in resp.iter_lines() if line.startswith(b"data: {"))
        r = requests.post(url, json={"text": "again", "rid": rid, "sampling_params": {
            "max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}, timeout=120)
        if r.status_code == 200:
            meta = r.json()["meta_info"]
            assert meta["id"] == rid and meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 3
            outcomes.append("ok")
        else:
            assert r.status_code == 400 and r.json()["error"]["param"] == "rid", r.text
            assert "in flight" in r.json()["error"]["message"]
            outcomes.append("in flight")
    assert "ok" in outcomes, outcomes
    _kv_whole(server)


def test_rid_in_flight_is_refused(server):
    url = server.base_url + "/generate"
    body = {"text": "count:", "rid": "dup", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}
    with requests.post(url, json=body, stream=True, timeout=120) as resp:
        lines = resp.iter_lines()  # held: dropping the iterator would close the connection
        next(line for line in lines if line.startswith(b"data: {"))
        for second in (body, {**body, "stream": False}):
            r = requests.post(url, json=second, timeout=120)
            assert r.status_code == 400 and r.json()["error"]["param"] == "rid", r.text
    _kv_whole(server)


# -- max_tokens 0 -----------------------------------------------------------------------------------------
def test_max_tokens_zero_generates_nothing(server, client):
    prompt = "The capital of France is"
    c = client.completions.create(model="default", prompt=prompt, max_tokens=0)
    assert c.choices[0].text == "" and c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 0
    chunks = list(client.completions.create(model="default", prompt=prompt, max_tokens=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == "" and chunks[-1].choices[0].finish_reason == "length"
    ch = client.chat.completions.create(model="default", messages=CHAT["messages"], max_tokens=0)
    assert ch.choices[0].message.content == "" and ch.usage.completion_tokens == 0
    g = requests.post(server.base_url + "/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 0}})
    assert g.json()["output_ids"] == [] and g.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    # echo + logprobs: the prompt's logprobs still come back (first token has none), nothing else
    e = client.completions.create(model="default", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    lp = e.choices[0].logprobs
    assert e.choices[0].text == prompt and len(lp.tokens) == e.usage.prompt_tokens == len(lp.top_logprobs)
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    _kv_whole(server)


def test_token_accounting_at_the_context_length(server, client):
    ids = [7] * CONTEXT
    full = client.completions.create(model="default", prompt=ids, max_tokens=0)
    assert full.usage.prompt_tokens == full.usage.total_tokens == CONTEXT
    near = client.completions.create(model="default", prompt=ids[:-3], max_tokens=3, extra_body={"ignore_eos": True})
    assert near.usage.completion_tokens == 3 and near.usage.total_tokens == CONTEXT
    g = requests.post(server.base_url + "/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 0}}).json()["meta_info"]
    assert g["prompt_tokens"] + g["completion_tokens"] == CONTEXT
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model="default", prompt=ids, max_tokens=1)
    _kv_whole(server)


# -- huge prompts ------------------------------------------------------------------------------------------
def test_huge_prompts_rejected_without_stalling_other_clients(server):
    """Three ~8 MB bodies at once (text that would take tens of seconds to tokenize, and millions
    of input ids): each is refused as too long, and /health answers throughout."""
    text = "hello world, some words. " * 320_000
    bodies = [("/v1/completions", {"model": "default", "prompt": text, "max_tokens": 1}),
              ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": text}]}),
              ("/generate", {"input_ids": [5] * 2_000_000})]
    results = {}

    def send(path, body):
        results[path] = requests.post(server.base_url + path, json=body, timeout=600)

    threads = [threading.Thread(target=send, args=pb) for pb in bodies]
    for t in threads:
        t.start()
    worst = 0.0
    while any(t.is_alive() for t in threads):
        t0 = time.monotonic()
        assert requests.get(server.base_url + "/health", timeout=600).status_code == 200
        worst = max(worst, time.monotonic() - t0)
    # Tokenizing one such prompt on the event loop stalled /health for 5-30 s; a slow machine may
    # take a few hundred ms for a round trip, never seconds.
    assert worst < 3.0, f"/health took {worst:.1f}s while the huge prompts were handled"
    for path, _ in bodies:
        err = results[path].json()["error"]
        assert results[path].status_code == 400 and err["param"] == "prompt", err
        assert err["code"] == "context_length_exceeded", err
    assert "at least" in results["/v1/completions"].json()["error"]["message"]  # refused before tokenizing
    _serving(server)


# -- many clients at once ------------------------------------------------------------------------------------
def test_100_concurrent_mixed_clients(server, client):
    def one(i: int) -> str:
        kind = i % 4
        if kind == 0:
            stream = client.completions.create(model="default", prompt=f"stream {i}:", max_tokens=6, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            chunks = list(stream)
            assert chunks[-1].choices[0].finish_reason == "length"
            return "".join(c.choices[0].text for c in chunks)
        if kind == 1:
            r = client.completions.create(model="default", prompt=f"plain {i}:", max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 6
            return r.choices[0].text
        msgs = [{"role": "user", "content": f"chat {i}"}]
        if kind == 2:
            r = client.chat.completions.create(model="default", messages=msgs, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 6
            return r.choices[0].message.content
        chunks = list(client.chat.completions.create(model="default", messages=msgs, max_tokens=6, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True}))
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with ThreadPoolExecutor(120) as pool:
        texts = list(pool.map(one, range(120)))  # any exception (an error status) fails the test
    assert len(texts) == 120 and all(isinstance(t, str) for t in texts)
    _kv_whole(server)


# -- SIGTERM with a stream in flight --------------------------------------------------------------------------
def test_sigterm_drains_then_aborts_and_exits():
    grace = 3.0
    s = ServerProcess(MODEL, "--max-total-tokens", "4096", "--graceful-shutdown-timeout", str(grace),
                      "--log-level", "info")  # the launcher logs each child's exit code at info
    try:
        body = {"model": "default", "prompt": "count:", "max_tokens": 4000, "temperature": 0, "stream": True,
                "ignore_eos": True}
        after_signal, finish = [], None
        with requests.post(s.base_url + "/v1/completions", json=body, stream=True, timeout=300) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith(b"data: {"))
            s.proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            for line in lines:
                if line.startswith(b"data: {"):
                    choice = json.loads(line[len(b"data: "):])["choices"][0]
                    after_signal.append(time.monotonic() - sent)
                    finish = choice["finish_reason"] or finish
                if line == b"data: [DONE]":
                    break
        assert finish == "abort", finish  # ended by the server, with a final event, not cut off
        # It kept streaming through the grace period (the timer starts when the server sees the signal).
        assert len(after_signal) > 1 and after_signal[-1] >= grace - 0.5, after_signal
        # uvicorn re-raised SIGTERM: exit 143 before the children were stopped (PDEATHSIG killed them).
        assert s.proc.wait(timeout=120) == 0, s.log()
        log = s.log()
        assert "aborted 1 request(s) still running" in log
        for child in ("scheduler-TP0", "detokenizer"):  # each left its loop: exit 0, not a signal's kill
            assert f"{child} exited with code 0" in log, log
        assert "did not stop" not in log and "died" not in log, log
    finally:
        s.stop()


def test_sigterm_stops_every_tp_rank_at_the_same_iteration():
    """Rank 0 sends its stop in the iteration's broadcast: a rank leaving on its own signal would
    leave the other blocked in the collective until the launcher killed it."""
    s = ServerProcess(MODEL, "--max-total-tokens", "4096", "--tp-size", "2", "--log-level", "info")
    try:
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=120) == 0, s.log()
        log = s.log()
        for child in ("scheduler-TP0", "scheduler-TP1", "detokenizer"):
            assert f"{child} exited with code 0" in log, log
    finally:
        s.stop()
