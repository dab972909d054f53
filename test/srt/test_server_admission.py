"""Admission never wedges (issue 33, item 1): a request that fits the context but asks for more new
tokens than the KV pool holds is capped to what the pool holds (as upstream SGLang does), so it is
admitted and does not block the requests behind it; and a scheduler that nonetheless holds waiting
requests while launching nothing says so (log, stats, /health_generate)."""

import json
import socket
import threading
import time

import pytest
import requests

from sglang.srt.entrypoints.engine import Engine
from sglang.srt.managers import admission_watchdog, scheduler as scheduler_mod
from sglang.srt.managers.request_limits import max_new_tokens_limit, request_length_error
from sglang.srt.testing.inprocess import InProcessServer
from sglang.srt.testing.server import ServerProcess

MODEL = "builtin:tiny-deepseek-v32"
POOL = 1024  # the outside report's --max-total-tokens


def _complete(base_url: str, prompt: str, max_tokens: int) -> dict:
    r = requests.post(base_url + "/v1/completions", timeout=300, json={
        "model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_limit_is_what_a_lone_request_can_hold():
    # A prompt that fits with room to generate is never a length error, whatever max_new_tokens asks
    # (within the context): it is capped instead.
    assert request_length_error(1, 1500, 4096, POOL, 1) is None
    assert max_new_tokens_limit(1, POOL, 1) == POOL - 1 - 2 - 1
    assert max_new_tokens_limit(100, POOL, 64, tokens_per_step=4) == POOL - 64 - 8 - 100
    # The prompt alone must leave room for a step: else the KV error, naming the prompt.
    err = request_length_error(POOL - 64 - 8, 1, 4096, POOL, 64, tokens_per_step=4)
    assert err is not None and err.param == "prompt"
    assert request_length_error(POOL - 64 - 9, 1, 4096, POOL, 64, tokens_per_step=4) is None


def test_request_asking_for_more_than_the_pool_is_capped_and_blocks_nobody():
    """The outside report's repro: prompt 'hello', max_tokens 1500 on a 1,024-token pool (context 4,096),
    then a tiny request. Before the fix the first was never admitted and the second never answered."""
    with ServerProcess(MODEL, "--max-total-tokens", str(POOL), "--random-seed", "0") as server:
        big: dict = {}
        t = threading.Thread(target=lambda: big.update(_complete(server.base_url, "hello", 1500)))
        t.start()
        small = _complete(server.base_url, "tiny", 4)
        assert small["usage"]["completion_tokens"] == 4
        t.join(timeout=300)
        assert not t.is_alive(), "the capped request never finished"
        choice, usage = big["choices"][0], big["usage"]
        assert choice["finish_reason"] == "length"
        assert usage["completion_tokens"] == max_new_tokens_limit(usage["prompt_tokens"], POOL, 1)
        assert requests.get(server.base_url + "/health_generate", timeout=60).status_code == 200
        st = server.wait_idle()
        assert st["admission_stall"] is None and st["kv_leak"] is None, st
        assert st["kv_free_tokens"] + st["kv_cached_tokens"] == POOL


def test_eagle_burst_of_oversized_requests_on_a_small_pool_all_finish():
    """Under EAGLE a step holds a verify window past the committed KV: the cap leaves room for it, so
    a burst of requests that each ask for more than the pool completes (retracting as needed)."""
    pool = 256
    engine = Engine(model_path="builtin:tiny-deepseek-v32-mtp", device="cpu", random_seed=0,
                    max_total_tokens=pool, speculative_algorithm="EAGLE", speculative_num_steps=3)
    prompts = [[5 + (7 * i + j) % 300 for j in range(3 + 5 * i)] for i in range(6)]
    outs = engine.generate(input_ids=prompts, sampling_params=[{"temperature": 0, "max_new_tokens": 400,
                                                               "ignore_eos": True}] * len(prompts))
    for p, o in zip(prompts, outs):
        assert o["meta_info"]["finish_reason"]["type"] == "length"
        assert o["meta_info"]["completion_tokens"] == max_new_tokens_limit(len(p), pool, 1, tokens_per_step=4)
    s = engine.scheduler
    assert not s.has_work() and s.kv_leak_report() is None and s.admission_watchdog.reason is None


def _wait(pred, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def test_watchdog_names_a_wedge_and_health_generate_reports_it(monkeypatch):
    """With the cap undone (the old admission rule), the oversized request wedges the queue again:
    the watchdog must notice it, explain it, and /health_generate must answer 503 saying so; once
    the request is aborted the server admits again and /health_generate is 200."""
    monkeypatch.setattr(scheduler_mod, "max_new_tokens_limit", lambda *a, **k: 1 << 30)
    monkeypatch.setattr(admission_watchdog, "STALL_SECONDS", 0.2)
    with InProcessServer(MODEL, "--max-total-tokens", str(POOL), "--random-seed", "0") as server:
        data = json.dumps({"model": "default", "prompt": "hello", "max_tokens": 1500, "temperature": 0}).encode()
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        st = _wait(lambda: (s := server.internal_state())["admission_stall"] and s, "no stall reported")
        reason = st["admission_stall"]
        assert "max_new_tokens 1500" in reason and f"free {POOL}" in reason and "0 running" in reason, reason
        r = requests.get(server.base_url + "/health_generate", timeout=60)
        assert r.status_code == 503 and "no request admitted" in r.json()["error"]["message"], r.text
        sock.close()  # the client goes away: its request is aborted, the queue moves again
        _wait(lambda: server.internal_state()["admission_stall"] is None, "stall not cleared")
        assert requests.get(server.base_url + "/health_generate", timeout=60).status_code == 200
        assert _complete(server.base_url, "tiny", 4)["usage"]["completion_tokens"] == 4
