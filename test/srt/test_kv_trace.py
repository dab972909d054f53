"""KV trace (SGLANG_CP_HICACHE_KV_TRACE) and its analyzer: off costs nothing, each level records
what it promises, identical runs hash identically, and corruption drills on a real NSA KV pool
and a real model forward are named by the analyzer (indexer K vs main KV, and the layer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from sglang.srt.debug import kv_trace
from sglang.srt.debug.hooks import installed_tracer
from sglang.srt.debug.kv_trace import KVTracer, get_kv_tracer
from sglang.srt.debug.kv_trace_analyze import analyze, format_report, main as analyze_main
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHONPATH = os.pathsep.join([os.path.join(REPO, "python"), os.path.join(REPO, "sgl-kernel")])


def _records(path, ev=None):
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [r for r in recs if ev is None or r["ev"] == ev]


def _env(monkeypatch, tmp_path, level, name="trace.jsonl"):
    path = str(tmp_path / name)
    monkeypatch.setenv(kv_trace.ENV_PATH, path)
    if level is None:
        monkeypatch.delenv(kv_trace.ENV_LEVEL, raising=False)
    else:
        monkeypatch.setenv(kv_trace.ENV_LEVEL, str(level))
    return path


# -- switch ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", [None, "0", ""])
def test_off_gives_no_tracer_and_no_file(monkeypatch, tmp_path, level):
    path = _env(monkeypatch, tmp_path, level)
    assert get_kv_tracer() is None and get_kv_tracer(min_level=3) is None
    assert not os.path.exists(path)


def test_bad_level_is_a_clear_error(monkeypatch, tmp_path):
    _env(monkeypatch, tmp_path, "7")
    with pytest.raises(ValueError, match="SGLANG_CP_HICACHE_KV_TRACE"):
        get_kv_tracer()
    _env(monkeypatch, tmp_path, "yes")
    with pytest.raises(ValueError, match="SGLANG_CP_HICACHE_KV_TRACE"):
        get_kv_tracer()


def test_min_level_and_one_tracer_per_config(monkeypatch, tmp_path):
    _env(monkeypatch, tmp_path, 2)
    t = get_kv_tracer()
    assert t is not None and t.level == 2 and get_kv_tracer() is t
    assert get_kv_tracer(min_level=3) is None  # the model asks for level 3: no forward hooks at 2


# -- levels ------------------------------------------------------------------------------------------
def _record_everything(tracer):
    kv = torch.randn(3, 4, 8)
    idx = torch.randint(0, 255, (3, 32), dtype=torch.uint8)
    fps = ["a", "b", "c"]
    tracer.record_pages("backup", fps, 0, "kv", kv)
    tracer.record_pages("index_backup", fps, 0, "index_k", idx)
    tracer.record_pages("reload", fps, 0, "kv", kv)
    tracer.record_pages("index_load", fps, 0, "index_k", idx)
    tracer.record_forward("attn_out", 0, "k0", torch.randn(2, 4))
    tracer.flush()


@pytest.mark.parametrize("level,events", [
    (1, {"backup", "reload"}),
    (2, {"backup", "reload", "index_backup", "index_load"}),
    (3, {"backup", "reload", "index_backup", "index_load", "fwd"}),
])
def test_each_level_records_what_it_promises(monkeypatch, tmp_path, level, events):
    path = _env(monkeypatch, tmp_path, level)
    tracer = get_kv_tracer()
    _record_everything(tracer)
    recs = _records(path)
    assert {r["ev"] for r in recs} - {"meta"} == events
    pages = [r for r in recs if r["ev"] in ("backup", "reload")]
    assert [r["fp"] for r in pages] == ["a", "b", "c"] * 2  # one record per page row
    assert all(r["nz"] > 0 for r in pages)
    assert analyze([path]).failed is False


def test_fingerprint_forms_and_bad_arguments(tmp_path):
    t = KVTracer(2, str(tmp_path / "t.jsonl"))
    t.record_pages("backup", "slot7", 1, "kv", torch.ones(1, 4))
    t.record_pages("backup", "run", 1, "kv", torch.ones(2, 4))
    t.close()
    assert [r["fp"] for r in _records(t.path, "backup")] == ["slot7", "run#0", "run#1"]
    with pytest.raises(ValueError, match="fingerprints"):
        KVTracer(2, str(tmp_path / "u.jsonl")).record_pages("backup", ["x"], 0, "kv", torch.ones(2, 4))
    with pytest.raises(ValueError, match="event"):
        KVTracer(2, str(tmp_path / "v.jsonl")).record_pages("save", ["x"], 0, "kv", torch.ones(1, 4))


def test_concurrent_writers_give_whole_lines(tmp_path):
    """The controller records from its own thread while the model records forwards."""
    t = KVTracer(3, str(tmp_path / "t.jsonl"))

    def work(i):
        for j in range(50):
            t.record_pages("backup", [f"{i}-{j}-{k}" for k in range(4)], j % 3, "kv", torch.randn(4, 16))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    t.close()
    recs = _records(t.path, "backup")
    assert len(recs) == 4 * 50 * 4 and len({r["seq"] for r in recs}) == len(recs)


# -- page corruption drills on a real NSA pool --------------------------------------------------------
LAYERS, PAGE = 4, 4


def _pool():
    pool = NSATokenToKVPool(64, PAGE, torch.float32, kv_lora_rank=16, qk_rope_head_dim=8, layer_num=LAYERS,
                            index_head_dim=128, index_k_dtype="fp8_e4m3")
    g = torch.Generator().manual_seed(0)
    for lid in range(LAYERS):
        pool.kv_buffer[lid].copy_(torch.randn(pool.kv_buffer[lid].shape, generator=g))
        pool.set_index_k(lid, torch.arange(PAGE, 64 + PAGE), torch.randn(64, 128, generator=g))
    return pool


def _round_trip(tracer, pool, corrupt=None, skip_index_load=False):
    """Back up pages 1..3 to a "host" copy, optionally corrupt it, load it into pages 5..7."""
    src, dst = torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7])
    fps = [f"host{p}" for p in range(3)]
    host = {}
    for lid in range(LAYERS):
        kv, idx = pool.get_kv_pages(lid, src), pool.get_index_k_pages(lid, src)
        tracer.record_pages("backup", fps, lid, "kv", kv)
        tracer.record_pages("index_backup", fps, lid, "index_k", idx)
        host[lid] = {"kv": kv.clone(), "index_k": idx.clone()}
    if corrupt is not None:
        payload, lid = corrupt
        flat = host[lid][payload].view(-1).view(torch.uint8) if payload == "kv" else host[lid][payload].view(-1)
        flat[7] ^= 0x5A  # flip bits of one byte of page 0
    for lid in range(LAYERS):
        pool.set_kv_pages(lid, dst, host[lid]["kv"])
        tracer.record_pages("reload", fps, lid, "kv", pool.get_kv_pages(lid, dst))
        if skip_index_load and lid == 2:
            continue
        pool.set_index_k_pages(lid, dst, host[lid]["index_k"])
        tracer.record_pages("index_load", fps, lid, "index_k", pool.get_index_k_pages(lid, dst))
    tracer.flush()


@pytest.mark.parametrize("corrupt,component", [(None, None), (("index_k", 2), "indexer K"), (("kv", 1), "main KV")])
def test_page_drill_names_the_payload_and_layer(tmp_path, corrupt, component):
    tracer = KVTracer(2, str(tmp_path / "pages.jsonl"))
    _round_trip(tracer, _pool(), corrupt)
    report = analyze([tracer.path])
    assert report.page_compared == 2 * LAYERS * 3
    if corrupt is None:
        assert not report.failed and "no divergence" in format_report(report)
        return
    bad = [f for f in report.findings if f.kind == "page_mismatch"]
    assert [(f.component, f.layer, f.detail["fp"]) for f in bad] == [(component, corrupt[1], "host0")]
    assert f"FIRST PAGE MISMATCH: {component} of layer {corrupt[1]}" in format_report(report)


def test_payload_entry_point_hashes_like_the_page_getters(tmp_path):
    """What the controller may call with `pool.page_payloads(layer)` matches get_*_pages hashes."""
    pool, pages, fps = _pool(), torch.tensor([2, 5]), ["s2", "s5"]
    tracer = KVTracer(2, str(tmp_path / "p.jsonl"))
    for lid in range(LAYERS):
        tracer.record_pages("backup", fps, lid, "kv", pool.get_kv_pages(lid, pages))
        tracer.record_pages("index_backup", fps, lid, "index_k", pool.get_index_k_pages(lid, pages))
        tracer.record_page_payloads("reload", fps, lid, pool.page_payloads(lid), pages)
    tracer.close()
    report = analyze([tracer.path])
    assert report.page_compared == 2 * LAYERS * 2 and not report.failed, format_report(report)


def test_index_k_never_loaded_is_reported(tmp_path):
    tracer = KVTracer(2, str(tmp_path / "pages.jsonl"))
    _round_trip(tracer, _pool(), skip_index_load=True)
    report = analyze([tracer.path])
    missing = [f for f in report.findings if f.kind == "index_not_reloaded"]
    assert report.failed and {f.layer for f in missing} == {2} and len(missing) == 3


# -- forward hashes through the real model ------------------------------------------------------------
@pytest.fixture(scope="module")
def traced_engine(tmp_path_factory):
    """The builtin tiny DeepSeek-V3.2 (4 layers, index_topk 32) built with level 3 on."""
    from sglang.srt.entrypoints.engine import Engine

    path = str(tmp_path_factory.mktemp("kvtrace") / "fwd.jsonl")
    saved = {k: os.environ.get(k) for k in (kv_trace.ENV_LEVEL, kv_trace.ENV_PATH)}
    os.environ[kv_trace.ENV_LEVEL], os.environ[kv_trace.ENV_PATH] = "3", path
    try:
        engine = Engine(model_path="builtin:tiny-deepseek-v32", dtype="float32", device="cpu",
                        max_total_tokens=4096, random_seed=0)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    tracer = installed_tracer(engine.scheduler.tp_worker.model_runner.model)
    assert tracer is not None and tracer.path == path
    return engine, tracer


def _only_runs(tracer, tmp_path, *runs):
    """The tracer's records of the given runs, as a trace file of their own."""
    tracer.flush()
    out = tmp_path / "runs.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in _records(tracer.path) if r["run"] in runs))
    return str(out)


