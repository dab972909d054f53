"""HiCache end to end: a prefix evicted to the host and loaded back layer by layer gives exactly what
a fresh prefill gives -- the greedy tokens and, layer by layer, the DSA indexer's top-k (which reads
the reloaded index K). Upstream shipped "main KV byte-perfect, output garbage" because the index K
was not backed up / restored; comparing top-k per layer is what catches that."""

from __future__ import annotations

import os

import pytest
import torch

from sglang.srt.entrypoints.engine import Engine
from sglang.srt.mem_cache.hicache_transfer import NullBackup
from sglang.srt.server_args import ServerArgs, ServerArgsError

MODEL = "builtin:tiny-deepseek-v32"
DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")  # cuda: the same checks with CUDA streams + pinned host
SP = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def _engine(**kw) -> Engine:
    args = dict(model_path=MODEL, dtype="float32", device=DEVICE, nsa_index_k_dtype="float32", random_seed=0,
                max_total_tokens=256, page_size=1)
    args.update(kw)
    return Engine(**args)


def _prompts(n_fill: int, length: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(5, 1000, (length,), generator=g).tolist()
    return prompt, [torch.randint(5, 1000, (length,), generator=g).tolist() for _ in range(n_fill)]


class TopkCapture:
    """Records, per layer, the top-k indices the attention of each extend forward received (test only:
    a forward pre-hook on every layer's RadixAttention; the model is untouched)."""

    def __init__(self, engine: Engine) -> None:
        self.rows: dict[int, list[torch.Tensor]] = {}
        layers = engine.scheduler.tp_worker.model_runner.model.model.layers
        self.handles = [layer.self_attn.attn.register_forward_pre_hook(self._hook(i)) for i, layer in
                        enumerate(layers)]

    def _hook(self, layer_id: int):
        def hook(_module, args):
            fb, topk = args[4], args[5]
            if topk is not None and fb.forward_mode.is_extend():
                self.rows.setdefault(layer_id, []).append(topk.detach().cpu().clone())
        return hook

    def last(self, layer_id: int) -> torch.Tensor:
        return self.rows[layer_id][-1]

    def clear(self) -> None:
        self.rows.clear()

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _wait_idle(engine: Engine) -> None:
    tc = engine.scheduler.tree_cache
    tc.controller.wait_idle()
    tc.check_events()


def _assert_clean(engine: Engine) -> None:
    _wait_idle(engine)
    tc = engine.scheduler.tree_cache
    tc.check_invariants()
    assert engine.scheduler.kv_leak_report() is None
    assert tc.pinned_backup_tokens == 0 and tc.evictable_size() == tc.total_size()
    assert tc.backup.reserved_size() == 0


def _fresh(prompt: list[int], **kw) -> tuple[list[int], dict[int, torch.Tensor]]:
    """Greedy tokens and each layer's top-k rows of a fresh prefill (no prefix cache at all)."""
    eng = _engine(disable_radix_cache=True, **kw)
    cap = TopkCapture(eng)
    out = eng.generate(input_ids=prompt, sampling_params=SP)["output_ids"]
    topk = {lid: torch.cat(rows) for lid, rows in cap.rows.items()}  # the prompt's prefill chunks
    cap.close()
    return out, topk


def _evict_then_reload(eng: Engine, prompt: list[int], fillers: list[list[int]]) -> tuple[list[int], dict, dict]:
    """Run the prompt, evict it to the host with fillers, re-run it; returns (tokens of the re-run,
    its per-layer top-k rows, its meta_info)."""
    tc = eng.scheduler.tree_cache
    eng.generate(input_ids=prompt, sampling_params=SP)
    for f in fillers:
        eng.generate(input_ids=f, sampling_params=SP)
    _wait_idle(eng)
    match = tc.match_prefix(prompt)
    assert match.host_hit_length >= len(prompt) // 2, "the prompt's KV should have moved to the host"
    cap = TopkCapture(eng)
    res = eng.generate(input_ids=prompt, sampling_params=SP)
    topk = {lid: torch.cat(rows) for lid, rows in cap.rows.items()}
    cap.close()
    return res["output_ids"], topk, res["meta_info"]


def _check_topk(fresh: dict[int, torch.Tensor], reload: dict[int, torch.Tensor], layers: int) -> None:
    assert sorted(reload) == list(range(layers))
    for lid in range(layers):
        rows = reload[lid]
        want = fresh[lid][-rows.shape[0]:]  # the reload extends only the uncached tail
        assert bool((rows >= 0).any()), f"layer {lid}: top-k all -1"
        assert torch.equal(rows, want), f"layer {lid}: top-k after reload differs from a fresh prefill"


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_reload_equals_fresh_prefill(policy):
    prompt, fillers = _prompts(3, 120)
    want, fresh_topk = _fresh(prompt)
    eng = _engine(enable_hierarchical_cache=True, hicache_write_policy=policy)
    if policy == "write_through_selective":  # backed up on the second hit: hit it twice first
        eng.generate(input_ids=prompt, sampling_params=SP)
    got, topk, meta = _evict_then_reload(eng, prompt, fillers)
    assert got == want
    assert meta["cached_tokens"] >= 100
    assert eng.scheduler.tree_cache.stats["loaded_tokens"] >= 100
    _check_topk(fresh_topk, topk, 4)
    _assert_clean(eng)
    backup = eng.scheduler.tree_cache.backup
    if policy == "write_through":  # backed up during the prefill forwards, at layer ends
        assert backup.stats["committed"] >= 4 and backup.stats["rolled_back"] == 0
    else:
        assert isinstance(backup, NullBackup)


def test_repeated_prompt_reserves_no_duplicate_backup():
    prompt, _ = _prompts(0, 120, seed=4)
    eng = _engine(enable_hierarchical_cache=True)
    backup = eng.scheduler.tree_cache.backup
    first = eng.generate(input_ids=prompt, sampling_params=SP)["output_ids"]
    _wait_idle(eng)
    reserved = backup.stats["reserved_tokens"]
    assert reserved == 120
    assert eng.generate(input_ids=prompt, sampling_params=SP)["output_ids"] == first
    both = eng.generate(input_ids=[prompt + [7] * 8, prompt + [7] * 8], sampling_params=SP)
    assert both[0]["output_ids"] == both[1]["output_ids"]
    _assert_clean(eng)
    # the repeat reserved nothing; the two equal prompts in one batch reserved their new pages once
    assert backup.stats["reserved_tokens"] == reserved + 8 and backup.stats["rolled_back"] == 0


def test_page64_indexcache_freq4_chunked_prefill_page_first():
    kw = dict(page_size=64, max_total_tokens=512, nsa_index_topk_freq=4, chunked_prefill_size=64)
    prompt, fillers = _prompts(3, 200, seed=1)
    want, fresh_topk = _fresh(prompt, **kw)
    eng = _engine(enable_hierarchical_cache=True, hicache_mem_layout="page_first", **kw)
    pool = eng.scheduler.tp_worker.model_runner.token_to_kv_pool
    assert pool.index_layer_ids == [0, 1]  # F F S S: shared layers have no index K to move
    got, topk, meta = _evict_then_reload(eng, prompt, fillers)
    assert got == want and meta["cached_tokens"] == 192
    _check_topk(fresh_topk, topk, 4)
    _assert_clean(eng)
    stats = eng.scheduler.tree_cache.backup.stats  # one reservation per 64-token chunk, all committed
    assert stats["committed"] >= 3 * 4 and stats["rolled_back"] == 0


def test_delayed_layer_load_still_identical():
    """Each layer's load is held back: the forward's getters (MLA KV and index K) must wait for it."""
    prompt, fillers = _prompts(3, 120, seed=2)
    want, fresh_topk = _fresh(prompt)
    eng = _engine(enable_hierarchical_cache=True)
    ctl = eng.scheduler.tree_cache.controller
    loaded = []

    def slow(layer_id: int) -> None:
        import time

        time.sleep(0.05)
        loaded.append(layer_id)

    ctl.layer_load_delay_s = slow
    got, topk, _ = _evict_then_reload(eng, prompt, fillers)
    assert loaded[:4] == [0, 1, 2, 3]
    assert got == want
    _check_topk(fresh_topk, topk, 4)
    _assert_clean(eng)


def test_failed_backup_leaves_nothing_visible():
    prompt, fillers = _prompts(3, 120, seed=3)
    want, _ = _fresh(prompt)
    eng = _engine(enable_hierarchical_cache=True)
    tc = eng.scheduler.tree_cache
    host_free0, dev_free0 = tc.host_allocator.available_size(), eng.scheduler.allocator.available_size()
    tc.controller.backup_fault = lambda layer_id: layer_id == 2
    eng.generate(input_ids=prompt, sampling_params=SP)
    _assert_clean(eng)
    assert tc.host_total_size() == 0 and tc.host_allocator.available_size() == host_free0
    assert tc.backup.stats["rolled_back"] >= 1 and tc.backup.stats["committed"] == 0
    assert tc.match_prefix(prompt).host_hit_length == 0
    tc.controller.backup_fault = None
    eng.scheduler.flush_cache()
    assert eng.scheduler.allocator.available_size() == dev_free0
    assert tc.host_allocator.available_size() == host_free0
    got, _, _ = _evict_then_reload(eng, prompt, fillers)  # later requests back up and reload fine
    assert got == want
    _assert_clean(eng)


@pytest.mark.parametrize("kw,flag", [
    (dict(enable_hierarchical_cache=True, disable_radix_cache=True), "enable_hierarchical_cache"),
    (dict(enable_hierarchical_cache=True, hicache_io_backend="kernel", device="cpu"), "hicache_io_backend"),
    (dict(enable_hierarchical_cache=True, hicache_ratio=0.0), "hicache_ratio"),
    (dict(hicache_write_policy="write_sometimes"), "hicache_write_policy"),
    (dict(hicache_mem_layout="tokens_first"), "hicache_mem_layout"),
    (dict(hicache_size=-1.0), "hicache_size"),
])
def test_bad_flags_name_the_flag(kw, flag):
    with pytest.raises(ServerArgsError) as e:
        ServerArgs(model_path=MODEL, **kw).validate()
    assert e.value.flag == flag


def test_host_size_beyond_host_memory_is_refused():
    with pytest.raises(ServerArgsError) as e:
        _engine(enable_hierarchical_cache=True, hicache_size=1e9)  # 1e9 GB
    assert e.value.flag == "hicache_size" and "available" in str(e.value)


def test_eagle_draft_kv_is_backed_up_and_restored():
    """The draft (NextN) pool has its own KV and index K: its host mirror shares the target's host
    slots. After a reload the draft proposes exactly what it proposes after a fresh prefill, so the
    acceptance is the same (upstream: acceptance collapsed after a reload until a cache flush)."""
    kw = dict(model_path="builtin:tiny-deepseek-v32-mtp", speculative_algorithm="EAGLE", speculative_num_steps=2)
    prompt, fillers = _prompts(2, 120, seed=5)  # 3 x 132 tokens: the device (256) evicts, the host (512) keeps
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}

    def run(eng: Engine) -> tuple[list[int], list[list[int]], float]:
        drafts = []
        eng.scheduler.tp_worker.draft_override = lambda reqs, d, kv_lens: (drafts.append(d.tolist()), d)[1]
        out = eng.generate(input_ids=prompt, sampling_params=sp)
        eng.scheduler.tp_worker.draft_override = None
        return out["output_ids"], drafts, out["meta_info"]["spec_accept_length"]

    want = run(_engine(disable_radix_cache=True, **kw))
    eng = _engine(enable_hierarchical_cache=True, **kw)
    tc = eng.scheduler.tree_cache
    assert len(tc.controller.pairs) == 2 and tc.controller.pairs[1][0].layer_num == 1
    assert run(eng) == want
    for f in fillers:
        eng.generate(input_ids=f, sampling_params=sp)
    _wait_idle(eng)
    assert tc.match_prefix(prompt).host_hit_length >= 100
    assert run(eng) == want  # the reloaded draft KV drafts (and is accepted) as after a fresh prefill
    assert tc.backup.stats["rolled_back"] == 0
    _assert_clean(eng)


