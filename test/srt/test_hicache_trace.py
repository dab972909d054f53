"""KV trace THROUGH HiCache (issue 20's corruption drill): the controller records page hashes at
backup and at reload; bytes flipped in one layer's host copy between the two are named by the
analyzer (indexer K or main KV, and the layer), and the top-k that reads them changes. Level 3: a
reload run and a fresh run of the same prompt have identical forward hashes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from test_hicache import SP, TopkCapture, _assert_clean, _engine, _fresh, _prompts, _wait_idle

from sglang.srt.debug.kv_trace import get_kv_tracer


@pytest.fixture
def trace_env(tmp_path, monkeypatch):
    def setup(level: int, block: int = 16):
        path = tmp_path / f"trace-l{level}.jsonl"
        monkeypatch.setenv("SGLANG_CP_HICACHE_KV_TRACE", str(level))
        monkeypatch.setenv("SGLANG_KV_TRACE_PATH", str(path))
        monkeypatch.setenv("SGLANG_KV_TRACE_BLOCK", str(block))
        return path
    return setup


def _analyze(path, *args) -> tuple[int, dict]:
    get_kv_tracer().flush()
    out = subprocess.run([sys.executable, "-m", "sglang.srt.debug.kv_trace_analyze", str(path), "--json", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 1, 3), out.stderr
    return out.returncode, json.loads(out.stdout)


def _prompt_host_pages(eng, prompt: list[int]) -> torch.Tensor:
    """Host pages of the prompt's host-only part (after eviction)."""
    tc = eng.scheduler.tree_cache
    match = tc.match_prefix(prompt)
    assert match.host_hit_length >= 100, "the prompt's KV should have moved to the host"
    nodes, x = [], match.last_host_node
    while x is not match.last_node:
        nodes.append(x)
        x = x.parent
    slots = torch.cat([n.host_value for n in reversed(nodes)])
    return torch.unique(slots // tc.page_size)


def _flip_sign_bits(buf: torch.Tensor, pages: torch.Tensor) -> None:
    """XOR the top bit of every 4th byte (the sign of each little-endian float32 value)."""
    b = buf.view(torch.uint8)
    rows = b[pages]
    rows[:, 3::4] ^= 0x80
    b[pages] = rows


@pytest.mark.parametrize("payload,layer", [("index_k", 1), ("kv", 2)])
def test_corrupted_host_copy_is_named_by_the_analyzer(trace_env, payload, layer):
    path = trace_env(2)
    prompt, fillers = _prompts(3, 120, seed=21)
    want, fresh_topk = _fresh(prompt)
    eng = _engine(enable_hierarchical_cache=True)
    assert eng.scheduler.tree_cache.controller.trace is not None
    eng.generate(input_ids=prompt, sampling_params=SP)
    for f in fillers:
        eng.generate(input_ids=f, sampling_params=SP)
    _wait_idle(eng)
    host = eng.scheduler.tree_cache.controller.pairs[0][1]
    _flip_sign_bits(host.payload(layer, payload), _prompt_host_pages(eng, prompt))
    cap = TopkCapture(eng)
    eng.generate(input_ids=prompt, sampling_params=SP)
    topk = {lid: torch.cat(rows) for lid, rows in cap.rows.items()}
    cap.close()
    _assert_clean(eng)
    rc, report = _analyze(path)
    assert rc == 1 and report["page_compared"] > 0
    named = {(f["component"], f["layer"]) for f in report["findings"] if f["kind"] == "page_mismatch"}
    assert named == {("indexer K" if payload == "index_k" else "main KV", layer)}
    for lid in range(layer):  # layers before the corrupted one select as a fresh prefill does
        assert torch.equal(topk[lid], fresh_topk[lid][-topk[lid].shape[0]:])
    if payload == "index_k":  # the corrupted layer's selection reads the flipped index K
        assert not torch.equal(topk[layer], fresh_topk[layer][-topk[layer].shape[0]:])


def test_level1_records_main_kv_only(trace_env):
    path = trace_env(1)
    prompt, fillers = _prompts(3, 120, seed=22)
    eng = _engine(enable_hierarchical_cache=True)
    for p in [prompt, *fillers, prompt]:
        eng.generate(input_ids=p, sampling_params=SP)
    _wait_idle(eng)
    rc, report = _analyze(path)
    assert rc == 0 and report["page_compared"] > 0 and not report["findings"]
    get_kv_tracer().flush()
    events = {json.loads(line)["ev"] for line in open(path)}
    assert events == {"meta", "backup", "reload"}


def test_trace_off_means_no_trace_object(monkeypatch):
    monkeypatch.delenv("SGLANG_CP_HICACHE_KV_TRACE", raising=False)
    eng = _engine(enable_hierarchical_cache=True)
    assert eng.scheduler.tree_cache.controller.trace is None


def test_level3_reload_run_equals_fresh_run(trace_env):
    """Forward hashes (attention input, top-k, attention output, MoE input) of the rows a reload
    computes equal a fresh prefill's rows at the same positions: one key per token (block 1)."""
    path = trace_env(3, block=1)
    prompt, fillers = _prompts(3, 120, seed=23)
    tracer = get_kv_tracer()
    tracer.set_run("fresh")
    want, _ = _fresh(prompt)
    eng = _engine(enable_hierarchical_cache=True)
    tracer.set_run("warmup")
    for p in [prompt, *fillers]:
        eng.generate(input_ids=p, sampling_params=SP)
    _wait_idle(eng)
    assert eng.scheduler.tree_cache.match_prefix(prompt).host_hit_length >= 100
    tracer.set_run("reload")
    assert eng.generate(input_ids=prompt, sampling_params=SP)["output_ids"] == want
    _assert_clean(eng)
    rc, report = _analyze(path, "--reference", "fresh")
    assert report["page_compared"] > 0 and report["forward_compared"] > 0
    assert "reload" in report["runs"]
    assert rc == 0 and report["first"] is None and not report["findings"], report["findings"][:5]
