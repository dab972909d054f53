"""Bad input gets an OpenAI-shaped JSON error with a 4xx status, and the server keeps serving;
bad flags fail at start-up naming the flag; a dead child process takes the server down."""

import os
import re
import signal
import subprocess
import sys
import time

import openai
import psutil
import pytest
import requests

from sglang.srt.testing.server import ServerProcess

MODEL = "builtin:tiny-deepseek-v32"


@pytest.fixture(scope="module")
def server():
    with ServerProcess(MODEL, "--max-total-tokens", "8192", "--api-key", "sk-test", "--enable-metrics") as s:
        yield s


def _auth():
    return {"Authorization": "Bearer sk-test"}


def _ok(server):
    r = requests.post(server.base_url + "/v1/completions", headers=_auth(),
                      json={"model": "default", "prompt": "hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["text"]) > 0


BAD_REQUESTS = [
    # (path, body or raw bytes, expected status, expected param or None)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": "no-such-model", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": "default", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "default", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "default", "prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"model": "default", "prompt": "x", "min_tokens": -1}, 400, "min_tokens"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
     400, "max_tokens"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 5000}, 400, "max_completion_tokens"),
    ("/v1/responses", {"model": "default", "input": "x", "max_output_tokens": -1}, 400, "max_output_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens"),
    ("/v1/completions", {"model": "default", "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}], "n": 2**31}, 400, "n"),
    ("/v1/completions", {"model": "default", "prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"model": "default", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": "default"}, 400, "prompt"),
    ("/v1/completions", {"model": "default", "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": "default", "prompt": [999999]}, 400, "input_ids"),
    ("/v1/completions", {"model": "default", "prompt": "word " * 5000, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "default", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/generate", {"text": "x", "sampling_params": {"temprature": 0.5}}, 400, None),
    ("/generate", {"sampling_params": {}}, 400, "text"),
    ("/generate", {"text": "x", "bogus": 1}, 400, "bogus"),
    ("/generate", {"text": "x", "return_hidden_states": True}, 400, "return_hidden_states"),
    ("/no/such/route", {}, 404, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_request_gets_openai_error_and_server_keeps_serving(server, path, body, status, param):
    kw = {"data": body, "headers": {**_auth(), "content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body, "headers": _auth()}
    r = requests.post(server.base_url + path, timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    _ok(server)


def test_hidden_states_need_the_flag(server):
    r = requests.post(server.base_url + "/generate", headers=_auth(), json={"text": "x", "return_hidden_states": True})
    assert r.status_code == 400 and "--enable-return-hidden-states" in r.json()["error"]["message"]
    _ok(server)


def test_oversized_body_is_413(server):
    r = requests.post(server.base_url + "/v1/completions", headers={**_auth(), "content-type": "application/json"},
                      data=b" " * (33 * 2**20))
    assert r.status_code == 413 and "Payload Too Large" in r.json()["error"]["message"], r.text
    _ok(server)


def test_length_errors_use_upstreams_words(server):
    """SGLang clients match on upstream's texts; ours keep the token counts and the OpenAI code."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="sk-test")
    msgs = [{"role": "user", "content": "hello"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt="word " * 5000, max_tokens=1)
    err = e.value.body
    assert "is longer than the model's context length" in err["message"] and "tokens" in err["message"]
    assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")
    for kw, field in [({"max_tokens": 5000}, "max_tokens"), ({"max_completion_tokens": 5000}, "max_completion_tokens")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="default", messages=msgs, **kw)
        err = e.value.body
        assert "max_completion_tokens is too large: 5000" in err["message"], err
        assert (err["param"], err["code"]) == (field, "context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=msgs, max_completion_tokens=-1)
    assert e.value.body["message"].startswith("max_completion_tokens must be >= 0"), e.value.body
    _ok(server)


def test_api_key_required_everywhere_but_health(server):
    assert requests.get(server.base_url + "/health").status_code == 200
    for method, path in [("get", "/v1/models"), ("post", "/v1/completions"), ("get", "/get_model_info"),
                         ("get", "/metrics"), ("post", "/generate"), ("get", "/get_server_info")]:
        r = getattr(requests, method)(server.base_url + path, json={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        r = getattr(requests, method)(server.base_url + path, json={}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    assert openai.OpenAI(base_url=server.base_url + "/v1", api_key="sk-test").models.list().data


def test_metrics(server):
    _ok(server)
    text = requests.get(server.base_url + "/metrics", headers=_auth()).text
    for name in ("sglang:num_requests_total", "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
                 "sglang:time_to_first_token_seconds_bucket", "sglang:time_per_output_token_seconds_bucket",
                 "sglang:token_usage", "sglang:cache_hit_rate", "sglang:max_total_num_tokens",
                 "sglang:num_used_tokens", "sglang:gen_throughput", "sglang:inter_token_latency_seconds_bucket",
                 "sglang:num_aborted_requests_total", "sglang:num_grammar_queue_reqs"):
        assert name in text, name
    assert re.search(r'^sglang:num_grammar_queue_reqs\{model_name="[^"]+"\} 0\.0$', text, re.M), text  # idle


def _launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang.launch_server", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args,flag", [
    (["--model-path", MODEL, "--port", "0"], "--port"),
    (["--model-path", MODEL, "--page-size", "3"], "--page-size"),
    (["--model-path", MODEL, "--mem-fraction-static", "1.5"], "--mem-fraction-static"),
    (["--model-path", MODEL, "--json-model-override-args", "{bad"], "--json-model-override-args"),
    (["--model-path", MODEL, "--json-model-override-args", '{"num_hidden_layers": -1}'], "--json-model-override-args"),
    (["--model-path", MODEL, "--json-model-override-args", '{"index_topk": "32"}'], "--json-model-override-args"),
    (["--model-path", MODEL, "--graceful-shutdown-timeout", "-1"], "--graceful-shutdown-timeout"),
    (["--model-path", MODEL, "--max-payload-size", "0"], "--max-payload-size"),
    (["--model-path", MODEL, "--decode-log-interval", "0"], "--decode-log-interval"),
    (["--model-path", MODEL, "--tp-size", "3"], "--tp-size"),
    (["--model-path", MODEL, "--reasoning-parser", "deepseek-v9"], "--reasoning-parser"),
    (["--model-path", MODEL, "--tool-call-parser", "glm99"], "--tool-call-parser"),
    (["--model-path", MODEL, "--chat-template", "/no/such/template.jinja"], "--chat-template"),
    (["--model-path", MODEL, "--chunked-prefill-size", "0"], "--chunked-prefill-size"),
    (["--model-path", MODEL, "--schedule-policy", "random"], "--schedule-policy"),
    (["--model-path", MODEL, "--device", "cuda"], "--device"),
    (["--model-path", MODEL, "--nsa-index-k-dtype", "int4"], "--nsa-index-k-dtype"),
    (["--model-path", MODEL, "--context-length", "999999"], "--context-length"),
    (["--model-path", "/no/such/model"], "/no/such/model"),
    (["--model-path", "builtin:no-such"], "no-such"),
    (["--model-path", MODEL, "--bogus-flag"], "--bogus-flag"),
    ([], "--model-path"),
])
def test_bad_flags_fail_at_start_naming_the_flag(args, flag):
    r = _launch(*args)
    assert r.returncode != 0
    assert flag in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def _children(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _alive(kids: list[psutil.Process], timeout: float = 120) -> list[psutil.Process]:
    """The children still running once they all exited or `timeout` passed (a condition, not a
    fixed sleep: a busy machine may take seconds to reap them)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def test_killing_the_scheduler_takes_the_server_down():
    s = ServerProcess(MODEL, "--max-total-tokens", "4096")
    try:
        kids = _children(s.proc.pid)
        assert kids
        # the scheduler is the child holding the model: the largest resident set
        victim = max(kids, key=lambda k: k.memory_info().rss)
        os.kill(victim.pid, signal.SIGKILL)
        rc = s.proc.wait(timeout=120)
        assert rc != 0
        assert not _alive(kids)  # no orphans
        assert "died" in s.log()
    finally:
        s.stop()


def test_sigterm_stops_server_and_children():
    s = ServerProcess(MODEL, "--max-total-tokens", "4096")
    kids = _children(s.proc.pid)
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=120) == 0  # was 143: uvicorn re-raised SIGTERM
    assert not _alive(kids)
    s.stop()


def test_children_die_with_a_killed_server():
    s = ServerProcess(MODEL, "--max-total-tokens", "4096")
    kids = _children(s.proc.pid)
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait(timeout=120)
    assert not _alive(kids)
    s.stop()
