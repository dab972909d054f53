"""FP8 MLA KV cache (`--kv-cache-dtype fp8_e4m3`) vs the bf16 cache: sparse MLA decode / prefill
time over each, the KV store, and the capacity at one memory budget (V3.2 shapes).

Each case is checked first: the FP8 kernel against its torch twin over the dequantised cache, the
bf16 kernel against the twin over the bf16 cache (random inputs, poisoned outputs). Then both
sides are timed interleaved (GPU: triton.testing.do_bench median; CPU: the interpreter, median of
--repeats wall times, so only the FP8 / bf16 *ratio* means anything there and even that mostly
measures interpreter overhead, not memory traffic). Expectation on the GPU: decode at batch 1 is
KV-bandwidth-bound, so FP8 (656 vs 1152 B per key) should approach 1152 / 656 = 1.76x less time for
the key loads; at batch 64 the kernel is matmul-bound (128 heads share a key), so ~1x, minus the
dequant ALU work. JSON + plot to --out-dir; a table last.

    python benchmark/kernels/bench_fp8_kv.py --out-dir benchmark/kernels/results        # GPU
    TRITON_INTERPRET=1 python benchmark/kernels/bench_fp8_kv.py --smoke --out-dir /tmp/fp8  # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "..", p) for p in ("python", "sgl-kernel")]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import median_ms  # noqa: E402

from sglang.bench_plot import import_pyplot

H, C, R, K_TOP = 128, 512, 64, 2048  # V3.2 MLA heads, latent, rope, index_topk
V32_LAYERS = 61  # layers with MLA KV (and, at IndexCache freq 1, FP8 index K: 132 B/token each)
ROUNDS = 3


def capacity(budget_gib: float = 80.0) -> dict:
    """Tokens of a V3.2 KV pool in one memory budget, auto (bf16) vs FP8, from the pool's own sizes."""
    from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

    kw = dict(size=64, page_size=64, dtype=torch.bfloat16, kv_lora_rank=C, qk_rope_head_dim=R, layer_num=V32_LAYERS,
              index_head_dim=128)
    auto = NSATokenToKVPool(**kw).kv_bytes_per_token()
    fp8 = NSATokenToKVPool(**kw, kv_cache_dtype="fp8_e4m3").kv_bytes_per_token()
    b = budget_gib * 2**30
    return {"budget_GiB": budget_gib, "bytes_per_token_auto": auto, "bytes_per_token_fp8": fp8,
            "tokens_auto": int(b // auto), "tokens_fp8": int(b // fp8), "ratio": auto / fp8,
            "mla_row_bytes": {"auto": 2 * (C + R), "fp8": 656}}


def bench_mla(device: str, smoke: bool, repeats: int, g: torch.Generator) -> list[dict]:
    from sgl_kernel.mla_split import decode_split_keys, decode_tile
    from sgl_kernel.sparse_mla import mla_attention, mla_attention_ref
    from sgl_kernel.mla_split import MLA_EXTEND
    from sglang.srt.mem_cache import kv_fp8_format as fmt

    h, c, r, k_top, ctx0 = (16, 128, 16, 64, 256) if smoke else (H, C, R, K_TOP, 32768)
    cases = [("decode", bs) for bs in ((1, 4) if smoke else (1, 16, 64))]
    cases += [("prefill", t) for t in ((16,) if smoke else (4096, 32768))]
    rows = []
    for kind, n in cases:
        bs = n if kind == "decode" else 1
        ctx = ctx0 if kind == "decode" else n + max(k_top, n)
        slots = bs * ctx + 64
        r2t = torch.randperm(slots, generator=g)[: bs * ctx].view(bs, ctx).int().to(device)
        lat, rope = torch.randn(slots, c, generator=g), torch.randn(slots, r, generator=g)
        kv_bf16 = torch.cat([lat, rope], -1).to(device, torch.bfloat16)[:, None]
        kv_fp8 = fmt.pack(lat, rope).to(device)[:, None]
        dl, dr = fmt.dequantize(kv_fp8, c, r)
        kv_deq = torch.cat([dl, dr], -1).to(torch.bfloat16)
        t = n
        tok_req = (torch.arange(t) if kind == "decode" else torch.zeros(t, dtype=torch.long)).to(device)
        pos = (torch.full((t,), ctx - 1) if kind == "decode" else torch.arange(ctx - t, ctx)).to(device)
        pidx = torch.arange(bs, device=device)
        width = ctx - t + 1 if kind == "prefill" else ctx
        topk = torch.rand(t, width, generator=g).topk(k_top, dim=-1).indices.sort(-1).values.int().to(device)
        q_lat = torch.randn(t, h, c, generator=g).to(device, torch.bfloat16)
        q_rope = torch.randn(t, h, r, generator=g).to(device, torch.bfloat16)
        if kind == "decode":
            tile = decode_tile(n, False)  # the serving default's tile and split for the batch
            kw = dict(tile, split_keys=decode_split_keys(n, h, k_top, False, tile), max_keys=k_top)
        else:
            kw = dict(MLA_EXTEND)
        row = {"kind": kind, "n": n, "heads": h, "latent": c, "topk": k_top}
        for name, kv, ref_kv in (("bf16", kv_bf16, kv_bf16), ("fp8", kv_fp8, kv_deq)):
            args = (q_lat, q_rope, kv, c, r2t, pidx, tok_req, pos, topk, c**-0.5)
            out = torch.full((t, h, c), float("nan"), dtype=torch.bfloat16, device=device)
            got = mla_attention(*args, out=out, **kw)
            ref = mla_attention_ref(q_lat, q_rope, ref_kv, c, r2t, pidx, tok_req, pos, topk, c**-0.5)
            rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            if not rel < 2e-2 or got.isnan().any():
                raise AssertionError(f"{kind} {n} {name}: rel err {rel}")
            row[f"rel_err_{name}"] = rel
        # sides interleaved over ROUNDS rounds (bf16, fp8, bf16, fp8, ...), the median of the round medians
        ms = {"bf16": [], "fp8": []}
        for _ in range(ROUNDS):
            for name, kv in (("bf16", kv_bf16), ("fp8", kv_fp8)):
                args = (q_lat, q_rope, kv, c, r2t, pidx, tok_req, pos, topk, c**-0.5)
                ms[name].append(median_ms(lambda: mla_attention(*args, **kw), device, repeats))
        row.update(ms_bf16=statistics.median(ms["bf16"]), ms_fp8=statistics.median(ms["fp8"]))
        row["speedup_fp8"] = row["ms_bf16"] / row["ms_fp8"]
        key_bytes = {"bf16": 2 * (c + r), "fp8": fmt.row_bytes(c, r)}
        for name in ("bf16", "fp8"):  # bytes of the gathered keys (each token's top-k rows once)
            row[f"key_GBps_{name}"] = t * min(k_top, ctx) * key_bytes[name] / row[f"ms_{name}"] / 1e6
        rows.append(row)
    return rows


def bench_store(device: str, smoke: bool, repeats: int, g: torch.Generator) -> list[dict]:
    from sgl_kernel.kv_store import store_mla_kv
    from sglang.srt.mem_cache import kv_fp8_format as fmt

    c, r = (128, 16) if smoke else (C, R)
    rows = []
    for t in ((8,) if smoke else (64, 4096)):
        slots = 4 * t + 64
        loc = torch.randperm(slots, generator=g)[:t].to(device)
        lat, rope = torch.randn(t, c, generator=g).to(device, torch.bfloat16), torch.randn(t, r, generator=g).to(
            device, torch.bfloat16)
        bufs = {"bf16": torch.zeros(slots, 1, c + r, dtype=torch.bfloat16, device=device),
                "fp8": torch.zeros(slots, 1, fmt.row_bytes(c, r), dtype=torch.uint8, device=device)}
        row = {"kind": "store", "n": t}
        ms = {"bf16": [], "fp8": []}
        for _ in range(ROUNDS):
            for name, buf in bufs.items():
                ms[name].append(median_ms(lambda: store_mla_kv(buf, loc, lat, rope), device, repeats))
        row.update({f"ms_{k}": statistics.median(v) for k, v in ms.items()})
        row["speedup_fp8"] = row["ms_bf16"] / row["ms_fp8"]
        rows.append(row)
    return rows


def plot(rows: list[dict], path: str) -> None:
    plt = import_pyplot(path)
    if plt is None:
        return None

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['kind']} {r['n']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["ms_bf16"] for r in rows], 0.4, label="bf16 KV")
    ax.bar([i + 0.2 for i in x], [r["ms_fp8"] for r in rows], 0.4, label="FP8 KV (656 B/token)")
    ax.set_xticks(list(x), labels, rotation=20)
    ax.set_ylabel("ms (median)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("sparse MLA over the FP8 vs bf16 KV cache")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out-dir", default="benchmark/kernels/results")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("on CPU run with TRITON_INTERPRET=1 (the Triton interpreter)")
    smoke = args.smoke or device == "cpu"
    g = torch.Generator().manual_seed(0)
    res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter: ratios only)",
           "smoke": smoke, "capacity": capacity(), "mla": bench_mla(device, smoke, args.repeats, g),
           "store": bench_store(device, smoke, args.repeats, g)}
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"fp8_kv_{device}")
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    plot(res["mla"] + res["store"], stem + ".png")
    cap = res["capacity"]
    print(f"capacity at {cap['budget_GiB']} GiB (V3.2, {V32_LAYERS} layers, FP8 index K): auto {cap['tokens_auto']} "
          f"tokens ({cap['bytes_per_token_auto']} B/token), fp8 {cap['tokens_fp8']} ({cap['bytes_per_token_fp8']}): "
          f"{cap['ratio']:.2f}x")
    print(f"{'case':<14}{'bf16 ms':>10}{'fp8 ms':>10}{'fp8 speedup':>13}")
    for r in res["mla"] + res["store"]:
        print(f"{r['kind'] + ' ' + str(r['n']):<14}{r['ms_bf16']:>10.3f}{r['ms_fp8']:>10.3f}{r['speedup_fp8']:>13.2f}")
    print(f"wrote {stem}.json / .png ({res['device']})")


if __name__ == "__main__":
    main()