def _prompt(n, seed=5):
    return torch.randint(5, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_model_hooks_absent_when_off(builtin_path, monkeypatch, tmp_path):
    from sglang.srt.entrypoints.engine import Engine

    for level in (None, 2):  # level 2 traces pages only: the model holds no tracer either
        _env(monkeypatch, tmp_path, level, name=f"off{level}.jsonl")
        model = Engine(model_path="builtin:tiny-deepseek-v32", dtype="float32", device="cpu",
                       max_total_tokens=1024, random_seed=0).scheduler.tp_worker.model_runner.model
        assert installed_tracer(model) is None
        # off costs nothing: no forward hook anywhere (the model holds no trace code of its own)
        assert not [n for n, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]
        if level is None:
            assert not os.path.exists(tmp_path / f"off{level}.jsonl")


def test_two_runs_hash_identically_and_decode_is_not_traced(traced_engine, tmp_path):
    engine, tracer = traced_engine
    prompt = _prompt(100)
    sp = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    outs = []
    for run in ("same-a", "same-b"):
        tracer.set_run(run)
        engine.flush_cache()
        outs.append(engine.generate(input_ids=prompt, sampling_params=sp)["output_ids"])
    assert outs[0] == outs[1]
    path = _only_runs(tracer, tmp_path, "same-a", "same-b")
    fwd = _records(path, "fwd")
    for run in ("same-a", "same-b"):
        mine = [r for r in fwd if r["run"] == run]
        assert {(r["layer"], r["stage"]) for r in mine} == {(l, s) for l in range(4) for s in kv_trace.FORWARD_STAGES}
        for layer in range(4):  # only the prompt's extend rows: decode steps record nothing
            assert sum(r["rows"] for r in mine if r["layer"] == layer and r["stage"] == "moe_in") == len(prompt)
    report = analyze([path])
    assert report.forward_compared == len(fwd) // 2 and not report.failed, format_report(report)


def _forward_extend(mr, slot, ids, prefix_len, locs):
    fb = ForwardBatch.build(ForwardMode.EXTEND, ids, [slot], [prefix_len], [len(ids)], locs, device=mr.device)
    mr.forward(fb)


@pytest.fixture
def cached_prefix(traced_engine):
    """A request slot whose first P tokens' KV sit in the pool (as after a HiCache reload), plus
    slots for the S suffix tokens; freed afterwards."""
    engine, tracer = traced_engine
    mr = engine.scheduler.tp_worker.model_runner
    P, S = 64, 36
    ids = _prompt(P + S, seed=11)
    slot = mr.req_to_token_pool.alloc(1)[0]
    locs = mr.token_to_kv_pool_allocator.alloc_extend([0], [P + S], [-1])
    mr.req_to_token_pool.write(slot, 0, locs)
    tracer.set_run("prefix-setup")
    _forward_extend(mr, slot, ids[:P], 0, locs[:P])
    yield mr, tracer, slot, ids, P, locs
    mr.token_to_kv_pool_allocator.free(locs)
    mr.req_to_token_pool.free([slot])


def test_cached_prefix_extend_matches_fresh_prefill(cached_prefix, tmp_path):
    """The reload-vs-fresh comparison the trace is for: a suffix extend over a cached prefix hashes
    like the same rows of a fresh full prefill (block keys align on absolute positions)."""
    mr, tracer, slot, ids, P, locs = cached_prefix
    tracer.set_run("fresh-full")
    _forward_extend(mr, slot, ids, 0, locs)
    tracer.set_run("suffix-extend")
    _forward_extend(mr, slot, ids[P:], P, locs[P:])
    report = analyze([_only_runs(tracer, tmp_path, "fresh-full", "suffix-extend")])
    # blocks [64, 80), [80, 96), [96, 100) x 4 layers x 4 stages
    assert report.forward_compared == 3 * 4 * 4 and not report.failed, format_report(report)


@pytest.mark.parametrize("what,layer,stage,diagnosis", [
    ("index_k", 2, "topk", "indexer K cache"),
    ("kv", 1, "attn_out", "main KV / page map"),
])
def test_forward_drill_names_the_first_diverging_layer(cached_prefix, tmp_path, what, layer, stage, diagnosis):
    mr, tracer, slot, ids, P, locs = cached_prefix
    pool = mr.token_to_kv_pool
    tracer.set_run(f"good-{what}")
    _forward_extend(mr, slot, ids[P:], P, locs[P:])
    g = torch.Generator().manual_seed(3)
    if what == "index_k":  # the cached prefix's index K of one layer goes bad
        pool.set_index_k(layer, locs[:P], 100 * torch.randn(P, pool.index_head_dim, generator=g))
    else:
        pool.kv_buffer[layer][locs[:P]] = torch.randn(pool.kv_buffer[layer][locs[:P]].shape, generator=g)
    tracer.set_run(f"bad-{what}")
    _forward_extend(mr, slot, ids[P:], P, locs[P:])
    path = _only_runs(tracer, tmp_path, f"good-{what}", f"bad-{what}")
    report = analyze([path])
    assert report.failed and report.first is not None
    assert (report.first["layer"], report.first["stage"], report.first["diagnosis"]) == (layer, stage, diagnosis)
    assert f"layer {layer} stage {stage}" in format_report(report) and diagnosis in format_report(report)

    # the CLI says the same and fails; --json carries it for scripts
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    env.pop(kv_trace.ENV_LEVEL, None)
    cli = [sys.executable, "-m", "sglang.srt.debug.kv_trace_analyze", path]
    res = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 1 and diagnosis in res.stdout, res.stdout + res.stderr
    res = subprocess.run(cli + ["--json"], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 1 and json.loads(res.stdout)["first"]["diagnosis"] == diagnosis


def _cp_trace(tmp_path, mode, page_size, block):
    """The same batch at cp = 2 (two gloo ranks, one trace file each) and at cp = 1 (here)."""
    from sglang.srt.model_loader.builtin import resolve_model_path
    from sglang.srt.testing.multi_rank import Case, run_case, run_multi_rank

    prompts = [_prompt(n, seed=n) for n in (37, 70, 130)]
    sa = dict(model_path=resolve_model_path("builtin:tiny-deepseek-v32"), page_size=page_size,
              chunked_prefill_size=-1)
    env = {kv_trace.ENV_LEVEL: "3", kv_trace.ENV_BLOCK: str(block), kv_trace.ENV_RUN: "cp2",
           kv_trace.ENV_PATH: str(tmp_path / "cp2.{pid}.jsonl")}
    cp2 = run_multi_rank([Case("cp2", {**sa, "enable_nsa_prefill_context_parallel": True,
                                       "nsa_prefill_cp_mode": mode}, prompts, 2, env=env)], 2)[0]
    saved = {k: os.environ.get(k) for k in env}
    try:
        cp1 = run_case(Case("cp1", sa, prompts, 2, env={**env, kv_trace.ENV_RUN: "cp1",
                                                         kv_trace.ENV_PATH: str(tmp_path / "cp1.jsonl")}), 1)
        get_kv_tracer().flush()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert {k: v["ids"] for k, v in cp1.items() if k != "_stats"} == \
           {k: v["ids"] for k, v in cp2.items() if k != "_stats"}
    ranks = sorted(str(p) for p in tmp_path.glob("cp2.*.jsonl"))
    assert len(ranks) == 2 and all(_records(r, "fwd") for r in ranks)  # each rank traced its own rows
    return [str(tmp_path / "cp1.jsonl"), *ranks]


@pytest.mark.parametrize("mode,page_size,block", [("in-seq-split", 64, 16), ("round-robin-split", 1, 1)])
def test_cp_ranks_trace_their_valid_rows_and_match_cp1(tmp_path, mode, page_size, block):
    """On CPU a row rounds the same whichever rank computes it, so the ranks' records together
    hash like the cp = 1 run on every key they share; dummy (padding) rows are not traced."""
    paths = _cp_trace(tmp_path, mode, page_size, block)
    report = analyze(paths)
    assert report.forward_compared > 0 and not report.failed, format_report(report)
    if block == 1:  # one key per token: every traced row of cp = 2 is compared
        cp2_rows = sum(1 for p in paths[1:] for r in _records(p, "fwd"))
        assert report.forward_compared == cp2_rows == len(_records(paths[0], "fwd"))


# -- degenerate tensors and the CLI ------------------------------------------------------------------
@pytest.mark.parametrize("tensor,flag", [
    (torch.zeros(4, 8), "all_zero"),
    (torch.cat([torch.randn(3, 8), torch.zeros(1, 8)]), "zero_rows"),
    (torch.full((4, 8), float("nan")), "nonfinite"),
    (torch.full((4, 8), 0.5), "constant"),
    (torch.tensor([[0, 1], [-1, -1]], dtype=torch.int32), "empty_selection"),
])
def test_degenerate_hidden_state_is_flagged(tmp_path, tensor, flag):
    t = KVTracer(3, str(tmp_path / "t.jsonl"))
    t.record_forward("topk" if flag == "empty_selection" else "moe_in", 1, "k", tensor)
    t.record_forward("attn_in", 1, "k", torch.randn(4, 8))  # a healthy one is not flagged
    t.close()
    report = analyze([t.path])
    bad = [f for f in report.findings if f.kind == "degenerate"]
    assert report.failed and len(bad) == 1 and bad[0].detail["flags"] == [flag] and bad[0].layer == 1
    assert "DEGENERATE" in format_report(report)


def test_cli_exit_codes(tmp_path, capsys):
    clean = KVTracer(2, str(tmp_path / "clean.jsonl"))
    _round_trip(clean, _pool())
    clean.close()
    bad = KVTracer(2, str(tmp_path / "bad.jsonl"))
    _round_trip(bad, _pool(), corrupt=("index_k", 3))
    bad.close()
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    run = lambda *a: subprocess.run([sys.executable, "-m", "sglang.srt.debug.kv_trace_analyze", *a],  # noqa: E731
                                    capture_output=True, text=True, env=env, timeout=120)
    ok, fail = run(clean.path), run(bad.path)
    assert ok.returncode == 0 and "no divergence" in ok.stdout, ok.stderr
    assert fail.returncode == 1 and "indexer K of layer 3" in fail.stdout, fail.stderr
    assert run(str(tmp_path / "missing.jsonl")).returncode == 2
    lonely = KVTracer(3, str(tmp_path / "lonely.jsonl"))  # one run, no reloads: nothing to compare
    lonely.record_forward("attn_in", 0, "k", torch.randn(2, 4))
    lonely.close()
    res = run(lonely.path)
    assert res.returncode == 3 and "nothing compared" in res.stdout
    (tmp_path / "junk.jsonl").write_text("not json\n")
    assert analyze_main([str(tmp_path / "junk.jsonl")]) == 2
