"""fast_topk (sgl_kernel.topk) vs torch.topk for the DSA indexer's top-k selection (k = 2048).

Every case is first checked bit-exact against the torch twin (fast_topk_ref), then timed (median
of triton.testing.do_bench, and of do_bench_cudagraph: decode runs in CUDA graphs, where the split
path's passes + 1 launches cost less than eagerly). Cases: decode R in {1, 16, 64} x W in
{8K, 32K, 128K} with lengths = W, and prefill R = 4096, W = 32K with causal lengths
(lengths[r] = r * W // R + 1). GB/s counts the valid scores read once (4 * sum(lengths) bytes),
the same figure for both sides; "torch" is torch.topk(scores, k) on the full rows (lengths
ignored), "torch_masked" the indexer's current masked_fill + topk.

Score distributions: bf16 (fp32 holding bf16 values, what the bf16 index matmul gives: the radix
select stops after 16 bits), fp32 (random mantissas: the most passes), fp8 (e4m3 grid: heavy ties).

    # H200
    python benchmark/kernels/bench_topk.py --dists bf16,fp32 --variants auto,s1:r8,s1:r6:w4
    # CPU, Triton interpreter, tiny shapes (what the CPU test runs)
    python benchmark/kernels/bench_topk.py --smoke

Variants: "auto" or ':'-joined knobs s<split> r<radix_bits> b<block> w<num_warps> (e.g. s16:r8),
each passed to fast_topk; unspecified knobs keep fast_topk's defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

import torch

from sglang.bench_plot import import_pyplot
from timing import cuda_graph

DECODE_ROWS, DECODE_WIDTHS, PREFILL = (1, 16, 64), (8192, 32768, 131072), (4096, 32768)
SMOKE_DECODE_ROWS, SMOKE_DECODE_WIDTHS, SMOKE_PREFILL = (1, 3), (700,), (12, 384)


def parse_variant(spec: str) -> dict:
    knobs = {"s": "split", "r": "radix_bits", "b": "block", "w": "num_warps"}
    out = {}
    for tok in spec.split(":"):
        if tok == "auto":
            continue
        m = re.fullmatch(r"([srbw])(\d+)", tok)
        if not m:
            raise SystemExit(f"bad variant token {tok!r} in {spec!r}")
        out[knobs[m.group(1)]] = int(m.group(2))
    return out


def make_scores(dist: str, rows: int, width: int, device: str, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, width, generator=gen).to(device)
    if dist == "bf16":
        return x.bfloat16().float()
    if dist == "fp8":
        return (x * 4).to(torch.float8_e4m3fn).float()
    return x


def cases(smoke: bool) -> list[dict]:
    rows_set, widths, (pr, pw) = ((SMOKE_DECODE_ROWS, SMOKE_DECODE_WIDTHS, SMOKE_PREFILL) if smoke
                                  else (DECODE_ROWS, DECODE_WIDTHS, PREFILL))
    out = [dict(name=f"decode R={r} W={w}", rows=r, width=w, causal=False) for w in widths for r in rows_set]
    return out + [dict(name=f"prefill R={pr} W={pw} causal", rows=pr, width=pw, causal=True)]


def timer(device: str, graph: bool, reps: int):
    if device == "cuda":
        import triton.testing

        if graph:
            return lambda fn: triton.testing.do_bench_cudagraph(fn, return_mode="median")
        return lambda fn: triton.testing.do_bench(fn, return_mode="median")

    def wall(fn) -> float:  # CPU smoke: interpreter time, meaningless beyond "it runs"
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(ts)

    return None if graph else wall


def graph_capture_ok(fn) -> bool:
    """fast_topk captured in a CUDA graph replays to the eager result (no host syncs inside)."""
    g, eager, res = cuda_graph(fn)
    res.fill_(-7)  # capture does not run the kernels: make the replay prove it writes
    g.replay()
    torch.cuda.synchronize()
    return torch.equal(res, eager)


def bench_case(case: dict, dist: str, args, variants: dict[str, dict]) -> dict:
    from sgl_kernel.topk import fast_topk, fast_topk_ref

    dev, k, rows, width = args.device, args.k, case["rows"], case["width"]
    gen = torch.Generator().manual_seed(0)
    scores = make_scores(dist, rows, width, dev, gen)
    if case["causal"]:
        lengths = (torch.arange(rows, dtype=torch.int64) * width // rows + 1).to(torch.int32).to(dev)
    else:
        lengths = torch.full((rows,), width, dtype=torch.int32, device=dev)
    ref = fast_topk_ref(scores, lengths, k)
    out = torch.empty(rows, k, dtype=torch.int32, device=dev)
    fns = {name: (lambda kw=kw: fast_topk(scores, lengths, k, out=out, **kw)) for name, kw in variants.items()}
    for name, fn in fns.items():
        if not torch.equal(fn(), ref):
            raise SystemExit(f"MISMATCH vs fast_topk_ref: {case['name']} {dist} variant {name}")
    cols = torch.arange(width, device=dev)
    baselines = {"torch": lambda: torch.topk(scores, k, dim=-1),
                 "torch_masked": lambda: scores.masked_fill(cols[None, :] >= lengths[:, None], float("-inf")).topk(k)}
    nbytes = 4 * int(lengths.sum())
    row = dict(case=case["name"], dist=dist, rows=rows, width=width, k=k, causal=case["causal"], bytes=nbytes,
               variants={name: dict(kw) for name, kw in variants.items()}, ms={}, ms_graph={})
    for mode, key in ((False, "ms"), (True, "ms_graph")):
        t = timer(dev, mode, args.reps)
        if t is None:
            continue
        for name, fn in {**fns, **baselines}.items():
            row[key][name] = t(fn)
    row["gbps"] = {n: nbytes / (ms * 1e-3) / 1e9 for n, ms in row["ms"].items()}
    row["speedup_vs_torch"] = {n: row["ms"]["torch"] / row["ms"][n] for n in fns}
    if row["ms_graph"]:
        row["graph_speedup_vs_torch"] = {n: row["ms_graph"]["torch"] / row["ms_graph"][n] for n in fns}
        row["graph_capture_ok"] = all(graph_capture_ok(fn) for fn in fns.values())
    return row


def plot(result: dict, path: str) -> None:
    plt = import_pyplot(path)
    if plt is None:
        return None

    rows = result["rows"]
    names = list(rows[0]["ms"])
    panels = [("ms", "median time (ms), eager", True)]
    panels.append(("speedup_vs_torch", "speedup vs torch.topk, eager", False))
    if rows[0]["ms_graph"]:
        panels.append(("graph_speedup_vs_torch", "speedup vs torch.topk, CUDA graph", False))
    fig, axes = plt.subplots(len(panels), 1, figsize=(min(28, max(8, 0.35 * len(rows) * len(names))), 3.5 * len(panels)))
    x = range(len(rows))
    for ax, (key, title, log) in zip(axes, panels):
        series = [n for n in names if n in rows[0][key]]
        wdt = 0.8 / len(series)
        for i, n in enumerate(series):
            ax.bar([j + i * wdt for j in x], [r[key][n] for r in rows], wdt, label=n)
        ax.set_xticks([j + 0.4 - wdt / 2 for j in x], [f"{r['case']}\n{r['dist']}" for r in rows], fontsize=6)
        ax.set(title=title, yscale="log")
        if not log:  # ratios: mark parity with torch.topk
            ax.axhline(1.0, color="k", lw=0.8)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"fast_topk vs torch.topk, k={result['k']}, {result['device_name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes; on CPU under the Triton interpreter")
    p.add_argument("--k", type=int, default=None, help="default 2048 (16 with --smoke)")
    p.add_argument("--dists", default=None, help="bf16,fp32,fp8 (default bf16,fp32; bf16 with --smoke)")
    p.add_argument("--variants", default=None, help="default 'auto' ('auto:b128,s3:r8:b128' with --smoke)")
    p.add_argument("--reps", type=int, default=2, help="CPU wall-clock repetitions (CUDA uses do_bench)")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args()
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu":
        if not args.smoke:
            raise SystemExit("no GPU: run with --smoke (Triton interpreter)")
        os.environ["TRITON_INTERPRET"] = "1"  # before sgl_kernel.topk imports triton.jit kernels
    args.k = args.k or (16 if args.smoke else 2048)
    dists = (args.dists or ("bf16" if args.smoke else "bf16,fp32")).split(",")
    specs = (args.variants or ("auto:b128,s3:r8:b128" if args.smoke else "auto")).split(",")
    variants = {s: parse_variant(s) for s in specs}
    rows = [bench_case(c, d, args, variants) for d in dists for c in cases(args.smoke)]
    import triton

    result = dict(k=args.k, smoke=args.smoke, device=args.device,
                  device_name=torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)",
                  torch=torch.__version__, triton=triton.__version__, rows=rows)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"topk_{args.device}{'_smoke' if args.smoke else ''}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    plot(result, stem + ".png")
    print(f"all cases bit-exact vs fast_topk_ref; k={args.k}; {result['device_name']}; {stem}.json")
    print(f"{'case':<30} {'dist':<5} {'variant':<18} {'ms':>9} {'GB/s':>8} {'torch ms':>9} {'x torch':>8}"
          f" {'graph ms':>9} {'x graph':>8}")
    for r in rows:
        for n in variants:
            g = r["ms_graph"].get(n)
            gx = r.get("graph_speedup_vs_torch", {}).get(n)
            print(f"{r['case']:<30} {r['dist']:<5} {n:<18} {r['ms'][n]:9.4f} {r['gbps'][n]:8.1f}"
                  f" {r['ms']['torch']:9.4f} {r['speedup_vs_torch'][n]:8.2f}"
                  f" {'' if g is None else f'{g:9.4f}':>9} {'' if gx is None else f'{gx:8.2f}':>8}")


if __name__ == "__main__":
    main()
