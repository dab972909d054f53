"""HiCache L3 tier end to end: pages backed up to host are also written to the storage backend; a
NEW engine (a restart of the host tier) on the same store restores the prefix from L3 into host
pages, loads it back layer by layer and decodes exactly as a fresh prefill -- greedy tokens and
every layer's top-k (which reads the restored index K)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from test_hicache import SP, TopkCapture, _assert_clean, _check_topk, _engine, _fresh, _prompts


def _storage_args(path, backend: str = "file", **extra) -> dict:
    cfg = {"file_path": str(path)} if backend == "file" else {}
    cfg.update(extra)
    return dict(enable_hierarchical_cache=True, hicache_storage_backend=backend,
                hicache_storage_backend_extra_config=json.dumps(cfg))


def _drain(eng) -> None:
    """Every backup and L3 write queued so far is done and readable by another instance."""
    tc = eng.scheduler.tree_cache
    tc.controller.wait_idle()
    tc.check_events()
    tc.controller.wait_idle()  # the L3 writes queued by the acks just processed
    tc.check_events()
    tc.controller.storage.flush()


def _restart_run(prompt: list[int], args: dict, fillers=(), **kw) -> tuple[list[int], dict, dict, object]:
    """Engine 1 prefills `prompt` (then `fillers`; backed up to host and L3); engine 2, fresh, on
    the same store, re-sends it. Returns (tokens, per-layer top-k, meta_info) of engine 2's run,
    and engine 2."""
    first = _engine(**args, **kw)
    for p in [prompt, *fillers]:
        first.generate(input_ids=p, sampling_params=SP)
    _drain(first)
    assert first.scheduler.tree_cache.controller.storage.stats["stored_pages"] > 0
    # first stays alive: a Mooncake client's segment holds what it put (file pages are on disk)
    eng = _engine(**args, **kw)
    tc = eng.scheduler.tree_cache
    assert tc.match_prefix(prompt).host_hit_length == 0  # a new host tier: nothing but L3
    host_free0, dev_free0 = tc.host_allocator.available_size(), eng.scheduler.allocator.available_size()
    cap = TopkCapture(eng)
    res = eng.generate(input_ids=prompt, sampling_params=SP)
    topk = {lid: torch.cat(rows) for lid, rows in cap.rows.items()}
    cap.close()
    first.scheduler.tree_cache.controller.storage.close()  # read: its clients may go
    _assert_clean(eng)
    assert tc.host_leak_report() is None
    eng.scheduler.flush_cache()  # accounting whole: every device and host page comes back
    assert eng.scheduler.allocator.available_size() == dev_free0
    assert tc.host_allocator.available_size() == host_free0
    return res["output_ids"], topk, res["meta_info"], eng


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_l3_restart_equals_fresh_prefill(tmp_path, policy):
    """write_through: L3 written behind the async (layer-end) host backup; write_back: behind the
    backup made at device eviction (forced here by filler prompts)."""
    prompt, fillers = _prompts(3 if policy == "write_back" else 0, 120, seed=11)
    want, fresh_topk = _fresh(prompt)
    args = dict(_storage_args(tmp_path), hicache_write_policy=policy)
    got, topk, meta, eng = _restart_run(prompt, args, fillers)
    assert got == want
    assert meta["cached_tokens"] >= 100
    assert eng.scheduler.tree_cache.stats["storage_loaded_tokens"] >= 100
    _check_topk(fresh_topk, topk, 4)
    # nothing written again: engine 1 stored the same prompt + greedy output (content-addressed)
    assert eng.scheduler.tree_cache.controller.storage.stats["stored_pages"] == 0


def test_l3_restart_page64_indexcache_freq4(tmp_path):
    kw = dict(page_size=64, max_total_tokens=512, nsa_index_topk_freq=4, chunked_prefill_size=64)
    prompt, _ = _prompts(0, 200, seed=12)
    want, fresh_topk = _fresh(prompt, **kw)
    got, topk, meta, eng = _restart_run(prompt, _storage_args(tmp_path), **kw)
    assert got == want and meta["cached_tokens"] == 192
    assert eng.scheduler.tree_cache.stats["storage_loaded_tokens"] == 192
    _check_topk(fresh_topk, topk, 4)


def test_l3_grown_conversation_hits_its_stored_prefix(tmp_path):
    """A later turn (the prompt grown by new tokens) after a restart restores the stored part."""
    prompt, (turn,) = _prompts(1, 64, seed=13)
    args = _storage_args(tmp_path, "file", prefetch_timeout_base=30.0)
    first = _engine(**args, hicache_storage_prefetch_policy="timeout")
    first.generate(input_ids=prompt, sampling_params=SP)
    _drain(first)
    grown = prompt + turn
    want, _ = _fresh(grown)
    eng = _engine(**args, hicache_storage_prefetch_policy="timeout")
    res = eng.generate(input_ids=grown, sampling_params=SP)
    assert res["output_ids"] == want and res["meta_info"]["cached_tokens"] == 64
    _drain(eng)  # the new turn's pages are written; the restored 64 are not written again
    assert eng.scheduler.tree_cache.controller.storage.stats["stored_pages"] == len(grown) + SP["max_new_tokens"] - 1 - 64
    _assert_clean(eng)


def test_l3_layout_mismatch_disables_the_tier_once(tmp_path, monkeypatch):
    """A page of another layout in this server's own namespace (a writer that did not key its pages by
    the fingerprint) is refused: the tier turns off with one error, output stays right."""
    import sglang.srt.mem_cache.storage.tier as tier_mod

    errors = []
    monkeypatch.setattr(tier_mod.logger, "error", lambda *a: errors.append(a[0] % a[1:]))
    prompt, _ = _prompts(0, 120, seed=14)
    first = _engine(**_storage_args(tmp_path))
    first.generate(input_ids=prompt, sampling_params=SP)
    _drain(first)
    ns = first.scheduler.tree_cache.controller.storage.backends[0].namespace
    want, _ = _fresh(prompt, nsa_index_topk_freq=4)
    # another IndexCache schedule forced into the first server's namespace (and fingerprint)
    real_ns, real_fp = tier_mod.storage_namespace, tier_mod.pool_fingerprint
    monkeypatch.setattr(tier_mod, "storage_namespace", lambda *parts: ns)
    monkeypatch.setattr(tier_mod, "pool_fingerprint", lambda *a, **k: ns.split("-kv")[1][:16])
    eng = _engine(**_storage_args(tmp_path), nsa_index_topk_freq=4)
    monkeypatch.setattr(tier_mod, "storage_namespace", real_ns)
    monkeypatch.setattr(tier_mod, "pool_fingerprint", real_fp)
    for _ in range(2):
        assert eng.generate(input_ids=prompt, sampling_params=SP)["output_ids"] == want
    tier = eng.scheduler.tree_cache.controller.storage
    assert not tier.enabled and "another KV layout" in tier.error
    assert len(errors) == 1 and "storage tier disabled" in errors[0]
    _assert_clean(eng)


@pytest.mark.parametrize("second", [
    dict(json_model_override_args=json.dumps({"routed_scaling_factor": 9.0})),  # same path, other config
    dict(model_path="builtin:tiny-glm-moe-dsa", served_model_name="builtin:tiny-deepseek-v32"),  # other weights
    dict(nsa_index_topk_freq=4),  # another IndexCache schedule (another layout)
    dict(dtype="bfloat16"),
], ids=["override", "other-model-same-name", "indexcache", "dtype"])
def test_l3_never_serves_another_models_kv(tmp_path, monkeypatch, second):
    """Issue 33 item 2: a server whose KV differs (config override, other weights under the served name
    of the first, IndexCache schedule, dtype) on the first's store must answer its own cold output:
    it keys its pages by its KV fingerprint, so it sees none of the first's, and says so in a warning."""
    import sglang.srt.mem_cache.storage.tier as tier_mod

    warnings = []
    monkeypatch.setattr(tier_mod.logger, "warning", lambda *a: warnings.append(a[0] % a[1:]))
    kw = dict(page_size=64, max_total_tokens=512, chunked_prefill_size=64)
    prompt, _ = _prompts(0, 200, seed=21)
    first = _engine(**_storage_args(tmp_path), served_model_name="builtin:tiny-deepseek-v32", **kw)
    first.generate(input_ids=prompt, sampling_params=SP)
    _drain(first)
    assert first.scheduler.tree_cache.controller.storage.stats["stored_pages"] >= 3
    assert not warnings
    want = _engine(disable_radix_cache=True, **{**kw, **second}).generate(input_ids=prompt, sampling_params=SP)
    eng = _engine(**_storage_args(tmp_path), **{"served_model_name": "builtin:tiny-deepseek-v32", **kw, **second})
    res = eng.generate(input_ids=prompt, sampling_params=SP)
    assert res["output_ids"] == want["output_ids"]
    assert res["meta_info"]["cached_tokens"] == 0
    tc = eng.scheduler.tree_cache
    assert tc.stats["storage_loaded_tokens"] == 0 and tc.controller.storage.enabled
    assert any("other fingerprint" in w for w in warnings), warnings
    # the same server again (a restart) does hit its own pages
    _drain(eng)
    again = _engine(**_storage_args(tmp_path), **{"served_model_name": "builtin:tiny-deepseek-v32", **kw, **second})
    res = again.generate(input_ids=prompt, sampling_params=SP)
    assert res["output_ids"] == want["output_ids"] and res["meta_info"]["cached_tokens"] == 192


