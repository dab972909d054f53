"""HiCache L3 storage (issue 20): page keys, the page blob's integrity rules, the file backend and
Mooncake Store (a real mooncake_master started here, two clients over TCP)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time

import pytest
import torch

from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, NSATokenToKVPool
from sglang.srt.mem_cache.storage import (
    PageCodec,
    PageData,
    StorageConfigError,
    StorageLayoutError,
    create_storage_backend,
    get_hash_str,
    page_hashes,
    read_pool_pages,
    validate_storage_args,
    write_pool_pages,
)
from sglang.srt.mem_cache.storage.file_storage import FILE_DIR_ENV, HiCacheFile

PAGE = 4
LAYERS = 5


def _pool(index_layer_ids=None, seed=0, dtype=torch.bfloat16, index_k_dtype="fp8_e4m3", layers=LAYERS, fill=True):
    pool = NSATokenToKVPool(16 * PAGE, PAGE, dtype, 32, 8, layers, 64, index_k_dtype, index_layer_ids)
    if fill:
        g = torch.Generator().manual_seed(seed)
        for buf in pool.kv_buffer:
            buf.copy_(torch.randn(buf.shape, generator=g).to(dtype))
        for buf in pool.index_k_with_scale_buffer:
            buf.copy_(torch.randint(0, 256, buf.shape, generator=g, dtype=torch.uint8))
    return pool


def _page_bytes(pool, page: int) -> list[bytes]:
    """Every payload of one page, every layer, as bytes (what must round-trip)."""
    out = []
    for layer in range(pool.layer_num):
        for p in pool.page_payloads(layer):
            out.append(bytes(p.buffer[page].contiguous().view(torch.uint8).numpy()))
    return out


def _keys(n, seed=0):
    return page_hashes(list(range(seed, seed + n * PAGE)), PAGE)


# -- keys ------------------------------------------------------------------------------------------
def test_page_keys_chain_over_the_whole_prefix():
    tokens = list(range(100, 100 + 5 * PAGE + 2))
    keys = page_hashes(tokens, PAGE)
    assert len(keys) == 5  # the partial trailing page has no key
    assert keys == page_hashes(list(tokens), PAGE)  # same prefix, same keys
    assert page_hashes(tokens[: 3 * PAGE], PAGE) == keys[:3]  # a prefix's keys are a prefix of the keys
    assert page_hashes(tokens[2 * PAGE :], PAGE, prior_hash=keys[1]) == keys[2:]  # resumable from a page
    changed = list(tokens)
    changed[PAGE + 1] += 1  # a token of page 1
    other = page_hashes(changed, PAGE)
    assert other[0] == keys[0] and all(a != b for a, b in zip(other[1:], keys[1:]))
    assert len(set(keys)) == len(keys)
    # upstream's function: sha256(prior hash bytes, then u32 LE tokens)
    import hashlib
    import struct

    assert keys[0] == hashlib.sha256(struct.pack("<4I", *tokens[:4])).hexdigest()
    assert keys[1] == get_hash_str(tokens[4:8], keys[0])


# -- round trips -----------------------------------------------------------------------------------
@pytest.fixture
def file_store(tmp_path):
    stores = []

    def make(layout, **extra):
        s = create_storage_backend("file", layout, {"file_path": str(tmp_path / "l3"), **extra})
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()


def _round_trip(store_a, store_b, src, pages=(3, 7, 1, 12)):
    keys = _keys(len(pages))
    assert store_a.batch_set(keys, read_pool_pages(src, list(pages))) == [True] * len(pages)
    store_a.flush()
    dst = _pool(src.index_layer_ids, seed=99, dtype=src.dtype, index_k_dtype=src.index_k_dtype, fill=False)
    got = store_b.batch_get(keys)
    assert all(g is not None for g in got)
    dst_pages = [5, 2, 9, 15]
    write_pool_pages(dst, dst_pages, got)
    for s, d in zip(pages, dst_pages):
        assert _page_bytes(src, s) == _page_bytes(dst, d)
    assert _page_bytes(dst, 0) == _page_bytes(_pool(src.index_layer_ids, fill=False, dtype=src.dtype,
                                                    index_k_dtype=src.index_k_dtype), 0)  # nothing else written


@pytest.mark.parametrize("index_layer_ids", [None, [0, 3]], ids=["all-layers", "indexcache-subset"])
@pytest.mark.parametrize("index_k_dtype", ["fp8_e4m3", "bfloat16"])
def test_file_round_trip_of_real_pool_pages(file_store, index_layer_ids, index_k_dtype):
    src = _pool(index_layer_ids, index_k_dtype=index_k_dtype)
    a = file_store(src.layout())
    b = file_store(src.layout())  # a second instance on the same directory reads what a wrote
    _round_trip(a, b, src)


def test_mla_pool_without_index_k_round_trips(file_store):
    src = MLATokenToKVPool(8 * PAGE, PAGE, torch.float32, 16, 8, 3)
    for buf in src.kv_buffer:
        buf.copy_(torch.randn(buf.shape))
    s = file_store(src.layout())
    s.batch_set(_keys(2), read_pool_pages(src, [1, 2]))
    s.flush()
    dst = MLATokenToKVPool(8 * PAGE, PAGE, torch.float32, 16, 8, 3)
    write_pool_pages(dst, [4, 5], s.batch_get(_keys(2)))
    assert all(torch.equal(a[PAGE : 3 * PAGE], b[4 * PAGE : 6 * PAGE]) for a, b in zip(src.kv_buffer, dst.kv_buffer))


def test_restart_reads_old_pages(tmp_path):
    src = _pool([1, 4])
    cfg = {"file_path": str(tmp_path)}
    s = HiCacheFile(src.layout(), cfg)
    s.batch_set(_keys(3), read_pool_pages(src, [1, 2, 3]))
    s.close()  # the "server" stops; its writer drains first
    s2 = HiCacheFile(_pool([1, 4], fill=False).layout(), cfg)
    assert s2.batch_exists(_keys(3)) == 3
    got = s2.batch_get(_keys(3))
    assert [bytes(p.kv[2].numpy()) for p in got] == [bytes(p.kv[2].numpy()) for p in read_pool_pages(src, [1, 2, 3])]
    s2.close()


def test_directory_from_env_as_upstream(tmp_path, monkeypatch):
    monkeypatch.setenv(FILE_DIR_ENV, str(tmp_path / "env_dir"))
    s = create_storage_backend("file", _pool().layout(), None, namespace="model-a")
    try:
        assert s.dir == str(tmp_path / "env_dir" / "model-a")
    finally:
        s.close()


# -- async writes ----------------------------------------------------------------------------------
def test_async_writes_visible_before_and_after_flush(tmp_path):
    src = _pool()
    s = HiCacheFile(src.layout(), {"file_path": str(tmp_path), "write_queue_size": 2})
    gate = __import__("threading").Event()
    real = s._write_file
    s._write_file = lambda k, b: (gate.wait(10), real(k, b))  # hold the writer: pages stay pending
    keys = _keys(4)
    s.batch_set(keys[:2], read_pool_pages(src, [1, 2]))
    assert s.num_pages() == 0  # nothing on disk yet: the write is asynchronous
    assert s.batch_exists(keys) == 2  # but pending pages are already readable
    assert s.batch_get(keys[:1])[0] is not None
    gate.set()
    s.batch_set(keys[2:], read_pool_pages(src, [3, 4]))
    s.flush()
    assert s.num_pages() == 4 and not s._pending
    fresh = HiCacheFile(src.layout(), {"file_path": str(tmp_path)})
    assert fresh.batch_exists(keys) == 4
    fresh.close()
    s.close()


def test_batch_exists_counts_leading_keys(file_store):
    src = _pool()
    s = file_store(src.layout())
    keys = _keys(5)
    s.batch_set([keys[0], keys[1], keys[3]], read_pool_pages(src, [1, 2, 4]))
    s.flush()
    assert s.batch_exists(keys) == 2  # keys[2] is missing: keys[3] does not count
    assert s.batch_exists(keys[3:]) == 1
    assert s.batch_exists([]) == 0
    got = s.batch_get(keys)
    assert [g is not None for g in got] == [True, True, False, True, False]
    s.clear()
    assert s.batch_exists(keys) == 0 and s.num_pages() == 0


# -- integrity -------------------------------------------------------------------------------------
def test_layout_mismatch_is_refused_with_a_clear_error(file_store):
    src = _pool([0, 3])
    s = file_store(src.layout())
    keys = _keys(1)
    s.batch_set(keys, read_pool_pages(src, [2]))
    s.flush()
    for other in (_pool([0, 2]).layout(), _pool([0, 3], dtype=torch.float32).layout(),
                  _pool([0, 3], layers=6).layout()):
        reader = file_store(other)
        with pytest.raises(StorageLayoutError, match="another KV layout"):
            reader.batch_get(keys)
    with pytest.raises(StorageLayoutError):  # pool pages never go into a pool of another layout either
        from sglang.srt.mem_cache.storage import hicache_storage

        hicache_storage.check_same_layout(src.layout(), _pool([1, 3]).layout())


def test_short_index_k_sidecar_is_a_miss(file_store, caplog):
    src = _pool([0, 3])
    s = file_store(src.layout())
    keys = _keys(2)
    good, bad = read_pool_pages(src, [1, 2])
    bad = PageData(kv=bad.kv, index_k=[bad.index_k[0], bad.index_k[1][:-5]])  # a writer that lost index-K bytes
    with pytest.raises(ValueError, match="payload lengths"):
        s.batch_set(keys[1:], [bad])  # our writer refuses to write one
    forged = s.codec.encode(keys[1], bad, strict=False)
    s.batch_set(keys[:1], [good])
    s.flush()
    os.makedirs(os.path.dirname(s.path(keys[1])), exist_ok=True)
    with open(s.path(keys[1]), "wb") as f:
        f.write(forged)
    missing = PageData(kv=good.kv, index_k=[good.index_k[0], good.index_k[1][:0]])  # sidecar absent
    assert s.codec.decode(keys[0], s.codec.encode(keys[0], missing, strict=False)) is None
    caplog.set_level("WARNING")
    got = s.batch_get(keys)
    assert got[0] is not None and got[1] is None
    assert "index-K sidecar of layer 3" in caplog.text
    assert s.batch_exists(keys) == 1  # the bad page was dropped


@pytest.mark.parametrize("damage", ["flip", "truncate", "other-key"])
def test_corrupt_file_is_a_miss(file_store, caplog, damage):
    src = _pool()
    s = file_store(src.layout())
    keys = _keys(2)
    s.batch_set(keys, read_pool_pages(src, [1, 2]))
    s.flush()
    path = s.path(keys[1])
    blob = bytearray(open(path, "rb").read())
    if damage == "flip":
        blob[len(blob) // 2] ^= 0xFF
    elif damage == "truncate":
        blob = blob[:-100]
    else:
        blob = bytearray(open(s.path(keys[0]), "rb").read())  # a page stored under the wrong name
    open(path, "wb").write(blob)
    caplog.set_level("WARNING")
    got = s.batch_get(keys)
    assert got[0] is not None and got[1] is None
    assert {"flip": "checksum", "truncate": "truncated", "other-key": "another key"}[damage] in caplog.text
    assert not os.path.exists(path) and s.stats["invalid"] == 1


def test_codec_sizes_are_fixed_per_layout():
    layout = _pool([0, 3]).layout()
    c = PageCodec(layout)
    pages = read_pool_pages(_pool([0, 3]), [1, 2])
    assert {len(c.encode("a", p)) for p in pages} == {c.blob_size}
    assert c.payload_size == LAYERS * layout.kv_bytes_per_page + 2 * layout.index_k_bytes_per_page


# -- registry and flags -----------------------------------------------------------------------------
def test_registry_and_flag_validation(tmp_path):
    with pytest.raises(ValueError, match=r"choices: \['file', 'mooncake'\]"):
        create_storage_backend("s3", _pool().layout())
    ok = validate_storage_args("file", json.dumps({"file_path": str(tmp_path)}), "best_effort", True)
    assert ok == {"file_path": str(tmp_path)}
    cases = [
        (("file", "{}", "best_effort", False), "hicache-storage-backend: needs --enable-hierarchical-cache"),
        (("file", "{not json", "best_effort", True), "extra-config: not valid JSON"),
        (("file", "[1]", "best_effort", True), "must be a JSON object"),
        (("file", '{"path": 1}', "best_effort", True), r"unknown key\(s\) \['path'\]"),
        (("nfs", None, "best_effort", True), "'nfs' is not one of"),
        ((None, '{"file_path": "x"}', "best_effort", True), "needs --hicache-storage-backend"),
        (("file", None, "sometimes", True), "prefetch-policy: 'sometimes'"),
    ]
    for args, msg in cases:
        with pytest.raises(StorageConfigError, match=msg):
            validate_storage_args(*args)


def test_server_args_flags():
    from sglang.srt.server_args import ServerArgs, ServerArgsError, prepare_server_args

    a = prepare_server_args(["--model-path", "builtin:x", "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
                             "--hicache-storage-backend-extra-config", '{"file_path": "/tmp/x"}',
                             "--hicache-storage-prefetch-policy", "timeout"])
    assert (a.hicache_storage_backend, a.hicache_storage_prefetch_policy) == ("file", "timeout")
    a.validate()
    with pytest.raises(ServerArgsError, match="needs --enable-hierarchical-cache"):  # L3 sits under the host tier
        ServerArgs.from_kwargs(model_path="builtin:x", hicache_storage_backend="file").validate()
    with pytest.raises(SystemExit):  # argparse choices come from the registry
        prepare_server_args(["--model-path", "builtin:x", "--hicache-storage-backend", "nfs"])
    with pytest.raises(ServerArgsError, match="hicache-storage-backend-extra-config"):
        ServerArgs.from_kwargs(model_path="builtin:x", enable_hierarchical_cache=True, hicache_storage_backend="file",
                               hicache_storage_backend_extra_config='{"bogus": 1}').validate()
    # under CP a rank's host tier holds only the pages it owns: refused at start-up, not dropped at run time
    with pytest.raises(ServerArgsError, match="hicache-storage-backend.*not supported with context parallel"):
        ServerArgs.from_kwargs(model_path="builtin:x", enable_hierarchical_cache=True, hicache_storage_backend="file",
                               tp_size=2, attn_cp_size=2, enable_nsa_prefill_context_parallel=True).validate()


# -- Mooncake Store ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    """A real mooncake_master on free ports with its built-in HTTP metadata server; torn down after.
    Missing Mooncake is a failure, not a skip: CI installs it (.ci/run), so its absence is a CI bug."""
    import importlib.util

    assert importlib.util.find_spec("mooncake") is not None, \
        "Mooncake Store is not installed: pip install mooncake-transfer-engine-non-cuda (the [test] extra)"
    from sglang.srt.mem_cache.storage.mooncake_store import import_mooncake_store

    import_mooncake_store()  # fails loudly (naming the package and Debian libs) if the native lib cannot load
    import mooncake

    # the wheel installs it on PATH (venv bin/) and inside the package: the latter works unactivated
    binary = shutil.which("mooncake_master") or os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    assert os.access(binary, os.X_OK), "mooncake_master not found (installed by mooncake-transfer-engine-non-cuda)"
    # every port its own: another xdist worker's master (test_hicache_l3) may run at the same time,
    # and the metrics server's default 9003 would clash
    rpc, http, metrics = _free_port(), _free_port(), _free_port()
    log = tmp_path_factory.mktemp("mooncake") / "master.log"
    proc = subprocess.Popen([binary, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
                             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                             f"--http_metadata_server_port={http}", f"--metrics_port={metrics}",
                             "--metrics_host=127.0.0.1"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:  # poll until both ports accept connections
        assert proc.poll() is None, f"mooncake_master exited ({proc.returncode}): {log.read_text()[-2000:]}"
        try:
            for port in (rpc, http):
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            assert time.monotonic() < deadline, f"mooncake_master did not listen in 60 s: {log.read_text()[-2000:]}"
            time.sleep(0.05)
    yield {"master_server_address": f"127.0.0.1:{rpc}", "metadata_server": f"http://127.0.0.1:{http}/metadata",
           "local_hostname": "127.0.0.1", "protocol": "tcp", "global_segment_size": "64mb",
           "local_buffer_size": "16mb"}
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("index_layer_ids", [None, [1, 4]], ids=["all-layers", "indexcache-subset"])
def test_mooncake_two_clients_round_trip(mooncake_master, index_layer_ids):
    src = _pool(index_layer_ids)
    ns = f"t{index_layer_ids is None}"
    writer = create_storage_backend("mooncake", src.layout(), {**mooncake_master, "staging_pages": 3}, namespace=ns)
    reader = create_storage_backend("mooncake", src.layout(), mooncake_master, namespace=ns)
    try:
        _round_trip(writer, reader, src)  # 4 pages through a 3-page staging slab: two chunks
        keys = _keys(6)
        assert reader.batch_exists(keys) == 4 and reader.batch_exists(keys[4:]) == 0
        assert reader.batch_get(keys[4:5]) == [None]
        reader.clear()
        assert writer.batch_exists(keys) == 0
    finally:
        writer.close()
        reader.close()


def test_mooncake_integrity_rules(mooncake_master, caplog):
    src = _pool([0, 3])
    s = create_storage_backend("mooncake", src.layout(), mooncake_master, namespace="integrity")
    other = create_storage_backend("mooncake", _pool([0, 2, 4]).layout(), mooncake_master, namespace="integrity")
    try:
        keys = _keys(2, seed=7)
        good, bad = read_pool_pages(src, [1, 2])
        s.batch_set(keys[:1], [good])
        forged = s.codec.encode(keys[1], PageData(kv=bad.kv, index_k=[bad.index_k[0], bad.index_k[1][:7]]),
                                strict=False)
        assert s.store.put(s._k(keys[1]), bytes(forged)) == 0
        caplog.set_level("WARNING")
        assert [g is not None for g in s.batch_get(keys)] == [True, False]
        assert "index-K sidecar of layer 3" in caplog.text
        with pytest.raises(StorageLayoutError):
            other.batch_get(keys[:1])
    finally:
        s.clear()
        s.close()
        other.close()


def test_mooncake_missing_package_names_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_mooncake(name, *a, **k):
        if name.startswith("mooncake"):
            raise ImportError("No module named 'mooncake'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mooncake)
    from sglang.srt.mem_cache.storage.mooncake_store import import_mooncake_store

    with pytest.raises(ImportError, match="mooncake-transfer-engine-non-cuda"):
        import_mooncake_store()


# -- what the HiCache controller calls -------------------------------------------------------------
def test_store_and_load_pool_pages_stop_at_the_first_miss(file_store):
    from sglang.srt.mem_cache.storage import load_pool_pages, store_pool_pages

    src = _pool([0, 3])
    s = file_store(src.layout())
    keys = _keys(4)
    assert store_pool_pages(s, src, [1, 2, 4], [keys[0], keys[1], keys[3]]) == [True] * 3
    dst = _pool([0, 3], fill=False)
    before = _page_bytes(dst, 8)
    assert load_pool_pages(s, dst, [5, 6, 7, 8], keys) == 2  # keys[2] missing: a 2-page prefix hit
    assert _page_bytes(dst, 5) == _page_bytes(src, 1) and _page_bytes(dst, 6) == _page_bytes(src, 2)
    assert _page_bytes(dst, 8) == before  # nothing after the miss is written, even though keys[3] exists
    with pytest.raises(StorageLayoutError):
        load_pool_pages(s, _pool([0, 2], fill=False), [1], keys[:1])
    with pytest.raises(StorageLayoutError):
        store_pool_pages(s, _pool([0, 2]), [1], keys[:1])


def test_duplicate_keys_in_one_batch_are_stored_once(file_store):
    src = _pool()
    s = file_store(src.layout())
    k = _keys(2)
    pages = read_pool_pages(src, [1, 1, 2])
    assert s.batch_set([k[0], k[0], k[1]], pages) == [True] * 3
    s.flush()
    assert s.num_pages() == 2 and s.stats["set"] == 2


def _concurrent_set_and_get(store_w, store_r, src):
    """A backup thread sets pages while a prefetch thread gets them: every page read is whole."""
    import threading

    keys = _keys(12, seed=3)
    pages = read_pool_pages(src, list(range(1, 13)))
    errors, seen = [], []

    def writer():
        for i in range(0, 12, 3):
            store_w.batch_set(keys[i : i + 3], pages[i : i + 3])

    def reader():
        deadline = time.monotonic() + 30
        while len(seen) < 12 and time.monotonic() < deadline:
            for i, got in enumerate(store_r.batch_get(keys)):
                if got is not None:
                    if bytes(got.index_k[-1].numpy()) != bytes(pages[i].index_k[-1].numpy()):
                        errors.append(i)
                    if i not in seen:
                        seen.append(i)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(seen) == list(range(12))


def test_file_concurrent_backup_and_prefetch(file_store):
    src = _pool([2])
    s = file_store(src.layout(), write_queue_size=1)
    _concurrent_set_and_get(s, s, src)


def test_mooncake_concurrent_backup_and_prefetch(mooncake_master):
    src = _pool([2])
    s = create_storage_backend("mooncake", src.layout(), {**mooncake_master, "staging_pages": 2}, namespace="conc")
    try:
        _concurrent_set_and_get(s, s, src)
        assert s.batch_set(_keys(2, seed=3), read_pool_pages(src, [1, 2])) == [True, True]  # already stored
    finally:
        s.clear()
        s.close()


def test_namespaces_separate_servers_and_are_never_paths(tmp_path):
    from sglang.srt.mem_cache.storage import storage_namespace

    ns_a, ns_b = storage_namespace("org/model", 0), storage_namespace("org_model", 0)
    assert ns_a != ns_b and ns_a.startswith("org_model-0-") and "/" not in ns_a
    src = _pool()
    a = create_storage_backend("file", src.layout(), {"file_path": str(tmp_path)}, namespace=ns_a)
    b = create_storage_backend("file", src.layout(), {"file_path": str(tmp_path)}, namespace=ns_b)
    try:
        a.batch_set(_keys(1), read_pool_pages(src, [1]))
        a.flush()
        assert a.batch_exists(_keys(1)) == 1 and b.batch_exists(_keys(1)) == 0
    finally:
        a.close()
        b.close()
    for bad in ("../x", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="invalid storage namespace"):
            create_storage_backend("file", src.layout(), {"file_path": str(tmp_path)}, namespace=bad)
    s = create_storage_backend("file", src.layout(), {"file_path": str(tmp_path)})
    try:
        with pytest.raises(ValueError, match="invalid storage key"):
            s.batch_exists(["../etc"])
    finally:
        s.close()


DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")


def test_device_pool_pages_through_the_file_tier(file_store):
    """Pool on the test device (SGLANG_TEST_DEVICE=cuda on a GPU): gather, store, load back into another
    device pool; bytes equal, other pages untouched."""
    def pool(seed):
        p = NSATokenToKVPool(16 * PAGE, PAGE, torch.bfloat16, 32, 8, LAYERS, 64, "fp8_e4m3", [0, 3], device=DEVICE)
        g = torch.Generator().manual_seed(seed)
        for buf in p.kv_buffer:
            buf.copy_(torch.randn(buf.shape, generator=g).to(torch.bfloat16))
        for buf in p.index_k_with_scale_buffer:
            buf.copy_(torch.randint(0, 256, buf.shape, generator=g, dtype=torch.uint8))
        return p

    from sglang.srt.mem_cache.storage import load_pool_pages, store_pool_pages

    src, dst = pool(0), pool(1)
    untouched = [b.clone() for b in dst.kv_buffer]
    s = file_store(src.layout())
    keys = _keys(3)
    store_pool_pages(s, src, torch.tensor([2, 9, 4], device=DEVICE), keys)
    assert load_pool_pages(s, dst, torch.tensor([7, 1, 3], device=DEVICE), keys) == 3
    for a, b, u in zip(src.kv_buffer, dst.kv_buffer, untouched):
        pa, pb, pu = (x.view(-1, PAGE, x.shape[-1]) for x in (a, b, u))
        assert torch.equal(pa[[2, 9, 4]], pb[[7, 1, 3]])
        assert torch.equal(pb[[0, 2, 4, 5, 6, 8]], pu[[0, 2, 4, 5, 6, 8]])
    for a, b in zip(src.index_k_with_scale_buffer, dst.index_k_with_scale_buffer):
        assert torch.equal(a[[2, 9, 4]], b[[7, 1, 3]])


def test_controller_flow_as_documented_survives_a_restart(tmp_path):
    """The package docstring's sequence, with a restart between backup and reload."""
    from sglang.srt.mem_cache.storage import load_pool_pages, storage_namespace, store_pool_pages

    extra = validate_storage_args("file", json.dumps({"file_path": str(tmp_path)}), "best_effort", None)
    host = _pool([0, 3])
    tokens = list(range(1000, 1000 + 5 * PAGE + 1))
    keys = page_hashes(tokens, PAGE)
    ns = storage_namespace("org/model")
    storage = create_storage_backend("file", host.layout(), extra, namespace=ns)
    store_pool_pages(storage, host, [3, 4, 5, 6, 7], keys)
    storage.close()

    host2 = _pool([0, 3], fill=False)  # a new server process: empty host pool, same directory
    storage = create_storage_backend("file", host2.layout(), extra, namespace=ns)
    try:
        longer = page_hashes(tokens + list(range(3 * PAGE)), PAGE)  # the same prompt, grown by a turn
        n = storage.batch_exists(longer)
        assert n == 5
        assert load_pool_pages(storage, host2, [10, 11, 12, 13, 14], longer[:n]) == 5
        assert [_page_bytes(host2, p) for p in (10, 11, 12, 13, 14)] == [_page_bytes(host, p) for p in (3, 4, 5, 6, 7)]
    finally:
        storage.close()


def test_mooncake_flags_checked_at_start_up(monkeypatch):
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    with pytest.raises(StorageConfigError, match="master_server_address"):
        validate_storage_args("mooncake", "{}", "best_effort", True)
    assert validate_storage_args("mooncake", '{"master_server_address": "h:1"}', "timeout", True)
    import sglang.srt.mem_cache.storage.mooncake_store as mc

    def missing():
        raise ImportError("needs Mooncake Store: `pip install mooncake-transfer-engine-non-cuda`")

    monkeypatch.setattr(mc, "import_mooncake_store", missing)
    with pytest.raises(StorageConfigError, match="hicache-storage-backend: .*mooncake-transfer-engine-non-cuda"):
        validate_storage_args("mooncake", '{"master_server_address": "h:1"}', "best_effort", True)
