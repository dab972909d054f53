"""Bounded, seeded fuzzing of the HTTP API: malformed and extreme request bodies never produce a
5xx, never kill the server and never leak KV (loopback only, a fixed number of requests)."""

import json
import os
import random

import pytest
import requests

from sglang.srt.testing.server import ServerProcess

MODEL = "builtin:tiny-deepseek-v32"
N_REQUESTS = int(os.environ.get("SGLANG_FUZZ_REQUESTS", "150"))
WEIRD = [None, True, False, 0, -1, 1, 2**31, -2**63, 1e308, -1e-9, 0.5, float("nan"), "", "x", "NaN", [], [1, -5],
         {}, {"a": 1}, [[]], "\x00\udfff".encode("utf-8", "surrogatepass").decode("utf-8", "replace"), "é" * 50,
         # issue 9: lone surrogates (sent as JSON escapes), values beyond float32, logit_bias out of range
         "\ud800", ["ok", "\udfff x"], 1e39, {"5": 1e39}, {"5": -101}]
FIELDS = {
    "/v1/completions": ["model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed",
                        "logprobs", "echo", "presence_penalty", "frequency_penalty", "logit_bias", "top_k",
                        "min_p", "stream_options", "ignore_eos", "min_tokens", "stop_token_ids"],
    "/v1/chat/completions": ["model", "messages", "max_tokens", "temperature", "top_p", "n", "stream", "stop",
                             "seed", "logprobs", "top_logprobs", "tools", "response_format", "max_completion_tokens"],
    "/generate": ["text", "input_ids", "sampling_params", "stream", "return_logprob", "logprob_start_len",
                  "top_logprobs_num", "rid"],
}
BASE = {
    "/v1/completions": {"model": "default", "prompt": "hello", "max_tokens": 4},
    "/v1/chat/completions": {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/generate": {"text": "hello", "sampling_params": {"max_new_tokens": 4}},
}


def _mutate(rng: random.Random, path: str) -> bytes:
    body = json.loads(json.dumps(BASE[path]))
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(FIELDS[path])
        body[key] = rng.choice(WEIRD)
    if path == "/generate" and rng.random() < 0.3:
        body["sampling_params"] = {rng.choice(["max_new_tokens", "temperature", "top_k", "stop", "min_p", "n",
                                                "logit_bias", "ignore_eos", "seed", "bogus"]): rng.choice(WEIRD)}
    if rng.random() < 0.2:  # logprobs make an unvalidated logit_bias surface as NaN in the answer
        body.update({"/generate": {"return_logprob": True}, "/v1/completions": {"logprobs": 2},
                     "/v1/chat/completions": {"logprobs": True}}[path])
    raw = json.dumps(body, allow_nan=True).encode()
    r = rng.random()
    if r < 0.05:
        raw = raw[: rng.randint(0, len(raw))]  # truncated JSON
    elif r < 0.08:
        raw = b"[" + raw + b"]"
    elif r < 0.10:
        raw = b'{"text": ' * 20_000 + raw + b"}" * 20_000  # nested past the recursion limit
    elif r < 0.12:
        cut = rng.randint(0, len(raw))
        raw = raw[:cut] + b"\xff\xfe" + raw[cut:]  # not UTF-8
    return raw


@pytest.fixture(scope="module")
def server():
    with ServerProcess(MODEL, "--max-total-tokens", "4096", "--random-seed", "0") as s:
        yield s


def test_fuzzed_bodies_never_5xx(server):
    rng = random.Random(int(os.environ.get("SGLANG_FUZZ_SEED", "1234")))
    statuses = {}
    for i in range(N_REQUESTS):
        path = rng.choice(list(BASE))
        raw = _mutate(rng, path)
        try:
            r = requests.post(server.base_url + path, data=raw, headers={"content-type": "application/json"},
                              timeout=60)
        except requests.RequestException as e:  # the server must not drop connections either
            pytest.fail(f"request {i} to {path} failed: {e}; body {raw[:200]!r}")
        assert r.status_code < 500, (path, raw[:300], r.text[:300])
        for part in r.text.split("data: ") if "text/event-stream" in r.headers.get("content-type", "") else [r.text]:
            if part.strip() and part.strip() != "[DONE]":  # strict JSON: NaN / Infinity are not JSON
                json.loads(part, parse_constant=lambda c: pytest.fail(f"{path} answered non-JSON {c}: {raw[:200]!r}"))
        if r.status_code >= 400 and "text/event-stream" not in r.headers.get("content-type", ""):
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    assert len(statuses) > 1  # both accepted and rejected bodies were exercised
    st = server.wait_idle()
    assert st["kv_protected_tokens"] == 0 and st["kv_leak"] is None
    ok = requests.post(server.base_url + "/generate", json=BASE["/generate"]).json()
    assert ok["meta_info"]["completion_tokens"] == 4