def test_kv_fingerprint_inputs(tmp_path):
    """What the fingerprint sees: a rewritten weight file, a config value, the layout, the TP size."""
    import os

    from sglang.srt.mem_cache.storage.fingerprint import kv_fingerprint, weights_identity

    (tmp_path / "model-00001.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "config.json").write_text("{}")
    w0 = weights_identity(str(tmp_path))
    assert [r[0] for r in w0] == ["model-00001.safetensors"]  # the config is not a weight file
    os.utime(tmp_path / "model-00001.safetensors", ns=(1, 2))
    assert weights_identity(str(tmp_path)) != w0  # rewritten in place
    assert weights_identity(str(tmp_path), "dummy") == "dummy"
    base = kv_fingerprint(w0, {"a": 1}, {"page_size": 64}, tp_size=1)
    assert base == kv_fingerprint(w0, {"a": 1}, {"page_size": 64}, tp_size=1)
    assert len({base, kv_fingerprint(w0, {"a": 2}, {"page_size": 64}, tp_size=1),
                kv_fingerprint(w0, {"a": 1}, {"page_size": 1}, tp_size=1),
                kv_fingerprint(w0, {"a": 1}, {"page_size": 64}, tp_size=2)}) == 4


def test_page_of_another_fingerprint_is_refused(tmp_path):
    """Every blob carries its writer's fingerprint: a reader of another one refuses it loudly."""
    from sglang.srt.mem_cache.storage import StorageLayoutError
    from sglang.srt.mem_cache.storage.file_storage import HiCacheFile
    from sglang.srt.mem_cache.storage.hicache_storage import PageData, page_hashes

    eng = _engine()
    layout = eng.scheduler.tp_worker.model_runner.token_to_kv_pool.layout()
    page = PageData(kv=[torch.zeros(layout.kv_bytes_per_page, dtype=torch.uint8)] * layout.layer_num,
                    index_k=[torch.zeros(layout.index_k_bytes_per_page, dtype=torch.uint8)]
                    * len(layout.index_layer_ids))
    key = page_hashes(list(range(layout.page_size)), layout.page_size)[0]
    a = HiCacheFile(layout, {"file_path": str(tmp_path)}, namespace="ns", fingerprint="a" * 64)
    a.batch_set([key], [page])
    a.close()
    b = HiCacheFile(layout, {"file_path": str(tmp_path)}, namespace="ns", fingerprint="b" * 64)
    with pytest.raises(StorageLayoutError, match="kv_fingerprint"):
        b.batch_get([key])
    b.close()


def test_l3_corrupt_page_is_a_miss(tmp_path):
    prompt, _ = _prompts(0, 64, seed=15)
    kw = dict(page_size=16)
    first = _engine(**_storage_args(tmp_path), **kw)
    first.generate(input_ids=prompt, sampling_params=SP)
    _drain(first)
    tier = first.scheduler.tree_cache.controller.storage
    from sglang.srt.mem_cache.storage import page_hashes

    path = tier.backends[0].path(page_hashes(prompt, 16)[2])  # the third page: pages 0-1 still hit
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 5)
        f.write(b"\xff\xfe\xfd\xfc\xfb")
    want, _ = _fresh(prompt, **kw)
    eng = _engine(**_storage_args(tmp_path), **kw)
    res = eng.generate(input_ids=prompt, sampling_params=SP)
    assert res["output_ids"] == want and res["meta_info"]["cached_tokens"] == 32
    assert eng.scheduler.tree_cache.controller.storage.backends[0].stats["invalid"] == 1
    _assert_clean(eng)