@pytest.mark.parametrize("mode,page_size", [("round-robin-split", 64), ("in-seq-split", 1)])
def test_cp2_reload_equals_cp1_fresh(mode, page_size):
    """CP = 2 on real processes (gloo): each rank backs up and reloads only the pages it stores (a
    load-back takes device pages of the owners the host pages came from), with no collective in
    HiCache; the reloaded prompt decodes as cp = 1 without any cache does."""
    from sglang.srt.testing.multi_rank import Case, run_case, run_multi_rank

    prompt, fillers = _prompts(2, 200, seed=6)
    sa = dict(model_path=MODEL, dtype="float32", nsa_index_k_dtype="float32", page_size=page_size,
              max_total_tokens=512, chunked_prefill_size=-1, enable_nsa_prefill_context_parallel=True,
              nsa_prefill_cp_mode=mode, enable_hierarchical_cache=True)
    case = Case(f"cp2-{mode}", sa, [prompt], 6, rounds=[[f] for f in fillers] + [[prompt]])
    got = run_multi_rank([case], 2)[0]
    ref_sa = {k: v for k, v in sa.items() if k not in ("enable_nsa_prefill_context_parallel", "nsa_prefill_cp_mode",
                                                       "enable_hierarchical_cache")}
    ref = run_case(Case("ref", dict(ref_sa, disable_radix_cache=True), [prompt], 6), 1)
    assert got["p0"]["ids"] == ref["p0"]["ids"]
    assert got[f"r{len(fillers)}_0"]["ids"] == ref["p0"]["ids"]  # after eviction to host and reload
    assert got["_stats"]["cached_tokens"] >= 192  # the reloaded prefix counted as cached
    assert got["_stats"]["cache_stats"]["loaded_tokens"] >= 192  # ... and it came from the host
    assert got["_stats"]["kv_leak"] is None


