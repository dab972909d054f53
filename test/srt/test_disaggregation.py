"""Prefill/decode disaggregation (issue 23).

In-process (fake transfer backend): a PrefillScheduler and a DecodeScheduler in this process, stepped
alternately, produce the same greedy tokens as one combined Scheduler; the bytes moved equal the
pages that must move; radix hits on the prefill side; IndexCache freq 4; page sizes 1 and 64;
EAGLE (draft KV + draft state); a layout mismatch fails at the handshake with a message naming it;
aborts on either side free both sides; a skipped copy diverges (negative control); writes run on a
transfer thread (a held write does not stall the prefill scheduler, its pages stay held until it
ends, an abort during it waits for it); cuda_ipc's address translation (on CPU tensors); a decode
server out of KV retracts committed requests and recomputes them locally.

Real processes (Mooncake over TCP): prefill + decode + router vs one combined server (page 1 / 64,
single, batched, streaming, /generate, radix hits), a CP = 2 prefill (gloo) sending only its own
pages, the handshake mismatch, and a decode server killed mid-transfer (502/503, nothing leaks).
Several servers behind the router (in-process servers with the fake backend, a router process):
2 prefill + 2 decode spread round robin over every pair, a decode server down (503 when none is left).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import itertools
import os
import random
import signal
import time

import openai
import pytest
import requests
import torch

from sglang.srt.disaggregation.common import free_port
from sglang.srt.disaggregation.decode import DecodeScheduler
from sglang.srt.disaggregation.kv_layout import bytes_per_page
from sglang.srt.disaggregation.prefill import PrefillScheduler
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.srt.testing.inprocess import InProcessServer
from sglang.srt.testing.pd import PDSetup
from sglang.srt.testing.server import ServerProcess

MODEL = "builtin:tiny-deepseek-v32"
# The GPU container has no Mooncake (its wheel is ~100 MB, past what travels to the device): there the
# tests that need it skip with this reason; CPU CI installs it, so nothing is skipped there.
NEEDS_MOONCAKE = pytest.mark.skipif(
    os.environ.get("SGLANG_TEST_DEVICE", "cpu") == "cuda" and importlib.util.find_spec("mooncake") is None,
    reason="mooncake-transfer-engine is not in the GPU container; these TCP / CPU tests run in CPU CI")
_rooms = itertools.count(1000)


def _args(**kw) -> ServerArgs:
    kw.setdefault("max_total_tokens", 8192)
    return ServerArgs(model_path=MODEL, device="cpu", random_seed=0, log_level="error", **kw).resolve()


def _pair(page_size: int = 1, prefill_kw: dict | None = None, decode_kw: dict | None = None, **kw):
    port = free_port()
    common = dict(page_size=page_size, disaggregation_transfer_backend="fake", disaggregation_bootstrap_port=port, **kw)
    p = PrefillScheduler(_args(disaggregation_mode="prefill", **common, **(prefill_kw or {})))
    d = DecodeScheduler(_args(disaggregation_mode="decode", **common, **(decode_kw or {})))
    return p, d, port


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 900) for _ in range(rng.randrange(3, 150))] for _ in range(n)]


def _req(rid: str, ids: list[int], max_new: int, room: int | None = None, port: int | None = None):
    sp = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)
    sp.normalize()
    return TokenizedGenerateReqInput(rid, ids, sp, bootstrap_host="127.0.0.1" if room is not None else None,
                                     bootstrap_port=port, bootstrap_room=room)


def _combined(prompts, max_new: int, page_size: int = 1, **kw) -> list[list[int]]:
    s = Scheduler(_args(page_size=page_size, **kw))
    for i, ids in enumerate(prompts):
        s.add_request(_req(f"r{i}", ids, max_new))
    toks, done = {f"r{i}": [] for i in range(len(prompts))}, set()
    while s.has_work():
        for o in s.step():
            toks[o.rid] += o.new_token_ids
            if o.finished_reason:
                done.add(o.rid)
    assert done == set(toks)
    return [toks[f"r{i}"] for i in range(len(prompts))]


def _ticks(seconds: float = 300.0):
    """Loop turns until a wall-clock deadline, for loops that step the servers until a condition:
    a step count is a hidden deadline (on a busy machine the transfer threads need more steps)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        yield


def _run_pd(p, d, port, prompts, max_new: int, timeout_s: float = 300.0):
    """Send every prompt to both servers (same room), step both until the decode side finished."""
    rids = [f"q{next(_rooms)}" for _ in prompts]
    finals, pouts = {}, {}
    for rid, ids in zip(rids, prompts):
        room = next(_rooms)
        p.add_request(_req(rid, ids, max_new, room, port))
        d.add_request(_req(rid, ids, max_new, room, port))
    toks = {rid: [] for rid in rids}
    for _ in _ticks(timeout_s):
        if not (p.has_work() or d.has_work()):
            break
        for o in p.step():
            if o.finished_reason:
                pouts[o.rid] = o
        for o in d.step():
            toks[o.rid] += o.new_token_ids
            if o.finished_reason:
                finals[o.rid] = o
    assert not p.has_work() and not d.has_work(), "PD did not finish"
    return [toks[r] for r in rids], [finals.get(r) for r in rids], [pouts.get(r) for r in rids]


def _read_register(p, room: int) -> None:
    """Until the prefill side has read room's Register (it follows the Handshake, maybe not at once)."""
    for _ in range(600):
        if room in p.pd_regs:
            return
        p.bootstrap.poll(100)
        p._poll_control()
    raise AssertionError(f"no Register for room {room} after 60 s")