def test_l3_eagle_draft_pages_restored(tmp_path):
    """The draft pool's pages go to L3 too (its own namespace): after a restart the restored draft
    KV proposes exactly the drafts of a fresh prefill, so acceptance is the same; forced drafts
    (always right) give full acceptance both ways."""
    from sglang.srt.testing.spec_drafts import forced_drafts

    kw = dict(model_path="builtin:tiny-deepseek-v32-mtp", speculative_algorithm="EAGLE", speculative_num_steps=2)
    prompt, _ = _prompts(0, 120, seed=16)
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}

    def run(eng, forced=None):
        drafts = []
        worker = eng.scheduler.tp_worker
        worker.draft_override = forced or (lambda reqs, d, lens: (drafts.append(d.tolist()), d)[1])
        out = eng.generate(input_ids=prompt, sampling_params=sp)
        worker.draft_override = None
        return out["output_ids"], drafts, out["meta_info"]["spec_accept_length"], out["meta_info"]["cached_tokens"]

    fresh = _engine(disable_radix_cache=True, **kw)
    want = run(fresh)
    forced = forced_drafts({tuple(prompt): want[0]}, "right")
    want_forced = run(fresh, forced)
    first = _engine(**_storage_args(tmp_path), **kw)
    run(first)
    _drain(first)
    tier = first.scheduler.tree_cache.controller.storage
    assert len(tier.backends) == 2 and tier.backends[0].namespace != tier.backends[1].namespace
    eng = _engine(**_storage_args(tmp_path), **kw)
    got = run(eng)
    assert got[:3] == want[:3] and got[3] >= 100  # same tokens, drafts, acceptance; from L3
    assert eng.scheduler.tree_cache.stats["storage_loaded_tokens"] >= 100
    eng2 = _engine(**_storage_args(tmp_path), **kw)
    got_forced = run(eng2, forced)
    assert got_forced[0] == want_forced[0] and got_forced[2] == want_forced[2] and got_forced[3] >= 100
    _assert_clean(eng)