def test_trace_hook_sees_every_payload_at_backup_and_reload():
    """The KV-trace seam: with `controller.trace` set, every backed-up and every reloaded page of
    every layer is reported with (host page, prefix-hash key); the reloaded bytes equal the backed-up
    ones, and index K appears exactly on the index layers."""
    prompt, fillers = _prompts(3, 120, seed=7)
    eng = _engine(enable_hierarchical_cache=True, nsa_index_topk_freq=4)
    tc = eng.scheduler.tree_cache
    seen: dict[tuple, dict[str, torch.Tensor]] = {}

    class Trace:
        def record(self, event, fingerprint, layer_id, payload, tensor):
            seen.setdefault((fingerprint, layer_id, payload), {})[event] = tensor.clone()

    tc.controller.trace = Trace()
    _evict_then_reload(eng, prompt, fillers)
    _wait_idle(eng)
    reloaded = {k: v for k, v in seen.items() if "load" in v}
    # backup reports the host rows, load what landed on the device (a broken copy shows): compare on the host
    assert reloaded and all("backup" in v and torch.equal(v["backup"].cpu(), v["load"].cpu())
                            for v in reloaded.values())
    assert {lid for (_, lid, name) in reloaded if name == "index_k"} == {0, 1}
    assert {lid for (_, lid, name) in reloaded if name == "kv"} == {0, 1, 2, 3}
    keys = {fp[1] for (fp, _, _) in reloaded}
    assert None not in keys and len(keys) == len({fp for (fp, _, _) in reloaded})
    assert len({fp[0] for (fp, _, _) in reloaded}) >= 100  # page size 1: one host page per reloaded token