def _no_leak(*scheds) -> None:
    for s in scheds:
        assert s.kv_leak_report() is None, s.kv_leak_report()


def _free_at_rest(s) -> tuple[int, int, int | None]:
    """(free KV slots, free request slots, free host KV slots with HiCache) once the prefix cache has
    given back everything it holds, on both tiers: what the scheduler had free when it was built."""
    tc = s.tree_cache
    tc.evict(s.max_total_num_tokens)
    host = getattr(tc, "host_allocator", None)
    if host is not None:
        tc.evict_host(host.size)
    return s.allocator.available_size(), s.req_to_token_pool.available_size(), host and host.available_size()


@pytest.mark.parametrize("page_size", [1, 64])
def test_pd_matches_combined_greedy(page_size):
    prompts = _prompts(6, seed=page_size)
    want = _combined(prompts, 12, page_size)
    p, d, port = _pair(page_size)
    got, finals, _ = _run_pd(p, d, port, prompts, 12)
    assert got == want
    assert all(f.finished_reason["type"] == "length" for f in finals)
    # bytes moved == the prompt's pages x bytes per page (MLA + index K of every layer), nothing more
    pages = sum(-(-len(x) // page_size) for x in prompts)
    ps, ds = p.get_stats().disaggregation, d.get_stats().disaggregation
    assert ps["pages_sent"] == ds["pages_received"] == pages
    assert ps["bytes_sent"] == ds["bytes_received"] == pages * bytes_per_page(p.pd.desc.meta)
    _no_leak(p, d)


def test_pd_single_request_and_prefill_radix_hits():
    base = _prompts(1, seed=7)[0][:60]
    prompts = [base + [11, 12, 13], base + [21, 22]]
    want = _combined(prompts, 8)
    p, d, port = _pair()
    got1, _, _ = _run_pd(p, d, port, prompts[:1], 8)
    got2, finals, pouts = _run_pd(p, d, port, prompts[1:], 8)
    assert got1 + got2 == want
    assert pouts[0].cached_tokens >= 60  # the second prompt hit the first one's KV on the prefill side
    assert finals[0].cached_tokens == pouts[0].cached_tokens  # reported to the client by the decode side
    _no_leak(p, d)


def test_pd_indexcache_freq4():
    ic = dict(nsa_index_topk_freq=4, nsa_index_topk_offset=2)
    prompts = _prompts(4, seed=3)
    want = _combined(prompts, 10, **ic)
    p, d, port = _pair(**ic)
    lay = p.tp_worker.model_runner.token_to_kv_pool.layout()
    assert 0 < len(lay.index_layer_ids) < lay.layer_num  # only full layers hold (and move) index K
    got, _, _ = _run_pd(p, d, port, prompts, 10)
    assert got == want
    names = [(b.layer_id, b.name) for b in p.pd.desc.meta.buffers if b.name == "index_k"]
    assert [lid for lid, _ in names] == list(lay.index_layer_ids)
    _no_leak(p, d)


def test_pd_layout_mismatch_fails_at_handshake():
    p, d, port = _pair(prefill_kw=dict(nsa_index_topk_freq=4, nsa_index_topk_offset=2))
    _, finals, pouts = _run_pd(p, d, port, _prompts(1), 5)
    f = finals[0].finished_reason
    assert f["type"] == "abort" and "handshake" in f["message"] and "index-K layer ids" in f["message"], f
    assert pouts[0].finished_reason["type"] == "abort"
    assert p.get_stats().disaggregation["bytes_sent"] == 0
    _no_leak(p, d)


def test_pd_fp8_kv_moves_fp8_pages_and_matches_combined():
    """--kv-cache-dtype fp8_e4m3 on both sides: raw FP8 rows move (layout() row bytes, not the model
    dtype's), and decode gives the combined FP8 server's tokens."""
    fp8 = dict(kv_cache_dtype="fp8_e4m3")
    prompts = _prompts(4, seed=5)
    want = _combined(prompts, 10, 64, **fp8)
    p, d, port = _pair(64, **fp8)
    lay = p.tp_worker.model_runner.token_to_kv_pool.layout()
    assert (lay.dtype, lay.kv_cache_dtype) == (torch.uint8, "fp8_e4m3")
    got, _, _ = _run_pd(p, d, port, prompts, 10)
    assert got == want
    pages = sum(-(-len(x) // 64) for x in prompts)
    assert p.get_stats().disaggregation["bytes_sent"] == pages * bytes_per_page(p.pd.desc.meta)
    assert bytes_per_page(p.pd.desc.meta) == 64 * (lay.layer_num * lay.kv_row_bytes) + lay.index_k_bytes_per_page * len(
        lay.index_layer_ids)
    _no_leak(p, d)


def test_pd_fp8_prefill_to_auto_decode_fails_at_handshake():
    p, d, port = _pair(prefill_kw=dict(kv_cache_dtype="fp8_e4m3"))
    _, finals, _ = _run_pd(p, d, port, _prompts(1), 5)
    f = finals[0].finished_reason
    assert f["type"] == "abort" and "handshake" in f["message"], f
    assert p.get_stats().disaggregation["bytes_sent"] == 0
    _no_leak(p, d)


def test_pd_decode_abort_frees_both_sides():
    p, d, port = _pair()
    prompts = _prompts(2, seed=5)
    rids = ["a0", "a1"]
    for rid, ids in zip(rids, prompts):
        room = next(_rooms)
        p.add_request(_req(rid, ids, 50, room, port))
        d.add_request(_req(rid, ids, 50, room, port))
    d.step()  # registered (preallocated) before the prefill ran
    outs = d.abort_request("a0")
    assert outs and outs[0].finished_reason["type"] == "abort"
    finals = {}
    for _ in _ticks():
        if not (p.has_work() or d.has_work()):
            break
        p.step()
        for o in d.step():
            if o.finished_reason:
                finals[o.rid] = o
    assert "a0" not in finals and finals["a1"].finished_reason["type"] == "length"
    assert not d.pd_transfers  # the prefill side answered the abort: no preallocation waits for a timeout
    _no_leak(p, d)


def test_flags_validated(monkeypatch):
    with pytest.raises(ServerArgsError, match="disaggregation-mode"):
        _args(disaggregation_mode="both")
    with pytest.raises(ServerArgsError, match="disaggregation-bootstrap-port"):
        _args(disaggregation_mode="decode", disaggregation_transfer_backend="fake", disaggregation_bootstrap_port=0)
    # the fake backend memmoves host memory: KV on a GPU is a start-up error, not a segfault later
    # (--device auto on a host that sees a GPU, as the GPU container is)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ServerArgsError, match="disaggregation-transfer-backend.*--device cpu"):
        ServerArgs(model_path=MODEL, disaggregation_mode="prefill", disaggregation_transfer_backend="fake").validate()


def test_fake_backend_refuses_device_tensors():
    from sglang.srt.disaggregation.transfer import FakeBackend

    b = FakeBackend()
    try:
        b.register_tensor(torch.zeros(4))
        meta = torch.zeros(4, device="meta")  # any non-host tensor; no GPU needed
        with pytest.raises(ValueError, match="copies host memory"):
            b.register_tensor(meta)
        assert len(b.regions) == 1
    finally:
        b.close()


def test_pd_speculative_moves_draft_kv_and_matches_combined():
    """EAGLE on both sides: the draft's KV moves with the target's (same page list), the draft's first
    proposal and hidden state ride in Done; greedy tokens equal a combined speculative server."""
    spec = dict(speculative_algorithm="EAGLE", speculative_num_steps=3)
    global MODEL
    model, MODEL = MODEL, "builtin:tiny-deepseek-v32-mtp"
    try:
        prompts = _prompts(4, seed=13)
        want = _combined(prompts, 16, **spec)
        p, d, port = _pair(**spec)
        assert {b.pool for b in p.pd.desc.meta.buffers} == {"target", "draft"}
        got, _, _ = _run_pd(p, d, port, prompts, 16)
        assert got == want
        pages = sum(len(x) for x in prompts)
        assert d.get_stats().disaggregation["bytes_received"] == pages * bytes_per_page(p.pd.desc.meta)
        assert d.tp_worker.num_verify_steps > 0  # the decode side really ran verifies
        _no_leak(p, d)
    finally:
        MODEL = model


def test_pd_decode_really_reads_the_transferred_kv(monkeypatch):
    """Negative control: with the copy skipped the decode side attends over zeros and diverges."""
    from sglang.srt.disaggregation.transfer import FakeBackend

    prompts = _prompts(3, seed=11)
    want = _combined(prompts, 12)
    monkeypatch.setattr(FakeBackend, "write", lambda self, peer, srcs, dsts, lens: None)
    p, d, port = _pair()
    got, _, _ = _run_pd(p, d, port, prompts, 12)
    assert [g[0] for g in got] == [w[0] for w in want]  # the first token is the prefill's
    assert got != want


# -- real servers: prefill + decode + router (Mooncake over TCP) vs one combined server ---------------
# CPU even on a GPU host: these servers test scheduling and transfer over the CPU backends (the fake
# backend memmoves host memory, the CPU Mooncake build reads host memory); cuda_ipc has its own test.
SERVER_ARGS = ("--device", "cpu", "--max-total-tokens", "8192", "--random-seed", "0")
TEXTS = ["The quick brown fox", "Once upon a time in a land far away, there lived", "1, 2, 3, 4,",
         "def fibonacci(n):", "Paris is the capital of", "Q: what is 7 times 6?\nA:"]


def _complete(base_url: str, prompt: str, max_tokens: int = 12):
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
    return client.completions.create(model="default", prompt=prompt, max_tokens=max_tokens, temperature=0)


def _idle_no_leak(server: ServerProcess) -> dict:
    return server.wait_state(lambda st: st["num_running_reqs"] == 0 and st["num_waiting_reqs"] == 0
                             and st["kv_leak"] is None and not (st["disaggregation"] or {}).get("waiting")
                             and st["kv_free_tokens"] + st["kv_cached_tokens"] == st["kv_total_tokens"]
                             and not any((st["disaggregation"] or {}).get(k) for k in
                                                ("transferring", "queued", "bootstrapping", "inflight")),
                             "idle without leaks")


@NEEDS_MOONCAKE
@pytest.mark.parametrize("page_size", ["1", "64"])
def test_servers_router_match_combined(page_size):
    args = (*SERVER_ARGS, "--page-size", page_size)
    with ServerProcess(MODEL, *args) as combined:
        want = {t: _complete(combined.base_url, t).choices[0].text for t in TEXTS}
    with PDSetup(MODEL, *args) as pd:
        single = _complete(pd.base_url, TEXTS[0])
        assert single.choices[0].text == want[TEXTS[0]]
        with concurrent.futures.ThreadPoolExecutor(len(TEXTS)) as ex:  # batched on both servers
            got = dict(zip(TEXTS, ex.map(lambda t: _complete(pd.base_url, t), TEXTS)))
        assert {t: r.choices[0].text for t, r in got.items()} == want
        # streaming through the router: the same text
        client = openai.OpenAI(base_url=pd.base_url + "/v1", api_key="x", max_retries=0)
        chunks = client.completions.create(model="default", prompt=TEXTS[1], max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want[TEXTS[1]]
        # radix hit on the prefill side, reported by the decode side
        long = _complete(pd.base_url, "Once upon a time " * 12)  # > 2 pages of 64
        again = _complete(pd.base_url, "Once upon a time " * 12 + "a dragon")
        assert again.usage.prompt_tokens_details.cached_tokens >= 64
        ps, ds = _idle_no_leak(pd.prefill), _idle_no_leak(pd.decode)
        p = int(page_size)
        usages = [single.usage.prompt_tokens] + [r.usage.prompt_tokens for r in got.values()] + \
                 [got[TEXTS[1]].usage.prompt_tokens, long.usage.prompt_tokens, again.usage.prompt_tokens]
        pages = sum(-(-n // p) for n in usages)
        pd_p, pd_d = ps["disaggregation"], ds["disaggregation"]
        assert pd_p["pages_sent"] == pd_d["pages_received"] == pages
        assert pd_p["bytes_sent"] == pd_d["bytes_received"] == pages * pd_d["bytes_per_page"]


@NEEDS_MOONCAKE
def test_server_layout_mismatch_fails_at_handshake():
    with PDSetup(MODEL, *SERVER_ARGS, prefill_args=("--nsa-index-topk-freq", "4", "--nsa-index-topk-offset", "2")) as pd:
        r = requests.post(pd.base_url + "/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 4},
                          timeout=120)
        assert r.status_code >= 500, r.text
        msg = r.json()["error"]["message"]
        assert "handshake" in msg and "index-K layer ids" in msg, msg
        _idle_no_leak(pd.prefill)
        _idle_no_leak(pd.decode)


@NEEDS_MOONCAKE
def test_killed_decode_server_mid_transfer():
    long_prompt = " ".join(f"w{i}" for i in range(700))  # ~2.4K tokens, prefilled in 64-token chunks
    with PDSetup(MODEL, *SERVER_ARGS, "--chunked-prefill-size", "64") as pd:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(requests.post, pd.base_url + "/v1/completions",
                            json={"model": "default", "prompt": long_prompt, "max_tokens": 50}, timeout=120)
            # the decode side has preallocated and registered: its KV is on the way
            pd.decode.wait_state(lambda st: (st["disaggregation"] or {}).get("transferring") == 1, "transferring")
            pd.decode.proc.send_signal(signal.SIGKILL)
            r = fut.result()
        assert r.status_code in (502, 503), r.text
        assert r.json()["error"]["message"] and r.json()["error"]["type"] == "server_error"
        st = _idle_no_leak(pd.prefill)  # the prefill side freed the request's pages
        assert st["kv_free_tokens"] + st["kv_cached_tokens"] == st["kv_total_tokens"]
        assert requests.get(pd.prefill.base_url + "/health", timeout=10).status_code == 200


def test_mooncake_missing_is_a_startup_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # import fails as if not installed
    with pytest.raises(ServerArgsError, match="mooncake-transfer-engine"):
        _args(disaggregation_mode="prefill", disaggregation_transfer_backend="mooncake")


@NEEDS_MOONCAKE
def test_cp2_prefill_sends_only_its_pages():
    """Prefill with context parallel (cp = 2, gloo): each rank writes only the pages it owns; the
    decode server commits after both ranks' Done and decodes cp = 1's greedy tokens."""
    args = (*SERVER_ARGS, "--page-size", "16")
    prompts = TEXTS[:3] + ["Long context " * 30]
    with ServerProcess(MODEL, *args) as combined:
        want = [_complete(combined.base_url, t).choices[0].text for t in prompts]
    cp = ("--tp-size", "2", "--attn-cp-size", "2", "--enable-nsa-prefill-context-parallel")
    with PDSetup(MODEL, *args, prefill_args=cp) as pd:
        got = [_complete(pd.base_url, t) for t in prompts]
        assert [r.choices[0].text for r in got] == want
        ps, ds = _idle_no_leak(pd.prefill), _idle_no_leak(pd.decode)
        pages = sum(-(-r.usage.prompt_tokens // 16) for r in got)
        assert ds["disaggregation"]["pages_received"] == pages
        assert ds["disaggregation"]["bytes_received"] == pages * ds["disaggregation"]["bytes_per_page"]
        rank0 = ps["disaggregation"]["pages_sent"]  # the stats come from CP rank 0
        assert 0 < rank0 < pages, (rank0, pages)  # no rank sends (or holds) the full KV


@NEEDS_MOONCAKE
def test_native_generate_through_router():
    """/generate (upstream's native API) through the router, streaming, equals the combined server."""
    body = {"input_ids": list(range(5, 60)), "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    with ServerProcess(MODEL, *SERVER_ARGS) as combined:
        want = requests.post(combined.base_url + "/generate", json=body, timeout=120).json()["output_ids"]
    with PDSetup(MODEL, *SERVER_ARGS) as pd:
        got = requests.post(pd.base_url + "/generate", json=body, timeout=120).json()["output_ids"]
        assert got == want
        with requests.post(pd.base_url + "/generate", json={**body, "stream": True}, stream=True, timeout=120) as r:
            events = [line for line in r.iter_lines() if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]" and b'"finish_reason": {"type": "length"' in events[-2]


def test_pd_prefill_computes_nothing_before_the_decode_side_preallocated():
    """Upstream's order (issue 33): a PD request waits in the prefill server's bootstrap queue,
    holding no KV and computing nothing, until its decode server has preallocated its pages (the
    old order prefilled at once and held the KV for a decode server that might never have room,
    then failed it after 120 s). Then it runs and decodes the combined server's tokens."""
    p, d, port = _pair()
    room, ids = next(_rooms), _prompts(1, seed=17)[0]
    want = _combined([ids], 8)
    free = p.allocator.available_size()
    p.add_request(_req("o0", ids, 8, room, port))
    for _ in range(50):
        p.step()
    assert p.forward_ct == 0 and p.allocator.available_size() == free
    assert room in p.bootstrap_queue and p.get_stats().num_prefill_bootstrap_queue_reqs == 1
    d.add_request(_req("o0", ids, 8, room, port))
    toks = []
    for _ in _ticks():
        if not (p.has_work() or d.has_work()):
            break
        p.step()
        toks += [t for o in d.step() for t in o.new_token_ids]
    assert [toks] == want and p.get_stats().num_prefill_bootstrap_queue_reqs == 0
    _no_leak(p, d)


@pytest.mark.parametrize("announced", [True, False])
def test_pd_prefill_abort_frees_both_sides(announced):
    """A client abort on the prefill side while the request waits in its bootstrap queue fails the
    decode side's request at once, which frees its preallocation -- whether the decode side's
    Register was already read there (a Done error goes back) or arrives later (answered from
    `pd_gone`)."""
    p, d, port = _pair()
    room = next(_rooms)
    ids = _prompts(1, seed=17)[0]
    p.add_request(_req("b0", ids, 20, room, port))
    d.add_request(_req("b0", ids, 20, room, port))
    d.step()  # handshake + register (preallocated)
    assert room in d.pd_transfers
    if announced:
        _read_register(p, room)
        assert room in p.bootstrap_queue
    outs = p.abort_request("b0")
    assert outs[0].finished_reason["type"] == "abort"
    finals = {}
    for _ in _ticks():
        if not (p.has_work() or d.has_work()):
            break
        p.step()
        for o in d.step():
            if o.finished_reason:
                finals[o.rid] = o
    assert finals["b0"].finished_reason["type"] == "abort", finals
    assert not d.pd_transfers and p.forward_ct == 0
    _no_leak(p, d)


def _abort_chunked_prefill(overlap: bool, by: str, at: str):
    """A 200-token prompt prefilled in 64-token chunks (64, 64, 64, 8); `at`: "mid" (chunk 2 of 4 in
    flight under overlap, or between chunks 2 and 3 without), "last" (chunk 4 in flight, or between
    chunks 3 and 4). Aborts it there by the client (prefill side) or by the decode side (AbortRoom),
    then steps the prefill side once. Returns (p, d, that step's outputs, chunks launched by it)."""
    p, d, port = _pair(chunked_prefill_size=64, disable_overlap_schedule=not overlap)
    room, ids = next(_rooms), [random.Random(29).randrange(5, 900) for _ in range(200)]
    p.add_request(_req("c0", ids, 20, room, port))
    d.add_request(_req("c0", ids, 20, room, port))
    d.step()  # registers (preallocated)
    _read_register(p, room)
    for _ in range((2 if at == "mid" else 4) - (0 if overlap else at == "last")):
        p.step()
    assert room in p.pd_regs
    req = p.overlap.reqs[0] if overlap else p.chunked_req
    assert req.rid == "c0" and req.is_chunked == (at == "mid" or not overlap)
    assert p.tree_cache.protected_size() > 0  # its chunks so far are locked in the radix cache
    if by == "client":
        assert p.abort_request("c0") == []  # deferred: a step may still write its KV
    else:
        assert d.abort_request("c0")[0].finished_reason["type"] == "abort"
        assert p.bootstrap.poll(5000)  # the AbortRoom is read by the next prefill step
    launched = p.forward_ct
    outs = p.step()
    return p, d, outs, p.forward_ct - launched


@pytest.mark.parametrize("at", ["mid", "last"])
@pytest.mark.parametrize("by", ["client", "decode"])
@pytest.mark.parametrize("overlap", [True, False])
def test_pd_abort_during_chunked_prefill_frees_at_once(overlap, by, at):
    """An abort while a prompt is prefilled in chunks -- its chunk in flight (overlap), between two
    chunks, or on its last chunk; from the client or the decode side -- ends it on the prefill side
    in the next step: no further chunk runs, its pages and its radix-cache lock are released (a
    chunk in flight under overlap used to be continued to the end of the prompt, holding both, and
    the request counted as neither running nor waiting). Then both sides end with nothing held."""
    p, d, outs, launched = _abort_chunked_prefill(overlap, by, at)
    assert launched == 0, f"{launched} more chunk(s) launched for the aborted request"
    assert [o.finished_reason["type"] for o in outs if o.rid == "c0"] == ["abort"], outs
    assert not p.has_work() and p.tree_cache.protected_size() == 0 and p.kv_leak_report() is None
    for _ in _ticks():
        if not (p.has_work() or d.has_work()):
            break
        p.step()
        d.step()
    assert not d.pd_transfers and not p.pd_rooms  # the decode side got its answer: preallocation freed
    _no_leak(p, d)


@NEEDS_MOONCAKE
def test_cp2_prefill_with_speculative_decode():
    """CP = 2 prefill + EAGLE on both servers: draft KV pages move per rank like the target's, the
    draft state comes from rank 0; tokens equal a combined EAGLE server."""
    model = "builtin:tiny-deepseek-v32-mtp"
    args = (*SERVER_ARGS, "--page-size", "16", "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3")
    prompts = TEXTS[:2] + ["Long context " * 30]
    with ServerProcess(model, *args) as combined:
        want = [_complete(combined.base_url, t).choices[0].text for t in prompts]
    cp = ("--tp-size", "2", "--attn-cp-size", "2", "--enable-nsa-prefill-context-parallel")
    with PDSetup(model, *args, prefill_args=cp) as pd:
        got = [_complete(pd.base_url, t) for t in prompts]
        assert [r.choices[0].text for r in got] == want
        ds = _idle_no_leak(pd.decode)["disaggregation"]
        _idle_no_leak(pd.prefill)
        pages = sum(-(-r.usage.prompt_tokens // 16) for r in got)
        assert ds["pages_received"] == pages and ds["bytes_received"] == pages * ds["bytes_per_page"]


@pytest.fixture
def held_writes(monkeypatch):
    """Fake writes that block until the test sets `release`; `started` is set when one begins."""
    import threading

    from sglang.srt.disaggregation.transfer import FakeBackend

    release, started, real_write = threading.Event(), threading.Event(), FakeBackend.write

    def held_write(self, peer, srcs, dsts, lens):
        started.set()
        assert release.wait(60), "the test never released the write"
        real_write(self, peer, srcs, dsts, lens)

    monkeypatch.setattr(FakeBackend, "write", held_write)
    yield started, release
    release.set()


def test_transfer_runs_off_the_scheduler_thread(held_writes):
    """A slow KV write does not stall the prefill scheduler: while request A's write is held, the
    scheduler prefills B; A's pages stay allocated until the write ended (never reused while read);
    then both decode to the combined server's tokens, and nothing leaks."""
    started, release = held_writes
    prompts = _prompts(2, seed=21)
    want = _combined(prompts, 6)
    p, d, port = _pair()
    rooms = [next(_rooms), next(_rooms)]
    p.add_request(_req("x0", prompts[0], 6, rooms[0], port))
    d.add_request(_req("x0", prompts[0], 6, rooms[0], port))
    toks = {"x0": [], "x1": []}
    for _ in _ticks():  # until A's write has started (and is held)
        p.step()
        toks_d = d.step()
        for o in toks_d:
            toks[o.rid] += o.new_token_ids
        if started.is_set():
            break
    assert started.wait(60) and p.pd_sending
    a = p.pd_sending[rooms[0]].req
    free_before = p.allocator.available_size()
    p.add_request(_req("x1", prompts[1], 6, rooms[1], port))
    d.add_request(_req("x1", prompts[1], 6, rooms[1], port))
    for _ in _ticks():  # B is prefilled while A's write is still held
        p.step()
        for o in d.step():
            toks[o.rid] += o.new_token_ids
        if rooms[1] in p.pd_sending or rooms[1] in p.pd_waiting:
            break
    assert rooms[0] in p.pd_sending and a.req_pool_idx is not None  # A's pages are still held
    assert p.allocator.available_size() < free_before  # B's prefill took pages of its own
    assert toks["x0"] == []  # the decode side has not committed A
    release.set()
    for _ in _ticks():
        if not (p.has_work() or d.has_work()):
            break
        p.step()
        for o in d.step():
            toks[o.rid] += o.new_token_ids
    assert [toks["x0"], toks["x1"]] == want
    assert p.get_stats().disaggregation["transfers"] == 2
    _no_leak(p, d)


def test_abort_during_a_write_frees_pages_only_after_it(held_writes):
    """A decode-side abort while the prefill's write runs: the prefill keeps the pages the write
    reads until it ended, then frees them; the decode side keeps its preallocation until the
    prefill answered; nothing leaks on either side."""
    started, release = held_writes
    p, d, port = _pair()
    room, ids = next(_rooms), _prompts(1, seed=23)[0]
    p.add_request(_req("y0", ids, 20, room, port))
    d.add_request(_req("y0", ids, 20, room, port))
    for _ in _ticks():
        p.step()
        d.step()
        if started.is_set():
            break
    assert started.wait(60)
    outs = d.abort_request("y0")
    assert outs[0].finished_reason["type"] == "abort"
    deadline = time.monotonic() + 60
    while p.pd_sending[room].abort is None and time.monotonic() < deadline:  # the AbortRoom arrives
        p.step()  # the write still runs
        d.step()
    f = p.pd_sending[room]
    assert f.abort is not None and f.req.req_pool_idx is not None
    assert room in d.pd_transfers  # decode keeps its pages: a late write must not land in reused ones
    release.set()
    for _ in _ticks():
        if not (p.has_work() or d.has_work()):
            break
        p.step()
        d.step()
    assert not p.pd_sending and not d.pd_transfers
    assert p.get_stats().disaggregation["transfers"] == 0
    _no_leak(p, d)


def test_cuda_ipc_backend_copies_into_the_peers_mapping(monkeypatch):
    """cuda_ipc's address translation on CPU tensors (the IPC mapping itself needs a GPU: the
    exported handles are replaced by the peer's tensors): ranges land at the peer's offsets, bytes
    outside registered regions fail, an unknown peer fails."""
    from sglang.srt.disaggregation.transfer import CudaIpcBackend, TransferError

    src_bufs = [torch.arange(64, dtype=torch.float32).reshape(8, 8), torch.arange(100, 132, dtype=torch.int8)]
    dst_bufs = [torch.zeros(8, 8), torch.zeros(32, dtype=torch.int8)]
    a, b = CudaIpcBackend(), CudaIpcBackend()
    for t in src_bufs:
        a.local.add(t.data_ptr(), t.reshape(-1).view(torch.uint8))
    monkeypatch.setattr(CudaIpcBackend, "_open", staticmethod(
        lambda exported: [(t.data_ptr(), t.reshape(-1).view(torch.uint8)) for t in dst_bufs]))
    with pytest.raises(TransferError, match="not connected"):
        a.write(b.session_id, [src_bufs[0].data_ptr()], [dst_bufs[0].data_ptr()], [4])
    with pytest.raises(TransferError, match="exported no CUDA IPC handles"):
        a.connect(b.session_id, None)
    a.connect(b.session_id, b"handles")
    row = 8 * 4
    a.write(b.session_id, [src_bufs[0].data_ptr() + 2 * row, src_bufs[1].data_ptr() + 4],
            [dst_bufs[0].data_ptr() + 5 * row, dst_bufs[1].data_ptr()], [2 * row, 8])
    want0 = torch.zeros(8, 8)
    want0[5:7] = src_bufs[0][2:4]
    assert torch.equal(dst_bufs[0], want0)
    assert dst_bufs[1][:8].tolist() == list(range(104, 112)) and not dst_bufs[1][8:].any()
    with pytest.raises(TransferError, match="outside the registered regions"):
        a.write(b.session_id, [src_bufs[0].data_ptr()], [dst_bufs[0].data_ptr() + 7 * row], [2 * row])


def test_transfer_worker_survives_a_failed_write():
    from sglang.srt.disaggregation.transfer import TransferBackend, TransferTask, TransferWorker

    class Flaky(TransferBackend):
        session_id = "flaky"

        def register(self, ptr, nbytes):
            pass

        def write(self, peer, srcs, dsts, lens):
            if peer == "dead":
                raise ConnectionError("peer gone")

    w = TransferWorker(Flaky())
    bad = w.submit(TransferTask(1, "dead", [0], [0], [8]))
    good = w.submit(TransferTask(2, "alive", [0], [0], [8]))
    assert bad.done.wait(30) and good.done.wait(30)
    assert "peer gone" in bad.error and good.error is None
    w.close()


@NEEDS_MOONCAKE
def test_mooncake_backend_writes_many_ranges_and_fails_on_a_dead_peer():
    """MooncakeBackend.write (submit every range, then poll without spinning) moves every byte of
    many ranges of different sizes to the right place, and a write to a peer nobody answers for
    raises TransferError instead of hanging."""
    from sglang.srt.disaggregation.transfer import MooncakeBackend, TransferError

    a, b = MooncakeBackend(), MooncakeBackend()
    src = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    a.register_tensor(src)
    b.register_tensor(dst)
    g = torch.Generator().manual_seed(0)
    cuts = sorted(torch.randperm(src.numel() - 1, generator=g)[:40].add(1).tolist())
    starts, ends = [0] + cuts, cuts + [src.numel()]
    order = torch.randperm(len(starts), generator=g).tolist()  # ranges land in reverse halves
    srcs = [src.data_ptr() + starts[i] for i in order]
    dsts = [dst.data_ptr() + src.numel() - ends[i] for i in order]
    a.write(b.session_id, srcs, dsts, [ends[i] - starts[i] for i in order])
    want = torch.cat([src[s:e] for s, e in zip(starts, ends)][::-1])
    assert torch.equal(dst, want)
    a.write(b.session_id, [], [], [])  # nothing to move is not an error
    with pytest.raises(TransferError):
        a.write(f"127.0.0.1:{free_port()}", [src.data_ptr()], [dst.data_ptr()], [1024])


def test_pd_decode_retracts_and_recomputes_committed_requests(monkeypatch):
    """A decode server whose KV pool cannot hold the growth of every request it admitted retracts
    committed PD requests; each is recomputed there (a plain prefill of prompt + outputs, no second
    transfer) and still decodes the combined server's greedy tokens; nothing leaks on either side."""
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 900) for _ in range(rng.randrange(20, 40))] for _ in range(6)]
    want = _combined(prompts, 40)
    p, d, port = _pair(decode_kw=dict(max_total_tokens=200))  # 6 x (~30 + 40) tokens do not fit
    start = _free_at_rest(p), _free_at_rest(d)
    recomputed = []

    def record(self, batch):
        if batch.forward_mode.is_extend():  # a decode server extends only to recompute
            recomputed.extend((len(r.origin_input_ids), pl + el) for r, pl, el in
                              zip(batch.reqs, batch.prefix_lens, batch.extend_lens))
        return Scheduler.run_batch(self, batch)

    # On the class: a closure over `d` on the instance makes a cycle, and a PD scheduler collected as
    # cyclic garbage hangs in zmq's context term (its sockets' weakrefs are cleared first).
    monkeypatch.setattr(DecodeScheduler, "run_batch", record)
    got, finals, _ = _run_pd(p, d, port, prompts, 40)
    assert d.get_stats().num_retracted_reqs > 0
    assert recomputed and all(kv > n for n, kv in recomputed), recomputed  # prompt + outputs, locally
    assert p.get_stats().disaggregation["transfers"] == len(prompts)  # no KV moved twice
    assert got == want
    assert all(f.finished_reason["type"] == "length" for f in finals)
    _no_leak(p, d)
    assert (_free_at_rest(p), _free_at_rest(d)) == start


def _generate(base_url: str, ids: list[int]) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    r = requests.post(base_url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_router_two_prefill_two_decode_servers():
    """Decode with data parallelism: 2 prefill + 2 decode servers behind one router (servers in this
    process with the fake backend, the router a process). Request k goes to prefill k % 2 and decode
    k // 2 % 2, so four sequential prompts of distinct lengths show which server took which (every
    decode server receives from both prefill servers), then eight go at once. Greedy tokens equal a
    combined server. A decode server that goes down loses its share to the other one; with none left
    the router answers an OpenAI-style 503 and the prefill servers free what they held."""
    prompts = [list(range(5 + k, 5 + k + n)) for k, n in enumerate([20, 45, 70, 95] + [30 + 7 * i for i in range(8)])]
    with InProcessServer(MODEL, *SERVER_ARGS) as combined:
        want = [_generate(combined.base_url, ids) for ids in prompts]
    with PDSetup(MODEL, *SERVER_ARGS, backend="fake", n_prefill=2, n_decode=2) as pd:
        got = [_generate(pd.base_url, ids) for ids in prompts[:4]]
        n = [len(ids) for ids in prompts[:4]]  # page size 1: pages = tokens
        assert [s.internal_state()["disaggregation"]["pages_sent"] for s in pd.prefills] == [n[0] + n[2], n[1] + n[3]]
        assert [s.internal_state()["disaggregation"]["pages_received"] for s in pd.decodes] == [n[0] + n[1],
                                                                                                n[2] + n[3]]
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            got += list(ex.map(lambda ids: _generate(pd.base_url, ids), prompts[4:]))
        assert got == want
        assert [_idle_no_leak(s)["disaggregation"]["transfers"] for s in pd.prefills] == [6, 6]
        assert [_idle_no_leak(s)["disaggregation"]["committed"] for s in pd.decodes] == [6, 6]

        pd.decodes[0].stop()  # the next two requests are decode 0's: the router sends them to decode 1
        assert [_generate(pd.base_url, ids) for ids in prompts[:2]] == want[:2]
        assert _idle_no_leak(pd.decodes[1])["disaggregation"]["committed"] == 8
        pd.decodes[1].stop()
        r = requests.post(pd.base_url + "/generate", json={"input_ids": prompts[0]}, timeout=120)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error", r.text
        assert "no decode server reachable" in r.json()["error"]["message"]
        for path in ("/v1/models", "/health"):
            r = requests.get(pd.base_url + path, timeout=120)
            assert r.status_code == 503 and r.json()["error"]["code"] == 503, r.text
        for s in pd.prefills:  # the failed request was cancelled on its prefill server
            _idle_no_leak(s)


def test_decode_admission_reserves_growth_of_requests_in_transfer():
    """A burst of PD requests: the decode server preallocates only as many as the pool can also
    grow (each admitted request's max_new_tokens x new_token_ratio is kept free), counting those
    whose KV is still on the way -- not every prompt that fits today."""
    p, d, port = _pair(decode_kw=dict(max_total_tokens=2048))
    ids = [5 + i % 800 for i in range(100)]
    for i in range(12):
        room = next(_rooms)
        d.add_request(_req(f"z{i}", ids, 300, room, port))
    free0 = d.allocator.available_size() + d.tree_cache.evictable_size()
    d.step()  # preallocates what fits; nothing has arrived from the prefill side
    admitted = [st.req for st in d.pd_transfers.values()]
    assert 0 < len(admitted) < 12
    ratio = d.decode_manager.new_token_ratio
    need = sum(len(r.origin_input_ids) + int(r.sampling_params.max_new_tokens * ratio) for r in admitted)
    assert need <= free0, (len(admitted), need, free0)


@NEEDS_MOONCAKE
def test_mooncake_backend_windows_thousands_of_ranges_and_recovers_after_a_failure():
    """Issue 33: a write of more ranges than Mooncake's TCP lanes queue per peer (~1K) is submitted
    MOONCAKE_MAX_INFLIGHT at a time, so it is not refused with "queue-full"; after a failed write
    the engine is replaced (same registrations, same receiver session), and the next write to a
    live peer moves every byte again -- no restart."""
    from sglang.srt.disaggregation.transfer import MOONCAKE_MAX_INFLIGHT, MooncakeBackend, TransferError

    a, b = MooncakeBackend(), MooncakeBackend()
    n = 4 * 1024
    assert n > 4 * MOONCAKE_MAX_INFLIGHT
    src = torch.randint(0, 255, (n * 64,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    a.register_tensor(src)
    b.register_tensor(dst)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1)).tolist()
    srcs, dsts, lens = [src.data_ptr() + 64 * i for i in range(n)], [dst.data_ptr() + 64 * j for j in perm], [64] * n
    want = torch.empty_like(src).view(n, 64)
    want[perm] = src.view(n, 64)
    a.write(b.session_id, srcs, dsts, lens)
    assert torch.equal(dst.view(n, 64), want)
    with pytest.raises(TransferError):
        a.write(f"127.0.0.1:{free_port()}", srcs[:8], dsts[:8], lens[:8])
    assert a.resets == 1
    dst.zero_()
    a.write(b.session_id, srcs, dsts, lens)
    assert torch.equal(dst.view(n, 64), want)
