"""PD disaggregation under load and bad input (issue 33, items 3 and 4).

One PD setup for the module -- a prefill and a decode server in this process (fake transfer
backend, so faults can be injected), a router process in front -- whose servers hold only 512 KV
tokens each, so a burst of 64 requests overfills both many times over:
- the burst completes with 0 errors and the combined server's greedy tokens, while requests wait
  in the named queues /metrics shows (prefill bootstrap queue, decode prealloc queue), even with
  backpressure ("queue full") and torn writes injected (both retried);
- a transfer that keeps failing is reported (503) and frees both sides at once, not after the
  120 s bootstrap timeout, and the pair serves again without a restart;
- a prefill server whose requests wait for a decode server sleeps on its sockets, not spinning;
- the router answers bad input (lone surrogate, NaN, 5,000-deep JSON, bad UTF-8) as the servers
  do, unknown routes with OpenAI-shaped 404s, and the same keep-alive connection keeps working.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import threading

import httpx
import pytest
import requests

from sglang.srt.disaggregation.common import STALL_POLL_MS
from sglang.srt.disaggregation.prefill import PrefillScheduler
from sglang.srt.disaggregation.transfer import FAKE_FAULTS, FakeFaults
from sglang.srt.testing.inprocess import InProcessServer
from sglang.srt.testing.pd import PDSetup

MODEL = "builtin:tiny-deepseek-v32"
# CPU even on a GPU host: the fake backend's memmove copies host memory (and this is scheduling).
ARGS = ("--device", "cpu", "--random-seed", "0", "--enable-metrics")
KV = 512  # tokens, on each side
BURST = 64


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 900) for _ in range(rng.randrange(30, 70))] for _ in range(n)]


def _generate(base_url: str, ids: list[int], max_new: int = 8) -> requests.Response:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}}
    return requests.post(base_url + "/generate", json=body, timeout=300)


def _gauges(base_url: str) -> dict[str, float]:
    text = requests.get(base_url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("sglang:num_") and "_queue_reqs" in line:
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            out[name.removeprefix("sglang:")] = value
    return out


def _idle_no_leak(server) -> dict:
    return server.wait_state(lambda st: st["num_running_reqs"] == 0 and st["num_waiting_reqs"] == 0
                             and st["kv_leak"] is None
                             and st["kv_free_tokens"] + st["kv_cached_tokens"] == st["kv_total_tokens"]
                             and not any((st["disaggregation"] or {}).get(k) for k in
                                         ("waiting", "transferring", "queued", "bootstrapping", "inflight")),
                             "idle without leaks")


@pytest.fixture(autouse=True)
def _no_faults():
    FAKE_FAULTS.__dict__.update(FakeFaults().__dict__)
    yield
    FAKE_FAULTS.__dict__.update(FakeFaults().__dict__)


@pytest.fixture(scope="module")
def pd():
    kv = ("--max-total-tokens", str(KV))
    with PDSetup(MODEL, *ARGS, backend="fake", prefill_args=kv, decode_args=kv) as setup:
        yield setup


@pytest.fixture(scope="module")
def want() -> list[list[int]]:
    prompts = _prompts(BURST, seed=33)
    with InProcessServer(MODEL, *ARGS) as combined, concurrent.futures.ThreadPoolExecutor(8) as ex:
        rs = list(ex.map(lambda ids: _generate(combined.base_url, ids), prompts))
    assert all(r.status_code == 200 for r in rs)
    return [r.json()["output_ids"] for r in rs]


def test_burst_queues_instead_of_failing(pd, want, monkeypatch):
    """64 concurrent requests, about 8x what either server's 512 KV tokens hold at once, with 5
    queue-full refusals and 2 torn writes injected: every request answers 200 with the combined
    server's tokens. Before the fix the prefill computed every prompt it could hold and kept its
    KV for a Register -- under a long enough burst, longer than the 120 s bootstrap timeout, which
    failed it with a 503; with both pools full of different requests (prefill: computed, decode:
    preallocated), nothing moved until then. Now no prompt is computed before its decode server
    preallocated it (checked at every prefill forward), and queueing has no timeout. Meanwhile
    requests wait in the prefill bootstrap queue and the decode prealloc queue, visible in
    /metrics; afterwards both servers are idle, nothing leaks."""
    unregistered = []  # prompts computed before their decode server preallocated (the old order)
    real_run = PrefillScheduler.run_batch

    def checked_run(self, batch):
        unregistered.extend(r.rid for r in batch.reqs if r.bootstrap_room not in self.pd_regs)
        return real_run(self, batch)

    monkeypatch.setattr(PrefillScheduler, "run_batch", checked_run)
    prompts = _prompts(BURST, seed=33)
    FAKE_FAULTS.busy, FAKE_FAULTS.fail = 5, 2
    seen: dict[str, float] = {}
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            for server in (pd.prefill, pd.decode):
                for k, v in _gauges(server.base_url).items():
                    seen[k] = max(seen.get(k, 0), v)

    poller = threading.Thread(target=scrape, daemon=True)
    poller.start()
    with concurrent.futures.ThreadPoolExecutor(BURST) as ex:
        rs = list(ex.map(lambda ids: _generate(pd.base_url, ids), prompts))
    done.set()
    poller.join(60)
    assert [r.status_code for r in rs] == [200] * BURST, [r.text for r in rs if r.status_code != 200][:3]
    assert [r.json()["output_ids"] for r in rs] == want
    assert unregistered == []
    assert seen.get("num_decode_prealloc_queue_reqs", 0) > 0, seen
    assert seen.get("num_prefill_bootstrap_queue_reqs", 0) > 0, seen
    assert {"num_decode_transfer_queue_reqs", "num_prefill_inflight_queue_reqs"} <= set(seen)
    ps = _idle_no_leak(pd.prefill)
    assert ps["disaggregation"]["retries"] >= 7 and ps["disaggregation"]["failed"] == 0
    assert FAKE_FAULTS.busy == 0 and FAKE_FAULTS.fail == 0  # the faults did happen
    ds = _idle_no_leak(pd.decode)
    assert ds["num_decode_prealloc_queue_reqs"] == 0 and ds["num_decode_transfer_queue_reqs"] == 0


def test_failed_transfer_frees_both_sides_and_the_pair_recovers(pd, want):
    """A write that fails on every retry answers 503 naming the transfer, and frees the decode
    side's preallocation at once (the prefill used to fail it silently, leaving the decode side's
    pages held for 120 s); after the fault, the same pair serves again, no restart."""
    prompts = _prompts(BURST, seed=33)
    failed0 = pd.prefill.internal_state()["disaggregation"]["failed"]
    FAKE_FAULTS.fail_always = True
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        rs = list(ex.map(lambda ids: _generate(pd.base_url, ids), prompts[:4]))
    assert [r.status_code for r in rs] == [503] * 4, [r.text for r in rs]
    assert all("KV transfer to the decode server failed" in r.json()["error"]["message"] for r in rs), rs[0].text
    # Well inside the 120 s bootstrap timeout: the Done error freed the decode side's pages.
    ds = _idle_no_leak(pd.decode)
    assert ds["disaggregation"]["transferring"] == 0
    assert _idle_no_leak(pd.prefill)["disaggregation"]["failed"] == failed0 + 4
    FAKE_FAULTS.fail_always = False
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        rs = list(ex.map(lambda ids: _generate(pd.base_url, ids), prompts[:16]))
    assert [r.status_code for r in rs] == [200] * 16
    assert [r.json()["output_ids"] for r in rs] == want[:16]
    _idle_no_leak(pd.prefill)
    _idle_no_leak(pd.decode)


def test_stalled_prefill_scheduler_sleeps(pd, monkeypatch):
    """A request that waits for its decode server (here: none ever announces it) leaves the prefill
    scheduler with work but nothing to do: its loop sleeps on its sockets (STALL_POLL_MS at a time),
    so it steps ~20 times a second, not in a busy loop. The request sent to the prefill server
    alone is then cancelled by its client and leaves nothing behind."""
    steps = {"n": 0}
    real_step = PrefillScheduler.step

    def counting_step(self):
        steps["n"] += 1
        return real_step(self)

    monkeypatch.setattr(PrefillScheduler, "step", counting_step)
    info = requests.get(pd.prefill.base_url + "/get_server_info", timeout=30).json()
    body = {"input_ids": list(range(5, 45)), "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": info["disaggregation_bootstrap_port"],
            "bootstrap_room": random.getrandbits(63)}
    stalled_s = 3.0
    client = threading.Thread(target=_post_until_timeout, args=(pd.prefill.base_url + "/generate", body, stalled_s),
                              daemon=True)
    pd.prefill.wait_idle()
    client.start()
    st = pd.prefill.wait_state(lambda s: s["num_prefill_bootstrap_queue_reqs"] == 1, "holding the request")
    assert st["disaggregation"]["bootstrapping"] == 1
    n0 = steps["n"]
    client.join(60)  # the client gives up after stalled_s
    n = steps["n"] - n0
    # At most one step per STALL_POLL_MS, plus the steps that handled messages (twice as many, with
    # margin); a busy loop steps thousands of times a second.
    assert n <= 2 * stalled_s * 1000 / STALL_POLL_MS + 20, n
    _idle_no_leak(pd.prefill)


def _local_addr(r: httpx.Response) -> tuple:
    """The client-side address of the connection that carried `r` (the same one = kept alive)."""
    return r.extensions["network_stream"].get_extra_info("client_addr")


def _post_until_timeout(url: str, body: dict, timeout: float) -> None:
    try:
        requests.post(url, json=body, timeout=timeout)
    except requests.Timeout:
        pass


BAD_BODIES = {
    "lone surrogate": b'{"model": "default", "prompt": "hi \\ud800", "max_tokens": 2}',
    "temperature NaN": b'{"model": "default", "prompt": "hi", "max_tokens": 2, "temperature": NaN}',
    "5000-deep JSON": b'{"model": "default", "max_tokens": 2, "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "bad UTF-8": b'{"model": "default", "prompt": "hi \xff", "max_tokens": 2}',
    "not an object": b'["hi"]',
    "bad max_tokens": b'{"model": "default", "prompt": "hi", "max_tokens": "many"}',
}


@pytest.mark.parametrize("stream", [False, True])
def test_router_answers_bad_input_as_the_servers_do(pd, stream):
    """Each bad body gets, from the router, the decode server's own status and error body (400,
    not a 500 "router error"), streamed or not; after each, a good request on the same keep-alive
    connection (one httpx.Client, its socket checked) still works -- streamed ones as SSE."""
    good = {"model": "default", "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0,
            "stream": stream}
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=pd.base_url, timeout=120) as router, \
            httpx.Client(base_url=pd.decode.base_url, timeout=120) as server:
        sockets = set()
        for name, body in BAD_BODIES.items():
            if stream and body.startswith(b"{") and b"\xff" not in body:
                body = body[:-1] + b', "stream": true}'
            want = server.post("/v1/completions", content=body, headers=headers)
            got = router.post("/v1/completions", content=body, headers=headers)
            sockets.add(_local_addr(got))
            assert want.status_code == 400, (name, want.text)
            assert (got.status_code, got.json()) == (want.status_code, want.json()), name
            assert got.headers["content-type"] == want.headers["content-type"]
            with router.stream("POST", "/v1/completions", json=good) as r:
                sockets.add(_local_addr(r))
                text = r.read().decode()
                assert r.status_code == 200, (name, text)
                if stream:
                    assert r.headers["content-type"].startswith("text/event-stream")
                    assert text.rstrip().endswith("data: [DONE]")
                else:
                    assert json.loads(text)["choices"][0]["text"]
        assert len(sockets) == 1, "the router dropped the keep-alive connection"
    _idle_no_leak(pd.prefill)
    _idle_no_leak(pd.decode)


def test_router_unknown_routes_are_openai_404s(pd):
    with httpx.Client(base_url=pd.base_url, timeout=60) as router:
        sockets = set()
        for method, path, status in [("POST", "/v1/nope", 404), ("GET", "/nope", 404),
                                     ("GET", "/v1/completions", 405)]:
            r = router.request(method, path)
            sockets.add(_local_addr(r))
            err = r.json()["error"]
            assert r.status_code == status and err["type"] == "invalid_request_error", r.text
            assert path in err["message"] and set(err) == {"message", "type", "param", "code"}
            r = router.get("/v1/models")
            sockets.add(_local_addr(r))
            assert r.status_code == 200
        assert len(sockets) == 1
