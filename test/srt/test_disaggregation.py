"""Prefill/decode disaggregation (issue 23).

In-process (fake transfer backend): a PrefillScheduler and a DecodeScheduler in this process, stepped
alternately, produce the same greedy tokens as one combined Scheduler; the bytes moved equal the
pages that must move; radix hits on the prefill side; IndexCache freq 4; page sizes 1 and 64; a
layout mismatch fails at the handshake with a message naming it; aborts free both sides.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch

from sglang.srt.disaggregation.common import free_port
from sglang.srt.disaggregation.decode import DecodeScheduler
from sglang.srt.disaggregation.kv_layout import bytes_per_page
from sglang.srt.disaggregation.prefill import PrefillScheduler
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, ServerArgsError

MODEL = "builtin:tiny-deepseek-v32"
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


def _run_pd(p, d, port, prompts, max_new: int, step_limit: int = 5000):
    """Send every prompt to both servers (same room), step both until the decode side finished."""
    rids = [f"q{next(_rooms)}" for _ in prompts]
    finals, pouts = {}, {}
    for rid, ids in zip(rids, prompts):
        room = next(_rooms)
        p.add_request(_req(rid, ids, max_new, room, port))
        d.add_request(_req(rid, ids, max_new, room, port))
    toks = {rid: [] for rid in rids}
    for _ in range(step_limit):
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


def _no_leak(*scheds) -> None:
    for s in scheds:
        assert s.kv_leak_report() is None, s.kv_leak_report()


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
    for _ in range(2000):
        if not (p.has_work() or d.has_work()):
            break
        p.step()
        for o in d.step():
            if o.finished_reason:
                finals[o.rid] = o
    assert "a0" not in finals and finals["a1"].finished_reason["type"] == "length"
    _no_leak(p, d)


def test_flags_validated():
    with pytest.raises(ServerArgsError, match="disaggregation-mode"):
        _args(disaggregation_mode="both")
    with pytest.raises(ServerArgsError, match="disaggregation-mode"):
        _args(disaggregation_mode="decode", disaggregation_transfer_backend="fake", speculative_algorithm="EAGLE")


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
