"""FP8 fused MoE (sgl_kernel.fp8_moe) vs the bf16 fused MoE (sgl_kernel.moe) at DeepSeek-V3.2's expert
shapes, ratios in one run (issue 30, item 5).

    python benchmark/kernels/bench_fp8_moe.py --out-dir $OUT              # GPU: E 256, top 8, H 7168, I 2048
    python benchmark/kernels/bench_fp8_moe.py --smoke --out-dir /tmp/o    # CPU interpreter, tiny shapes

Same uniform random routing for both sides; each side first checked against its torch twin (the FP8
one against fused_experts_fp8_native on a slice of the tokens). Times: CUDA-graph replays (how decode
runs; capture also proves no host syncs), sides interleaved, median of --repeats rounds of do_bench
medians. Bandwidth counts the touched experts' weight bytes (FP8: codes + scales) over the time;
its ceiling is a 2 GB device copy in the same run. Goals: decode batch 64 >= 1.7x faster than bf16,
prefill 4K >= 1.4x. Also checks the fixed (deterministic) config is batch invariant. JSON + plot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
V32 = dict(hidden=7168, inter=2048, experts=256, top_k=8)
SMOKE = dict(hidden=160, inter=128, experts=8, top_k=2)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--tokens", default=None, help="comma list (default 1,64,4096; smoke 1,9)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out-dir", default=str(REPO / "benchmark" / "kernels" / "results"))
    return p.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(REPO / "sgl-kernel"))
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "benchmark" / "kernels"))

import torch  # noqa: E402

from sglang.bench_plot import import_pyplot  # noqa: E402
from tqdm import tqdm  # noqa: E402

from sgl_kernel import moe  # noqa: E402
from sgl_kernel.fp8_moe import fixed_fp8_moe_config, fused_experts_fp8, get_fp8_moe_config  # noqa: E402
from sgl_kernel.fp8_quant import block_dequant  # noqa: E402
from timing import cuda_graph, median_ms  # noqa: E402

BLOCK = (128, 128)
FP8 = torch.float8_e4m3fn


def weights(shape: dict, device: str, gen) -> dict:
    """FP8 experts (random codes, scales ~1e-4) built one expert at a time, and their bf16 dequantisation
    (the bf16 side's weights: the same function)."""
    e, h, i = shape["experts"], shape["hidden"], shape["inter"]
    out = {"w13": torch.empty(e, 2 * i, h, dtype=FP8, device=device), "w2": torch.empty(e, h, i, dtype=FP8, device=device),
           "s13": torch.rand(e, 2 * i // 128, -(-h // 128), generator=gen, device=device) * 1e-4 + 5e-5,
           "s2": torch.rand(e, -(-h // 128), i // 128, generator=gen, device=device) * 1e-4 + 5e-5}
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    out["b13"] = torch.empty(e, 2 * i, h, dtype=dt, device=device)
    out["b2"] = torch.empty(e, h, i, dtype=dt, device=device)
    for j in range(e):
        out["w13"][j] = (torch.randn(2 * i, h, generator=gen, device=device) * 64).clamp_(-448, 448).to(FP8)
        out["w2"][j] = (torch.randn(h, i, generator=gen, device=device) * 64).clamp_(-448, 448).to(FP8)
        out["b13"][j] = block_dequant(out["w13"][j], out["s13"][j], BLOCK, dt)
        out["b2"][j] = block_dequant(out["w2"][j], out["s2"][j], BLOCK, dt)
    return out


def routing(t: int, shape: dict, device: str, gen) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.rand(t, shape["experts"], generator=gen, device=device)
    ids = scores.topk(shape["top_k"], dim=1).indices.to(torch.int32)
    return torch.rand(t, shape["top_k"], generator=gen, device=device), ids


def graphed(fn, device: str):
    if device != "cuda":
        return fn, True
    g, out, g_out = cuda_graph(fn)
    g.replay()
    torch.cuda.synchronize()
    return g.replay, bool(torch.equal(g_out, out))


def touched_bytes(ids: torch.Tensor, shape: dict, fp8: bool) -> int:
    n = int(torch.unique(ids).numel())
    h, i = shape["hidden"], shape["inter"]
    per = 3 * h * i * (1 if fp8 else 2) + (4 * (2 * i // 128 * -(-h // 128) + -(-h // 128) * i // 128) if fp8 else 0)
    return n * per


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run(t: int, shape: dict, w: dict, device: str, gen, copy: float) -> dict:
    from sglang.srt.layers.moe.fused_moe_native import fused_experts_fp8_native

    dt = w["b13"].dtype
    x = torch.randn(t, shape["hidden"], generator=gen, device=device).to(dt)
    tw, ids = routing(t, shape, device, gen)
    fp8_fn = lambda: fused_experts_fp8(x, w["w13"], w["s13"], w["w2"], w["s2"], tw, ids, 0, BLOCK)  # noqa: E731
    bf16_fn = lambda: moe.fused_experts(x, w["b13"], w["b2"], tw, ids, 0)  # noqa: E731
    n_chk = min(t, 64)
    ref = fused_experts_fp8_native(x[:n_chk], w["w13"], w["s13"], w["w2"], w["s2"], tw[:n_chk], ids[:n_chk], 0, BLOCK)
    row = dict(tokens=t, fp8_rel_err=rel(fp8_fn()[:n_chk], ref),
               bf16_rel_err=rel(bf16_fn()[:n_chk], moe.fused_experts_ref(x[:n_chk], w["b13"], w["b2"], tw[:n_chk],
                                                                         ids[:n_chk], 0)),
               fp8_config=list(vars(get_fp8_moe_config(t, shape["top_k"], shape["experts"], BLOCK, shape["hidden"],
                                                       shape["inter"], device)).values()))
    f8, row["fp8_graph_equals_eager"] = graphed(fp8_fn, device)
    b16, row["bf16_graph_equals_eager"] = graphed(bf16_fn, device)
    f8_ms, b16_ms = [], []
    for _ in range(ARGS.repeats):  # interleaved sides
        f8_ms.append(median_ms(f8, device, 1))
        b16_ms.append(median_ms(b16, device, 1))
    row["fp8_ms"], row["bf16_ms"] = statistics.median(f8_ms), statistics.median(b16_ms)
    row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
    row["fp8_weight_gbps"] = touched_bytes(ids, shape, True) / row["fp8_ms"] / 1e6
    row["bf16_weight_gbps"] = touched_bytes(ids, shape, False) / row["bf16_ms"] / 1e6
    row["fp8_copy_frac"] = row["fp8_weight_gbps"] / copy
    row["fp8_tflops"] = 6 * t * shape["top_k"] * shape["hidden"] * shape["inter"] / row["fp8_ms"] / 1e9
    return row


def batch_invariant(shape: dict, w: dict, device: str, gen) -> bool:
    dt = w["b13"].dtype
    x = torch.randn(64, shape["hidden"], generator=gen, device=device).to(dt)
    tw, ids = routing(64, shape, device, gen)
    cfg = fixed_fp8_moe_config(BLOCK)
    full = fused_experts_fp8(x, w["w13"], w["s13"], w["w2"], w["s2"], tw, ids, 0, BLOCK, config=cfg)
    return all(torch.equal(fused_experts_fp8(x[:r], w["w13"], w["s13"], w["w2"], w["s2"], tw[:r], ids[:r], 0, BLOCK,
                                             config=cfg), full[:r]) for r in (1, 5))


def plot(result: dict, path: Path) -> None:
    plt = import_pyplot(path)
    if plt is None:
        return
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([str(r["tokens"]) for r in rows], [r["speedup"] for r in rows])
    ax.axhline(1.7, ls="--", c="gray", label="decode goal 1.7x")
    ax.axhline(1.4, ls=":", c="gray", label="prefill goal 1.4x")
    ax.set_xlabel("tokens")
    ax.set_ylabel("bf16 time / FP8 time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    device = "cpu" if ARGS.smoke else "cuda"
    shape = SMOKE if ARGS.smoke else V32
    gen = torch.Generator(device=device).manual_seed(0)
    w = weights(shape, device, gen)
    numel = (1 << 20) if ARGS.smoke else (1 << 30)
    src = torch.empty(numel, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    copy = 2 * src.numel() * 2 / median_ms(lambda: dst.copy_(src), device, ARGS.repeats) / 1e6
    del src, dst
    tokens = [int(v) for v in (ARGS.tokens or ("1,9" if ARGS.smoke else "1,64,4096")).split(",")]
    rows = [run(t, shape, w, device, gen, copy) for t in tqdm(tokens, desc="fp8 moe")]
    result = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)", shape=shape,
                  copy_gbps=copy, batch_invariant_fixed_config=batch_invariant(shape, w, device, gen), rows=rows)
    out = Path(ARGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"fp8_moe_{'cpu' if ARGS.smoke else 'cuda'}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, stem.with_suffix(".png"))
    print(f"device {result['device']}, copy {copy:.0f} GB/s, batch invariant (fixed config) "
          f"{result['batch_invariant_fixed_config']}")
    print(f"{'T':>6} {'fp8 ms':>9} {'bf16 ms':>9} {'speedup':>8} {'fp8 wGB/s':>10} {'%copy':>6} {'bf16 wGB/s':>10} "
          f"{'fp8 TFLOP/s':>11} {'fp8 err':>8} {'bf16 err':>8}")
    for r in rows:
        print(f"{r['tokens']:6d} {r['fp8_ms']:9.4f} {r['bf16_ms']:9.4f} {r['speedup']:8.2f} {r['fp8_weight_gbps']:10.0f} "
              f"{100 * r['fp8_copy_frac']:6.1f} {r['bf16_weight_gbps']:10.0f} {r['fp8_tflops']:11.1f} "
              f"{r['fp8_rel_err']:8.1e} {r['bf16_rel_err']:8.1e}")
    ok = result["batch_invariant_fixed_config"] and all(
        r["fp8_rel_err"] < 2e-2 and r["fp8_graph_equals_eager"] and r["bf16_graph_equals_eager"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
