"""Scheduler behaviour through the real server: concurrency, abort, radix cache, chunked prefill.
After every scenario the KV pool must be whole again: free + cached == capacity, nothing locked."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from sglang.srt.testing.server import ServerProcess

MODEL = "builtin:tiny-deepseek-v32"
CAPACITY = 8192


def _kv_whole(server: ServerProcess) -> dict:
    st = server.wait_idle()
    assert st["kv_protected_tokens"] == 0, st
    assert st["kv_free_tokens"] + st["kv_cached_tokens"] == st["kv_total_tokens"] == CAPACITY, st
    assert st["kv_leak"] is None, st
    return st


@pytest.fixture(scope="module", params=["overlap", "sync"])
def server(request):
    """Every case runs against the overlap scheduler (the default) and --disable-overlap-schedule."""
    extra = ["--disable-overlap-schedule"] if request.param == "sync" else []
    env = {"SGLANG_CPU_OVERLAP_THREAD": "1"}  # overlap with the forward on a worker thread (CPU)
    with ServerProcess(MODEL, "--max-total-tokens", str(CAPACITY), "--random-seed", "0", *extra, env=env) as s:
        yield s


@pytest.fixture(scope="module")
def chunked_server():
    # Small chunks, mixed prefill/decode batches and lpm ordering: different schedules, same tokens.
    with ServerProcess(MODEL, "--max-total-tokens", str(CAPACITY), "--chunked-prefill-size", "16",
                       "--enable-mixed-chunk", "--schedule-policy", "lpm", "--page-size", "4",
                       "--random-seed", "0") as s:
        yield s


def _prompt(i: int) -> str:
    return f"Request number {i}: " + " ".join(["alpha", "beta", "gamma", "delta"][j % 4] for j in range(i % 13 + 3))


def _complete(base_url: str, prompt: str, max_tokens: int = 16) -> str:
    r = requests.post(base_url + "/v1/completions", json={"model": "default", "prompt": prompt,
                                                          "max_tokens": max_tokens, "temperature": 0,
                                                          "ignore_eos": True}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_64_concurrent_clients_equal_sequential(server):
    prompts = [_prompt(i) for i in range(64)]
    sequential = [_complete(server.base_url, p) for p in prompts[:16]]
    requests.post(server.base_url + "/flush_cache")
    with ThreadPoolExecutor(64) as pool:
        concurrent = list(pool.map(lambda p: _complete(server.base_url, p), prompts))
    assert concurrent[:16] == sequential
    # and the rest agree with a sequential rerun
    assert [_complete(server.base_url, p) for p in prompts[16:24]] == concurrent[16:24]
    _kv_whole(server)


def test_abort_mid_stream_frees_every_slot(server):
    _kv_whole(server)
    body = {"model": "default", "prompt": "count forever:", "max_tokens": 3000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    chunks = 0
    with requests.post(server.base_url + "/v1/completions", json=body, stream=True, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith(b"data: {"):
                chunks += 1
            if chunks >= 5:
                break  # drop the connection mid-stream
    assert chunks == 5
    _kv_whole(server)
    # A non-streaming client that goes away once its request runs: the request is aborted too.
    sock = server.open_request("/v1/completions", {**body, "stream": False})
    server.wait_state(lambda st: st["num_running_reqs"] == 1, "running the request")
    sock.close()
    _kv_whole(server)  # waits until idle: 3000 tokens would take minutes here, an abort a step
    # Every slot is free again: with nothing running, flushing the prefix cache returns all KV.
    assert requests.post(server.base_url + "/flush_cache").status_code == 200
    st = server.internal_state()
    assert st["kv_free_tokens"] == CAPACITY and st["kv_cached_tokens"] == 0, st


def test_radix_hit_equals_cold(server):
    prompt = "A long shared system prompt. " * 12 + "Now answer:"
    requests.post(server.base_url + "/flush_cache")
    cold = requests.post(server.base_url + "/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 20, "temperature": 0}}).json()
    warm = requests.post(server.base_url + "/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 20, "temperature": 0}}).json()
    assert cold["meta_info"]["cached_tokens"] == 0
    assert warm["meta_info"]["cached_tokens"] == warm["meta_info"]["prompt_tokens"] - 1
    assert warm["text"] == cold["text"] and warm["output_ids"] == cold["output_ids"]
    _kv_whole(server)


def test_chunked_mixed_paged_equals_default(server, chunked_server):
    prompts = ["Long context " * 30 + "end.", _prompt(5), _prompt(11), "x " * 70]
    ref = [_complete(server.base_url, p, 20) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: _complete(chunked_server.base_url, p, 20), prompts))
    assert got == ref
    st = chunked_server.wait_idle()
    assert st["kv_protected_tokens"] == 0 and st["kv_leak"] is None


def test_flush_cache_refused_while_running(server):
    body = {"text": "busy " * 5, "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}
    t = threading.Thread(target=requests.post, args=(server.base_url + "/generate",), kwargs={"json": body})
    t.start()
    deadline = time.monotonic() + 10
    while server.internal_state()["num_running_reqs"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    r = requests.post(server.base_url + "/flush_cache")
    assert r.status_code == 400 and "running" in r.json()["error"]["message"]
    t.join()
    assert requests.post(server.base_url + "/flush_cache").status_code == 200
    st = server.wait_idle()
    assert st["kv_free_tokens"] == CAPACITY and st["kv_cached_tokens"] == 0


def test_request_that_can_never_fit_is_400(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt=[5] * 4000, max_tokens=200)
    assert "context length" in str(e.value)
    assert _complete(server.base_url, "still serving")  # and the server keeps serving


def test_requests_wait_when_kv_is_short():
    """16 requests needing ~3x the KV pool at once: they queue / retract, none fails, and each
    output equals its solo run."""
    with ServerProcess(MODEL, "--max-total-tokens", "640", "--random-seed", "0") as small:
        prompts = [_prompt(i) + " and more words" * 6 for i in range(16)]
        solo = [_complete(small.base_url, p, 96) for p in prompts[:4]]
        with ThreadPoolExecutor(16) as pool:
            together = list(pool.map(lambda p: _complete(small.base_url, p, 96), prompts))
        assert together[:4] == solo
        st = small.wait_idle()
        assert st["kv_protected_tokens"] == 0 and st["kv_leak"] is None
        assert st["kv_free_tokens"] + st["kv_cached_tokens"] == 640


def test_eos_stop_token_ids_and_ignore_eos(server):
    url = server.base_url + "/generate"
    eos = 1  # the builtin tokenizer's <|end_of_text|>
    force_eos = {"temperature": 0, "max_new_tokens": 10, "logit_bias": {str(eos): 100.0}}
    r = requests.post(url, json={"text": "hi", "sampling_params": force_eos}).json()
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos} and r["output_ids"] == [eos]
    assert r["text"] == ""
    r = requests.post(url, json={"text": "hi", "sampling_params": {**force_eos, "ignore_eos": True}}).json()
    assert r["meta_info"]["finish_reason"]["type"] == "length" and r["output_ids"] == [eos] * 10
    r = requests.post(url, json={"text": "hi", "sampling_params": {**force_eos, "min_new_tokens": 4}}).json()
    assert len(r["output_ids"]) == 5 and r["output_ids"][-1] == eos
    tok = 300
    r = requests.post(url, json={"text": "hi", "sampling_params": {
        "temperature": 0, "max_new_tokens": 10, "logit_bias": {str(tok): 100.0}, "stop_token_ids": [tok]}}).json()
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok} and r["output_ids"] == [tok]


def test_max_tokens_zero_with_prompt_logprobs_across_chunks(chunked_server):
    """Prefill in 16-token chunks, nothing sampled: every prompt position's logprob comes back."""
    ids = list(range(40, 80))
    r = requests.post(chunked_server.base_url + "/generate", json={
        "input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 0}}).json()
    assert r["output_ids"] == [] and r["meta_info"]["finish_reason"]["type"] == "length"
    lps = r["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in lps] == ids and lps[0][0] is None and all(lp <= 0 for lp, _, _ in lps[1:])
