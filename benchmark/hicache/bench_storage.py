"""HiCache L3 storage bandwidth: file and Mooncake Store set / get vs a raw in-memory copy.

Pages of a real NSATokenToKVPool (V3.2 MLA row 576 bf16, FP8 index K 132 B/token, page 64, every
layer an index layer unless --index-freq) are read out once (read_pool_pages), then per repeat:
- memcpy: one single-threaded contiguous copy of the same payload bytes (the baseline: what any
  tier must move at least once; the storage paths are single-threaded too);
- codec: encode every page into a blob and decode it back (header + CRC-32, no I/O);
- file set: HiCacheFile.batch_set + flush (encode, queue, write-behind thread, tmp + rename);
  file get: batch_get (read, checks, CRC) -- files are in the OS page cache (not dropped);
- file store / load: the controller's calls around the same I/O: store_pool_pages (gather the pool's
  pages + set + flush) and load_pool_pages (get + scatter into a second pool);
- mooncake set / get: one client puts, a second client gets (TCP on localhost, a mooncake_master
  started here with its HTTP metadata server).
Sides alternate within each repeat (fresh keys per repeat: pages are content-addressed); medians.
Bandwidth = payload bytes / seconds; ratios are against memcpy of the same run.

    python benchmark/hicache/bench_storage.py                 # ~1 min on 2 cores
    python benchmark/hicache/bench_storage.py --smoke         # seconds: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy
import torch

from sglang.bench_plot import import_pyplot

HERE = os.path.dirname(os.path.abspath(__file__))


def _pool(args):
    from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

    index_layers = [i for i in range(args.layers) if i % args.index_freq == 0]
    pool = NSATokenToKVPool((args.pages + 1) * args.page_size, args.page_size, torch.bfloat16, 512, 64, args.layers,
                            128, "fp8_e4m3", index_layers)
    g = torch.Generator().manual_seed(0)
    for buf in pool.kv_buffer:
        buf.copy_(torch.randn(buf.shape, generator=g).to(torch.bfloat16))
    for buf in pool.index_k_with_scale_buffer:
        buf.copy_(torch.randint(0, 256, buf.shape, generator=g, dtype=torch.uint8))
    return pool


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_master(workdir: str):
    import mooncake

    binary = shutil.which("mooncake_master") or os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    rpc, http = _free_port(), _free_port()
    proc = subprocess.Popen([binary, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
                             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                             f"--http_metadata_server_port={http}"],
                            stdout=open(os.path.join(workdir, "master.log"), "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode}")
        try:
            for port in (rpc, http):
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("mooncake_master did not start in 60 s") from None
            time.sleep(0.05)
    return proc, rpc, http


def run(args) -> dict:
    from tqdm import tqdm

    from sglang.srt.mem_cache.storage import (
        create_storage_backend,
        load_pool_pages,
        page_hashes,
        read_pool_pages,
        store_pool_pages,
    )

    pool = _pool(args)
    target = _pool(args)  # load_pool_pages writes here
    layout = pool.layout()
    pages = read_pool_pages(pool, list(range(1, args.pages + 1)))
    codec_store = None
    payload = sum(t.numel() for p in pages for t in (*p.kv, *p.index_k))
    flat = torch.cat([t for p in pages for t in (*p.kv, *p.index_k)])
    flat_np, dst_np = flat.numpy(), numpy.empty(flat.numel(), dtype=numpy.uint8)
    dst_np.fill(0)  # fault the destination in before timing
    workdir = tempfile.mkdtemp(prefix="bench_storage_")
    stores = {"file": create_storage_backend("file", layout, {"file_path": os.path.join(workdir, "files")})}
    codec_store = stores["file"]
    master = None
    sides = ["memcpy", "codec", "file_set", "file_get", "file_store_pool", "file_load_pool"]
    if not args.no_mooncake:
        master, rpc, http = _start_master(workdir)
        cfg = {"master_server_address": f"127.0.0.1:{rpc}", "metadata_server": f"http://127.0.0.1:{http}/metadata",
               "local_hostname": "127.0.0.1", "global_segment_size": f"{max(256, 3 * payload >> 20)}mb"}
        stores["mooncake_writer"] = create_storage_backend("mooncake", layout, cfg, namespace="bench")
        stores["mooncake_reader"] = create_storage_backend("mooncake", layout, cfg, namespace="bench")
        sides += ["mooncake_set", "mooncake_get"]
    times: dict[str, list[float]] = {s: [] for s in sides}
    try:
        for rep in tqdm(range(args.warmup + args.repeats), desc="repeats", file=sys.stderr):
            keys = page_hashes(list(range(rep * 10**6, rep * 10**6 + args.pages * args.page_size)), args.page_size)
            t: dict[str, float] = {}
            t0 = time.perf_counter()
            numpy.copyto(dst_np, flat_np)  # one thread, like every storage path measured here
            t["memcpy"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            for k, p in zip(keys, pages):
                codec_store.codec.decode(k, codec_store.codec.encode(k, p))
            t["codec"] = time.perf_counter() - t0
            f = stores["file"]
            t0 = time.perf_counter()
            f.batch_set(keys, pages)
            f.flush()
            t["file_set"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            got = f.batch_get(keys)
            t["file_get"] = time.perf_counter() - t0
            assert all(g is not None for g in got)
            f.clear()
            page_ids = list(range(1, args.pages + 1))
            t0 = time.perf_counter()
            store_pool_pages(f, pool, page_ids, keys)
            f.flush()
            t["file_store_pool"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            loaded = load_pool_pages(f, target, page_ids, keys)
            t["file_load_pool"] = time.perf_counter() - t0
            assert loaded == args.pages
            if master is not None:
                w, r = stores["mooncake_writer"], stores["mooncake_reader"]
                t0 = time.perf_counter()
                ok = w.batch_set(keys, pages)
                t["mooncake_set"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                got = r.batch_get(keys)
                t["mooncake_get"] = time.perf_counter() - t0
                assert all(ok) and all(g is not None for g in got)
                w.clear()
            f.clear()
            if rep >= args.warmup:
                for s in sides:
                    times[s].append(t[s])
    finally:
        for s in stores.values():
            s.close()
        if master is not None:
            master.terminate()
            master.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    med = {s: statistics.median(v) for s, v in times.items()}
    gbps = {s: payload / med[s] / 1e9 for s in sides}
    return {
        "config": {"layers": args.layers, "index_layers": len(layout.index_layer_ids), "page_size": args.page_size,
                   "pages": args.pages, "page_bytes": payload // args.pages, "payload_bytes": payload,
                   "blob_bytes": stores["file"].codec.blob_size, "repeats": args.repeats,
                   "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count()},
        "median_s": med,
        "gb_per_s": gbps,
        "ratio_vs_memcpy": {s: gbps[s] / gbps["memcpy"] for s in sides},
        "all_s": times,
    }


def plot(result: dict, path: str) -> None:
    plt = import_pyplot(path)
    if plt is None:
        return None

    sides = list(result["gb_per_s"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(sides, [result["gb_per_s"][s] for s in sides], color=["grey"] + ["C0"] * (len(sides) - 1))
    ax.set_yscale("log")
    ax.tick_params(axis="x", labelrotation=20)
    ax.set_ylabel("GB/s (payload)")
    c = result["config"]
    ax.set_title(f"HiCache L3 storage, {c['pages']} pages x {c['page_bytes'] / 1e6:.2f} MB "
                 f"({c['layers']} layers, page {c['page_size']})")
    for i, s in enumerate(sides):
        ax.text(i, result["gb_per_s"][s], f"{result['ratio_vs_memcpy'][s]:.3f}x", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--index-freq", type=int, default=1, help="every N-th layer has index K (IndexCache)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-mooncake", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 1 repeat")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "storage_cpu.json"))
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.pages, args.repeats, args.warmup = 2, 4, 1, 0
        args.out = args.out.replace(".json", "_smoke.json")
    result = run(args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    try:
        plot(result, args.out.replace(".json", ".png"))
    except ImportError:
        print("matplotlib not installed: JSON only", file=sys.stderr)
    for s in result["gb_per_s"]:
        print(f"{s:14s} {result['median_s'][s] * 1e3:9.2f} ms  {result['gb_per_s'][s]:8.3f} GB/s  "
              f"{result['ratio_vs_memcpy'][s]:.3f}x memcpy")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