@pytest.mark.parametrize("abort_after_steps", [1, 2, 3])
def test_abort_mid_chunked_prefill_then_reload(abort_after_steps):
    """Abort a chunked prefill part-way (its chunks' backups in flight or committed): no KV or host
    slot leaks, nothing uncommitted is visible, and later requests for the same prompt -- served from
    whatever was backed up, after an eviction -- still equal a fresh prefill."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    kw = dict(chunked_prefill_size=32)
    prompt, fillers = _prompts(3, 120, seed=8)
    want, _ = _fresh(prompt, **kw)
    eng = _engine(enable_hierarchical_cache=True, **kw)
    sched, tc = eng.scheduler, eng.scheduler.tree_cache
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    sched.add_request(TokenizedGenerateReqInput("victim", list(prompt), sp))
    for _ in range(abort_after_steps):
        sched.step()
    sched.abort_request("victim")
    while sched.has_work():
        sched.step()
    _assert_clean(eng)
    assert tc.match_prefix(prompt).host_hit_length == 0  # anything it cached is device-resident
    got, _, meta = _evict_then_reload(eng, prompt, fillers)
    assert got == want and meta["cached_tokens"] >= 100
    assert eng.generate(input_ids=prompt, sampling_params=SP)["output_ids"] == want
    _assert_clean(eng)


def test_idle_server_commits_its_last_backup():
    """A write-through backup that ends after the server's last step is acknowledged while the server
    idles (the host copy is committed and the device node unpinned; an L3 store would follow), not
    only when the next request arrives: an idle server polls for HiCache events. (Fails on a loop
    that only sleeps until the next request.)"""
    import time

    import requests

    from sglang.srt.testing.inprocess import InProcessServer

    prompt, _ = _prompts(0, 90)
    with InProcessServer(MODEL, "--enable-hierarchical-cache", "--hicache-write-policy", "write_through",
                         "--max-total-tokens", "256", "--page-size", "1", "--random-seed", "0") as srv:
        ctl = srv.scheduler.tree_cache.controller
        copy = ctl._copy_to_host

        def slow_copy(*args, **kwargs):  # every backup is still in flight when the step that queued it ends
            time.sleep(0.05)
            copy(*args, **kwargs)

        ctl._copy_to_host = slow_copy
        r = requests.post(srv.base_url + "/generate", json={"input_ids": prompt, "sampling_params": SP}, timeout=120)
        assert r.status_code == 200, r.text
        # no request follows: only the idle loop can acknowledge the copies the last steps queued
        st = srv.wait_state(lambda st: 0 < st["host_cached_tokens"] == st["kv_cached_tokens"], "backed up",
                            timeout=60)
        assert st["kv_leak"] is None, st
