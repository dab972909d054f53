"""Cost of `--enable-deterministic-inference`: sgl_kernel.batch_invariant's fixed-order matmul and
RMSNorm vs the default kernels (cuBLAS via F.linear / torch RMSNorm), on V3.2 projection shapes
from decode (M = 1..64 rows) to prefill (M = 4096). Anchor: upstream SGLang's deterministic mode
(Thinking Machines' batch-invariant ops, with CUDA graphs) reported 34.35% end-to-end overhead, TML's
own 61.5% (lmsys.org blog, 2025-09-22); these are kernel-level ratios, the end-to-end cost is lower.

Each case first checks the kernel against the default path (relative error) and that its rows are
batch-invariant (row 0 of M rows == row 0 alone, bytewise). Sides interleaved, median of rounds.
GPU: triton.testing.do_bench medians; CPU: the interpreter, tiny shapes, ratios only (and even
those mostly measure interpreter overhead). JSON + plot to --out-dir; a table last.

    python benchmark/kernels/bench_batch_invariant.py --out-dir benchmark/kernels/results           # GPU
    TRITON_INTERPRET=1 python benchmark/kernels/bench_batch_invariant.py --smoke --out-dir /tmp/bi   # CPU
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

# (name, N, K) of V3.2 dense projections: q_a 7168->1536, q_b 1536->24576, kv_a 7168->576,
# o_proj 16384->7168, shared-expert gate_up 7168->4096, lm_head slice 7168->16384
SHAPES = [("q_a", 1536, 7168), ("q_b", 24576, 1536), ("kv_a", 576, 7168), ("o_proj", 7168, 16384),
          ("gate_up", 4096, 7168), ("lm_head/8", 16160, 7168)]
SMOKE_SHAPES = [("tiny", 96, 128)]
ROUNDS = 3


def run(device: str, smoke: bool, repeats: int) -> list[dict]:
    from sgl_kernel.batch_invariant import matmul, rms_norm
    from sglang.srt.layers.layernorm import RMSNorm

    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    rows = []
    ms_list = (1, 4) if smoke else (1, 16, 64, 256, 4096)
    for name, n, k in SMOKE_SHAPES if smoke else SHAPES:
        w = (torch.randn(n, k, generator=g) * k**-0.5).to(device, dtype)
        for m in ms_list:
            x = torch.randn(m, k, generator=g).to(device, dtype)
            got, ref = matmul(x, w.t()), torch.nn.functional.linear(x, w)
            rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            if not rel < 1e-2 or not torch.equal(matmul(x[:1], w.t()), got[:1]):
                raise AssertionError(f"{name} M={m}: rel {rel} or rows not invariant")
            t = {"default": [], "invariant": []}
            for _ in range(ROUNDS):
                t["default"].append(median_ms(lambda: torch.nn.functional.linear(x, w), device, repeats, gpu_rep_ms=100))
                t["invariant"].append(median_ms(lambda: matmul(x, w.t()), device, repeats, gpu_rep_ms=100))
            d, i = statistics.median(t["default"]), statistics.median(t["invariant"])
            rows.append({"op": f"linear {name}", "M": m, "N": n, "K": k, "ms_default": d, "ms_invariant": i,
                         "slowdown": i / d, "TFLOPs_invariant": 2 * m * n * k / i / 1e9, "rel_err": rel})
    hid = 128 if smoke else 7168
    norm = RMSNorm(hid).to(device)
    for m in ms_list:
        x = torch.randn(m, hid, generator=g).to(device, dtype)
        t = {"default": [], "invariant": []}
        for _ in range(ROUNDS):
            t["default"].append(median_ms(lambda: norm(x), device, repeats, gpu_rep_ms=100))
            t["invariant"].append(median_ms(lambda: rms_norm(x, norm.weight, norm.variance_epsilon), device, repeats,
                                            gpu_rep_ms=100))
        d, i = statistics.median(t["default"]), statistics.median(t["invariant"])
        rows.append({"op": "rms_norm", "M": m, "N": hid, "K": 0, "ms_default": d, "ms_invariant": i,
                     "slowdown": i / d})
    return rows


def plot(rows: list[dict], path: str) -> None:
    plt = import_pyplot(path)
    if plt is None:
        return None

    fig, ax = plt.subplots(figsize=(9, 4))
    for op in dict.fromkeys(r["op"] for r in rows):
        rs = [r for r in rows if r["op"] == op]
        ax.plot([r["M"] for r in rs], [r["slowdown"] for r in rs], marker="o", label=op)
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("rows (tokens in the batch)")
    ax.set_ylabel("time invariant / default")
    ax.set_title("--enable-deterministic-inference: kernel cost")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out-dir", default="benchmark/kernels/results")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("on CPU run with TRITON_INTERPRET=1 (the Triton interpreter)")
    smoke = args.smoke or device == "cpu"
    rows = run(device, smoke, args.repeats)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"batch_invariant_{device}")
    with open(stem + ".json", "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter: ratios only)",
                   "rows": rows}, f, indent=1)
    plot(rows, stem + ".png")
    print(f"{'op':<20}{'M':>6}{'default ms':>12}{'invariant ms':>14}{'slowdown':>10}")
    for r in rows:
        print(f"{r['op']:<20}{r['M']:>6}{r['ms_default']:>12.4f}{r['ms_invariant']:>14.4f}{r['slowdown']:>10.2f}")
    print(f"wrote {stem}.json / .png")


if __name__ == "__main__":
    main()
