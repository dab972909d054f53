"""Sparse MLA (decode / prefill) and DSA indexer kernels on DeepSeek-V3.2 shapes, against the
H200's own ceilings measured in the same run (device copy bandwidth, bf16 matmul FLOP/s).

Each case is checked against its torch twin first (random bf16 inputs, never zeros), then timed
with triton.testing.do_bench (median). Variants of the tile sizes are timed where they matter and
the best is reported. JSON + a plot to --out-dir; a table at the end.

    python benchmark/kernels/bench_attention_kernels.py --out-dir /tmp/out         # GPU
    python benchmark/kernels/bench_attention_kernels.py --smoke                     # CPU, interpreter

Decode's serving config is also timed per call in a graph of calls over KV rows that rotate past the
L2 (`ms_chain_l2_cold`): the replayed one-input graph (`ms_graph`) reads a batch-1 step's 2.4 MB of
keys from L2 after its first replay.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from sglang.bench_plot import import_pyplot

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import chain_graph_ms, rotations  # noqa: E402

H, C, R, K_TOP = 128, 512, 64, 2048  # V3.2 MLA heads, latent, rope, index_topk
IH, ID = 64, 128  # indexer heads, head dim


def _bench(fn, device: str, graph: bool = False) -> float:
    """Median ms (graph: replays of a CUDA graph of fn, how decode runs; None off CUDA)."""
    if device != "cuda":
        if graph:
            return None
        import time

        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


# Decode candidates: the serving tile and split of the default rule for the batch
# (sgl_kernel.mla_split.decode_tile / decode_split_keys: "serving"), of deterministic inference (one
# tile, the fixed split: "deterministic"), then both tiles over fixed splits (the batch 1 / batch 64
# trade-off: more splits fill the GPU at batch 1 and cost partial-output traffic at batch 64).
SPLIT_SWEEP = {"narrow": (64, 128, 256, 512, 2048), "wide": (64, 128, 256, 512, 1024, 2048)}


def ceilings(device: str, smoke: bool) -> dict:
    n = 2**20 if smoke else 2**30
    a = torch.randn(n // 2, device=device, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ms = _bench(lambda: b.copy_(a), device)
    m = 256 if smoke else 8192
    x, y = torch.randn(m, m, device=device, dtype=torch.bfloat16), torch.randn(m, m, device=device, dtype=torch.bfloat16)
    mm = _bench(lambda: x @ y, device)
    out = {"copy_GBps": 2 * a.numel() * 2 / ms / 1e6, "bf16_matmul_TFLOPs": 2 * m**3 / mm / 1e9}
    if device == "cuda":  # the FP8 ceiling (issue 31 item 3): e4m3 x e4m3 -> bf16 through cuBLAS
        x8, y8 = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device=device)
        try:
            mm8 = _bench(lambda: torch._scaled_mm(x8, y8, one, one, out_dtype=torch.bfloat16), device)
            out["fp8_matmul_TFLOPs"] = 2 * m**3 / mm8 / 1e9
        except (RuntimeError, TypeError) as e:  # an older torch's signature: the ceiling is left out
            print(f"  fp8 ceiling skipped: {type(e).__name__}: {str(e)[:80]}", file=sys.stderr)
    return out


def _paged_requests(bs: int, ctx: int, device: str, g: torch.Generator):
    slots = bs * ctx + 64
    r2t = torch.randperm(slots, generator=g)[: bs * ctx].view(bs, ctx).int().to(device)
    return r2t, slots


def _decode_chain_ms(q_lat, q_rope, tok_req, pos, topk, pidx, c: int, ctx: int, k_top: int, cfg: dict,
                     device: str) -> float:
    """The serving decode per call in one CUDA graph of calls, each over its own KV rows (timing.
    chain_graph_ms): a batch-1 step gathers 2.4 MB of keys, which a replayed one-input graph serves
    from the 50 MB L2 after the first replay; a model's 61 layers each read their own cache. Each set
    maps the context's positions into its own slot range (a few positions may share a slot: the
    timing, not the values, matters here)."""
    from sgl_kernel.sparse_mla import mla_attention

    t = q_lat.shape[0]
    per_set = max(t * k_top * 2, 4096)  # slots a set spans: every selected key of its tokens, mostly distinct
    sets = rotations(t * k_top * (c + R) * 2)
    kv = torch.randn(sets * per_set, 1, c + R, device=device, dtype=torch.bfloat16)
    tables = [torch.randint(i * per_set, (i + 1) * per_set, (t, ctx), device=device, dtype=torch.int32)
              for i in range(sets)]
    calls = [lambda r2t=r2t: mla_attention(q_lat, q_rope, kv, c, r2t, pidx, tok_req, pos, topk, c**-0.5, **cfg)
             for r2t in tables]
    return chain_graph_ms(calls, device, 3)


def bench_mla(device: str, smoke: bool, g: torch.Generator) -> list[dict]:
    from sgl_kernel.mla_split import MLA_DECODE, MLA_DECODE_WIDE, decode_split_keys, decode_tile, split_keys_for
    from sgl_kernel.sparse_mla import mla_attention, mla_attention_ref
    from sgl_kernel.mla_split import MLA_EXTEND

    h, c, k_top, ctx0 = (16, 64, 64, 256) if smoke else (H, C, K_TOP, 32768)
    rows = []
    cases = [("decode", bs) for bs in ((1, 4) if smoke else (1, 16, 64))]
    cases += [("prefill", t) for t in ((32,) if smoke else (4096, 32768))]
    for kind, n in cases:
        ctx = ctx0
        bs = n if kind == "decode" else 1
        if kind == "prefill":
            ctx = n + max(k_top, n)  # every token sees >= k_top causal keys
        r2t, slots = _paged_requests(bs, ctx, device, g)
        kv = torch.randn(slots, 1, c + R, generator=g).to(device, torch.bfloat16)
        t = n
        tok_req = (torch.arange(t) if kind == "decode" else torch.zeros(t, dtype=torch.long)).to(device)
        pos = (torch.full((t,), ctx - 1) if kind == "decode" else torch.arange(ctx - t, ctx)).to(device)
        pidx = torch.arange(bs, device=device)
        # each token's top-k: sorted random causal positions (what the indexer hands over)
        width = ctx - t + 1 if kind == "prefill" else ctx
        topk = torch.rand(t, width, device=device).topk(k_top, dim=-1).indices.sort(-1).values.int()
        q_lat = torch.randn(t, h, c, generator=g).to(device, torch.bfloat16)
        q_rope = torch.randn(t, h, R, generator=g).to(device, torch.bfloat16)
        args = (q_lat, q_rope, kv, c, r2t, pidx, tok_req, pos, topk, c**-0.5)
        # (the first is the serving config, mla_split.decode_tile / MLA_EXTEND; others: candidates)
        if kind == "decode":
            def fit(tile: dict) -> dict:
                return dict(tile, block_h=16, block_n=16) if smoke else dict(tile)

            tiles = {"narrow": fit(MLA_DECODE), "wide": fit(MLA_DECODE_WIDE)}
            serve, det = fit(decode_tile(n, False)), fit(decode_tile(n, True))
            variants = {"serving": dict(serve, max_keys=k_top, split_keys=decode_split_keys(n, h, k_top, False, serve)),
                        "deterministic": dict(det, max_keys=k_top, split_keys=split_keys_for(k_top, det["block_n"]))}
            for name, tile in tiles.items():
                for sk2 in ((16, 64) if smoke else SPLIT_SWEEP[name]):
                    variants[f"{name} split{sk2}"] = dict(tile, split_keys=sk2, max_keys=k_top)
        else:
            variants = {"serving": dict(MLA_EXTEND), "stages2": dict(MLA_EXTEND, num_stages=2),
                        "stages4": dict(MLA_EXTEND, num_stages=4), "h64n32s3": dict(MLA_EXTEND, block_n=32),
                        "h32n64w4s3": dict(MLA_EXTEND, block_h=32, num_warps=4),
                        "h64n128s2": dict(MLA_EXTEND, block_n=128, num_stages=2)}
            if smoke:
                variants = {n: dict(v, block_h=16, block_n=16) for n, v in list(variants.items())[:2]}
        check_rows = slice(0, min(t, 64))
        ref = mla_attention_ref(*[a[check_rows] if isinstance(a, torch.Tensor) and a.shape[:1] == (t,) else a
                                  for a in args])
        key_bytes = t * k_top * (c + R) * 2
        flops = 2 * t * h * k_top * ((c + R) + c)
        timed = {}
        for name, v in variants.items():
            try:
                out = mla_attention(*args, **v)
            except Exception as e:  # a tile that does not fit (shared memory) is skipped, not fatal
                print(f"  mla {kind} {n} {name} {v}: {type(e).__name__}: {str(e)[:80]}", file=sys.stderr)
                continue
            err = ((out[check_rows].float() - ref.float()).norm() / ref.float().norm()).item()
            if not err < 2e-2:
                raise AssertionError(f"mla {kind} {n} {name} {v}: relative error {err}")
            ms = _bench(lambda: mla_attention(*args, **v), device)
            ms_graph = _bench(lambda: mla_attention(*args, **v), device, graph=True) if kind == "decode" else None
            timed[name] = {"config": v, "ms": ms, "ms_graph": ms_graph, "TFLOPs": flops / ms / 1e9, "rel_err": err}
            g_txt = "" if ms_graph is None else f", graph {ms_graph:.4f} ms"
            print(f"  mla {kind} {n} {name:20s} {ms:.4f} ms{g_txt} {flops / ms / 1e9:.1f} TFLOP/s {v}", file=sys.stderr)
        best = min(timed, key=lambda k: timed[k]["ms"])
        serving = timed.get("serving", timed[best])
        ms = serving["ms"]
        if kind == "decode" and device == "cuda" and "serving" in timed:
            serving["ms_chain_l2_cold"] = _decode_chain_ms(q_lat, q_rope, tok_req, pos, topk, pidx, c, ctx, k_top,
                                                           variants["serving"], device)
        rows.append({"kernel": f"sparse MLA {kind}", "size": n, "ms": ms, "ms_graph": serving["ms_graph"],
                     "ms_chain_l2_cold": serving.get("ms_chain_l2_cold"),
                     "GBps": key_bytes / ms / 1e6, "TFLOPs": flops / ms / 1e9, "rel_err": serving["rel_err"],
                     "config": serving["config"], "best_variant": best, "variants": timed})
    return rows


def bench_indexer(device: str, smoke: bool, g: torch.Generator) -> list[dict]:
    from sgl_kernel.indexer import index_scores, token_blocks
    from sgl_kernel.kv_store import store_index_k
    from sgl_kernel.topk import fast_topk, fast_topk_ref
    from sglang.srt.layers.attention.nsa.nsa_indexer import fold_fp8_query
    from sglang.srt.layers.attention.nsa.nsa_indexer import index_scores as scores_ref
    from sglang.srt.mem_cache.index_k_format import fp8_round_trip
    from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

    ih, k_top = (16, 16) if smoke else (IH, K_TOP)
    rows = []
    cases = [("decode", bs, 256 if smoke else 32768) for bs in ((1, 4) if smoke else (1, 64))]
    cases += [("prefill", 64 if smoke else 32768, 64 if smoke else 32768)]
    for kind, n, ctx in cases:
        bs = n if kind == "decode" else 1
        page = 64
        pool = NSATokenToKVPool(bs * ctx + page, page, torch.bfloat16, 16, 16, 1, ID, "fp8_e4m3", device=device)
        r2t = (torch.randperm(bs * ctx, generator=g).view(bs, ctx) + page).int().to(device)
        keys = torch.randn(bs * ctx, ID, generator=g).to(device)
        store_index_k(pool.index_k_with_scale_buffer[0], r2t.view(-1).long(), keys, page, pool.data_dtype)
        t = n
        tok_req = (torch.arange(t) if kind == "decode" else torch.zeros(t, dtype=torch.long)).to(device)
        pos = (torch.full((t,), ctx - 1) if kind == "decode" else torch.arange(ctx - t, ctx)).to(device)
        pidx = torch.arange(bs, device=device)
        q = torch.randn(t, ih, ID, generator=g).to(device)
        w = torch.randn(t, ih, generator=g).to(device)
        q8, wf = fold_fp8_query(q, w, ID**-0.5, torch.bfloat16)
        block_t = 1 if kind == "decode" else max(1, 128 // ih)
        starts = list(range(t)) if kind == "decode" else [0]
        lens = [1] * t if kind == "decode" else [t]
        blocks = torch.tensor(token_blocks(starts, lens, block_t), dtype=torch.int32).to(device)
        scores = torch.empty(t, ctx, device=device)
        lengths = pos + 1

        def run():
            index_scores(q8, wf, pool.index_k_with_scale_buffer[0], page, pool.data_dtype, r2t, pidx, tok_req, pos,
                         blocks, scores, block_t=block_t, skip_below=k_top)
            return fast_topk(scores, lengths, k_top)

        got = run()
        # check a few rows against the twins (dequantised keys, fp32 math)
        rows_chk = [t // 2, t - 1] if kind == "prefill" else [0, t - 1]  # prefill: rows longer than k_top
        kk = pool.get_index_k(0, r2t[tok_req[rows_chk]].long())
        ref_s = scores_ref(fp8_round_trip(q[rows_chk]), kk, w[rows_chk], ID**-0.5)
        for j, r in enumerate(rows_chk):
            m = int(pos[r]) + 1
            s_err = ((scores[r, :m] - ref_s[j, :m]).abs().max() / ref_s[j, :m].abs().max()).item()
            if not s_err < 1e-2:
                raise AssertionError(f"indexer {kind}: score error {s_err}")
        assert torch.equal(got[rows_chk], fast_topk_ref(scores[rows_chk], lengths[rows_chk], k_top))
        best = None
        # head_sum: the head-weighted sum as a tf32 matmul ("dot", the serving default) or an fp32
        # reduction ("sum"); each candidate's scores are checked against the default's first
        sweep = ([(block_t, 64, 4, hs) for hs in ("dot", "sum")] if smoke else
                 [(bt, 128, w_, hs) for bt in ((1,) if kind == "decode" else (1, 2)) for w_ in (4, 8)
                  for hs in ("dot", "sum")])
        ref_scores = scores.clone()
        # entries the kernel writes: causal keys of rows past k_top (shorter rows' blocks may be skipped
        # and keep the buffer's uninitialised bytes, NaN included)
        causal = (torch.arange(ctx, device=device)[None, :] <= pos[:, None]) & (pos >= k_top)[:, None]
        per_head_sum = {}
        for bt, bn, w_, hs in sweep:
            blk = torch.tensor(token_blocks(starts, lens, bt), dtype=torch.int32).to(device)

            def cand():
                index_scores(q8, wf, pool.index_k_with_scale_buffer[0], page, pool.data_dtype, r2t, pidx, tok_req,
                             pos, blk, scores, block_t=bt, skip_below=k_top, block_n=bn, num_warps=w_, head_sum=hs)
            try:
                cand()
                diff = torch.where(causal, scores - ref_scores, 0).abs().max() / ref_scores[causal].abs().max()
                if not diff < 1e-2:
                    raise AssertionError(f"indexer {kind} {hs}: scores differ from the default by {float(diff)}")
                ms = _bench(cand, device)
            except AssertionError:
                raise
            except Exception as e:  # a tile that does not fit / compile here is skipped, named
                print(f"  indexer {kind} bt{bt} bn{bn} w{w_} {hs}: {type(e).__name__}", file=sys.stderr)
                continue
            per_head_sum[hs] = min(ms, per_head_sum.get(hs, float("inf")))
            if best is None or ms < best[0]:
                best = (ms, {"block_t": bt, "block_n": bn, "num_warps": w_, "head_sum": hs})
        ms_scores, cfg = best
        ms_topk = _bench(lambda: fast_topk(scores, lengths, k_top), device)
        pairs = float(lengths.sum())
        flops = 2 * pairs * ih * ID
        rows.append({"kernel": f"indexer scores {kind}", "size": n, "ms": ms_scores, "TFLOPs": flops / ms_scores / 1e9,
                     "GBps": pairs / cfg["block_t"] * (ID + 4) / ms_scores / 1e6, "config": cfg,
                     "best_ms_by_head_sum": per_head_sum})
        row = {"kernel": f"indexer top-k {kind}", "size": n, "ms": ms_topk, "GBps": pairs * 4 / ms_topk / 1e6}
        if kind == "prefill" and not smoke:  # the fused path with the sampled-threshold prefilter: equal first
            # (not in the smoke run: the interpreter takes ~50 s for it; test_topk checks it exactly)
            if not torch.equal(fast_topk(scores, lengths, k_top, prefilter=True), fast_topk(scores, lengths, k_top)):
                raise AssertionError("top-k prefilter differs from the fused path")
            row["ms_prefilter"] = _bench(lambda: fast_topk(scores, lengths, k_top, prefilter=True), device)
        if kind == "decode":  # decode runs in CUDA graphs: scores + top-k back to back, replayed
            row["ms_graph"] = _bench(lambda: fast_topk(scores, lengths, k_top), device, graph=True)
            row["ms_graph_scores_plus_topk"] = _bench(run, device, graph=True)
            row["split_sweep_ms_graph"] = {}
            for sp in (() if smoke else (8, 16, 32, 64)):
                if torch.equal(fast_topk(scores, lengths, k_top, split=sp), got):  # byte-equal at any split
                    row["split_sweep_ms_graph"][sp] = _bench(lambda: fast_topk(scores, lengths, k_top, split=sp),
                                                             device, graph=True)
                else:
                    raise AssertionError(f"top-k split {sp} differs from the default split")
        rows.append(row)
    return rows


def plot(rows: list[dict], ceil: dict, path: str) -> None:
    plt = import_pyplot(path)
    if plt is None:
        return None

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['kernel']}\n{r['size']}" for r in rows]
    frac = [max(r.get("GBps", 0) / ceil["copy_GBps"], r.get("TFLOPs", 0) / ceil["bf16_matmul_TFLOPs"]) for r in rows]
    ax.bar(range(len(rows)), [100 * f for f in frac], color="#2b7bba")
    ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=30, ha="right")
    ax.set_ylabel("% of the ceiling (copy GB/s or bf16 matmul)")
    ax.set_title(f"attention kernels; copy {ceil['copy_GBps']:.0f} GB/s, matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = "cpu" if args.smoke else "cuda"
    g = torch.Generator().manual_seed(0)
    ceil = ceilings(device, args.smoke)
    rows = bench_mla(device, args.smoke, g) + bench_indexer(device, args.smoke, g)
    for r in rows:
        r["pct_copy"] = 100 * r.get("GBps", 0) / ceil["copy_GBps"]
        r["pct_matmul"] = 100 * r.get("TFLOPs", 0) / ceil["bf16_matmul_TFLOPs"]
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
              "ceilings": ceil, "rows": rows, "torch": torch.__version__}
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, "attention_kernels" + ("_smoke" if args.smoke else ""))
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    plot(rows, ceil, stem + ".png")
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s (r+w), bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    print(f"{'kernel':28s} {'size':>6s} {'ms':>9s} {'graph ms':>9s} {'GB/s':>8s} {'TFLOP/s':>8s} {'%copy':>6s} {'%mm':>5s}")
    for r in rows:
        g = r.get("ms_graph")
        print(f"{r['kernel']:28s} {r['size']:>6d} {r['ms']:9.4f} {'' if g is None else f'{g:9.4f}':>9s} "
              f"{r.get('GBps', 0):8.0f} {r.get('TFLOPs', 0):8.1f} {r['pct_copy']:6.1f} {r['pct_matmul']:5.1f}")
    for r in rows:  # the candidates behind each MLA row, and the top-k's graph numbers
        for name, v in r.get("variants", {}).items():
            g = v["ms_graph"]
            print(f"  {r['kernel']} {r['size']} {name:22s} {v['ms']:9.4f} ms {'' if g is None else f'graph {g:.4f}'}"
                  f" {v['TFLOPs']:7.1f} TFLOP/s")
        if "ms_graph_scores_plus_topk" in r and r["ms_graph_scores_plus_topk"] is not None:
            print(f"  {r['kernel']} {r['size']}: scores + top-k in a graph {r['ms_graph_scores_plus_topk']:.4f} ms;"
                  f" top-k by split (graph ms) {r['split_sweep_ms_graph']}")


if __name__ == "__main__":
    main()