def test_l3_mooncake_restart_round_trip(mooncake_master):
    prompt, _ = _prompts(0, 64, seed=17)
    kw = dict(page_size=16)
    cfg = dict(mooncake_master)
    want, fresh_topk = _fresh(prompt, **kw)
    args = dict(enable_hierarchical_cache=True, hicache_storage_backend="mooncake",
                hicache_storage_backend_extra_config=json.dumps(cfg), served_model_name="l3-mooncake-test")
    got, topk, meta, eng = _restart_run(prompt, args, **kw)
    assert got == want and meta["cached_tokens"] == 48
    assert eng.scheduler.tree_cache.stats["storage_loaded_tokens"] == 48
    _check_topk(fresh_topk, topk, 4)
    eng.scheduler.tree_cache.controller.storage.close()  # before the fixture stops the master


from test_hicache_storage import mooncake_master  # noqa: E402,F401  (the fixture: a real mooncake_master)


def test_prefetch_timeout_keys_are_checked():
    from sglang.srt.mem_cache.storage import StorageConfigError, validate_storage_args

    extra = validate_storage_args("file", '{"prefetch_timeout_base": 2, "prefetch_timeout_per_ki_token": 0.5}',
                                  "timeout", True)
    assert extra["prefetch_timeout_base"] == 2
    with pytest.raises(StorageConfigError, match="prefetch_timeout_base must be a number"):
        validate_storage_args("file", '{"prefetch_timeout_base": -1}', "timeout", True)
