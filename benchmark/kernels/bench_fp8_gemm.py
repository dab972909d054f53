"""W8A8 block-scaled GEMM (sgl_kernel.fp8_gemm) at DeepSeek-V3.2's projection shapes vs the card's
ceilings measured in the same run (issue 30, item 5).

    python benchmark/kernels/bench_fp8_gemm.py --out-dir $OUT            # GPU: M = 1, 64, 4096
    python benchmark/kernels/bench_fp8_gemm.py --out-dir $OUT --sweep    # + the heuristic and fixed configs
    python benchmark/kernels/bench_fp8_gemm.py --smoke --out-dir /tmp/o  # CPU interpreter, tiny shapes

Per shape and M: the kernel first checked against its torch twin (rel err), then timed (median of
do_bench; M <= 64 also as a CUDA-graph replay, which also proves no host syncs, and per call in a
graph of calls over weights rotating past the L2 -- `chain_ms`, the decode figure -- beside
torch._scaled_mm and the bf16 matmul timed the same way), with the config the
kernel picks (the device's tuned table, tune_fp8.py, else the heuristic); --sweep adds rows for the
heuristic's and the deterministic (fixed) config, and the heuristic's split-K with the separate
reduction kernel. Configs that quantise the activations once are also
timed on codes quantised beforehand (`gemm_only_*`: the GEMM without the quant launch, what a quant
fused into the previous op would leave). Ceilings, same run:
FP8 matmul rate = torch._scaled_mm at the same shape (per-tensor scales, bf16 out; M padded to 16),
bandwidth = a 2 GB device-to-device copy (read + write bytes / time). Goals: >= 70% of _scaled_mm's
TFLOP/s at M = 4096, >= 70% of the copy bandwidth on the weight bytes at M <= 64. The bf16 matmul of
the dequantised weight (today's path) is timed too. Also checks the fixed (deterministic) config is
batch invariant on the device. JSON + plot (the plot is skipped without matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# (name, N, K) per GPU at --tp-size 8 (column shards split N, row shards split K; q_a / kv_a and the
# indexer's wq_b are replicated)
V32_SHAPES = [("fused_qkv_a", 2112, 7168), ("q_b (tp8)", 3072, 1536), ("o_proj (tp8)", 7168, 2048),
              ("indexer wq_b", 8192, 1536), ("shared gate_up", 4096, 7168), ("shared down", 7168, 2048)]
SMOKE_SHAPES = [("tiny", 200, 256)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--ms", default=None, help="comma list of M (default 1,64,4096; smoke 1,20)")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--repeats", type=int, default=3, help="CPU repeats (GPU: do_bench's median)")
    p.add_argument("--out-dir", default=str(REPO / "benchmark" / "kernels" / "results"))
    return p.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(REPO / "sgl-kernel"))
sys.path.insert(0, str(REPO / "benchmark" / "kernels"))

import torch  # noqa: E402

from sglang.bench_plot import import_pyplot  # noqa: E402
from tqdm import tqdm  # noqa: E402

from sgl_kernel.fp8_gemm import (  # noqa: E402
    Fp8GemmConfig, fixed_gemm_config, fp8_block_gemm, fp8_block_linear, fp8_block_linear_ref, get_gemm_config,
    heuristic_gemm_config)
from sgl_kernel.fp8_quant import block_dequant, per_token_group_quant_fp8  # noqa: E402
from timing import chain_graph_ms, cuda_graph, median_ms, rotations  # noqa: E402

BLOCK = (128, 128)
FP8 = torch.float8_e4m3fn
CEILINGS: dict = {}  # (N, K, M) -> (torch._scaled_mm ms, bf16 matmul ms)


def dummy_fp8_weight(n: int, k: int, device: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    codes = (torch.randn(n, k, generator=gen, device=device) * 64).clamp_(-448, 448).to(FP8)
    scales = torch.rand(-(-n // 128), -(-k // 128), generator=gen, device=device) * 1e-4 + 5e-5
    return codes, scales


def copy_gbps(device: str) -> float:
    numel = (1 << 20) if ARGS.smoke else (1 << 30)
    src = torch.empty(numel, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, ARGS.repeats)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def scaled_mm_ms(m: int, n: int, k: int, device: str) -> float | None:
    if device != "cuda":
        return None
    mp = max(16, -(-m // 16) * 16)
    a = torch.randn(mp, k, device=device).to(FP8)
    b = torch.randn(n, k, device=device).to(FP8).t()  # column-major [K, N], as _scaled_mm wants
    one = torch.ones((), device=device)
    return median_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                     device, ARGS.repeats)


def chain_rows(m: int, n: int, k: int, x: torch.Tensor, cfg: Fp8GemmConfig | None, device: str, gen) -> dict:
    """Decode M: ours, torch._scaled_mm and the bf16 matmul each timed per call in one CUDA graph of
    calls over rotating weights (timing.chain_graph_ms): what a decode step pays per projection."""
    if device != "cuda":
        return {}
    sets = [dummy_fp8_weight(n, k, device, gen) for _ in range(rotations(n * k))]
    mp = max(16, -(-m // 16) * 16)
    a = torch.randn(mp, k, device=device).to(FP8)
    one = torch.ones((), device=device)
    ours = chain_graph_ms([lambda w=w, s=s: fp8_block_linear(x, w, s, BLOCK, config=cfg) for w, s in sets],
                          device, ARGS.repeats)
    smm = chain_graph_ms([lambda w=w: torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                          for w, _ in sets], device, ARGS.repeats)
    del sets
    bf = [torch.randn(n, k, device=device, dtype=x.dtype) for _ in range(rotations(2 * n * k))]
    bf16 = chain_graph_ms([lambda b=b: x @ b.t() for b in bf], device, ARGS.repeats)
    return dict(chain_ms=ours, scaled_mm_chain_ms=smm, bf16_chain_ms=bf16)


def graph_ms(fn, device: str) -> tuple[float | None, bool | None]:
    if device != "cuda":
        return None, None
    g, out, g_out = cuda_graph(fn)
    g.replay()
    torch.cuda.synchronize()
    return median_ms(g.replay, device, ARGS.repeats), bool(torch.equal(g_out, out))


def run(name: str, n: int, k: int, m: int, device: str, gen, copy: float, cfg: Fp8GemmConfig | None) -> dict:
    w, s = dummy_fp8_weight(n, k, device, gen)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16 if device == "cuda" else torch.float32)
    out = fp8_block_linear(x, w, s, BLOCK, config=cfg)
    ref = fp8_block_linear_ref(x, w, s, BLOCK)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    fn = lambda: fp8_block_linear(x, w, s, BLOCK, config=cfg)  # noqa: E731
    ms = median_ms(fn, device, ARGS.repeats)
    used = cfg or get_gemm_config(m, n, k, BLOCK, device)
    row = dict(shape=name, n=n, k=k, m=m, config=list(vars(used).values()), rel_err=err, ms=ms)
    if m <= 64:
        row["graph_ms"], row["graph_equals_eager"] = graph_ms(fn, device)
        row.update(chain_rows(m, n, k, x, cfg, device, gen))
    t = row.get("chain_ms") or row.get("graph_ms") or ms
    wbytes = n * k + 4 * s.numel()
    row["weight_gbps"] = wbytes / t / 1e6
    row["copy_frac"] = row["weight_gbps"] / copy
    row["tflops"] = 2 * m * n * k / t / 1e9
    if (n, k, m) not in CEILINGS:  # once per case: the sweep's rows share them
        wb = block_dequant(w, s, BLOCK, x.dtype)
        CEILINGS[n, k, m] = scaled_mm_ms(m, n, k, device), median_ms(lambda: x @ wb.t(), device, ARGS.repeats)
        del wb
    sm, row["bf16_matmul_ms"] = CEILINGS[n, k, m]
    if sm is not None:
        row["scaled_mm_ms"] = sm
        row["scaled_mm_tflops"] = 2 * max(m, 16) * n * k / sm / 1e9
        row["scaled_mm_frac"] = row["tflops"] / row["scaled_mm_tflops"]
    if used.prequant:
        q, qs = per_token_group_quant_fp8(x, BLOCK[1])
        row["gemm_only_ms"] = median_ms(lambda: fp8_block_gemm(q, qs, w, s, BLOCK, x.dtype, config=used), device,
                                        ARGS.repeats)
        if sm is not None:
            row["gemm_only_scaled_mm_frac"] = 2 * m * n * k / row["gemm_only_ms"] / 1e9 / row["scaled_mm_tflops"]
    row["speedup_vs_bf16"] = row["bf16_matmul_ms"] / t
    if "chain_ms" in row:  # decode: the in-chain times side by side
        row["speedup_vs_bf16"] = row["bf16_chain_ms"] / t
        row["scaled_mm_chain_copy_frac"] = wbytes / row["scaled_mm_chain_ms"] / 1e6 / copy
        row["scaled_mm_frac"] = row["scaled_mm_chain_ms"] / t  # same bytes: a time ratio (its M is padded to 16)
    return row


def batch_invariance(device: str, gen) -> bool:
    w, s = dummy_fp8_weight(512, 1024, device, gen)
    x = torch.randn(96, 1024, generator=gen, device=device)
    cfg = fixed_gemm_config(BLOCK)
    full = fp8_block_linear(x, w, s, BLOCK, config=cfg)
    return all(torch.equal(fp8_block_linear(x[:r], w, s, BLOCK, config=cfg), full[:r]) for r in (1, 7, 64))


def plot(result: dict, path: Path) -> None:
    plt = import_pyplot(path)
    if plt is None:
        return
    rows = [r for r in result["rows"] if not r.get("sweep")]
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 4))
    for m in sorted({r["m"] for r in rows}):
        sel = [r for r in rows if r["m"] == m]
        key = "copy_frac" if m <= 64 else "scaled_mm_frac"
        ax = a0 if m <= 64 else a1
        ax.plot([r["shape"] for r in sel], [r.get(key) or 0 for r in sel], "o-", label=f"M={m}")
    a0.set_title("M <= 64: weight GB/s / copy GB/s")
    a1.set_title("M = 4096: TFLOP/s / torch._scaled_mm")
    for ax in (a0, a1):
        ax.axhline(0.7, ls="--", c="gray")
        ax.tick_params(axis="x", rotation=30)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def sweep_configs(m: int, n: int, k: int) -> list[tuple[str, Fp8GemmConfig]]:
    """--sweep: the heuristic's and the deterministic config, and at split-K the heuristic with the
    separate reduction kernel (what the serial reduction saves)."""
    heur = heuristic_gemm_config(m, n, k, BLOCK)
    out = [("heuristic", heur), ("fixed", fixed_gemm_config(BLOCK))]
    if heur.split_k > 1:
        out.append(("two-kernel split-K", dataclasses.replace(heur, serial_reduce=False)))
    return out


def main() -> int:
    device = "cpu" if ARGS.smoke else "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    ms = [int(v) for v in (ARGS.ms or ("1,20" if ARGS.smoke else "1,64,4096")).split(",")]
    shapes = SMOKE_SHAPES if ARGS.smoke else V32_SHAPES
    copy = copy_gbps(device)
    rows = []
    jobs = [(s, m, None, False) for s in shapes for m in ms]
    if ARGS.sweep:
        jobs += [(s, m, c, tag) for s in shapes for m in ms
                 for tag, c in sweep_configs(m, s[1], s[2])]
    for (name, n, k), m, cfg, sweep in tqdm(jobs, desc="fp8 gemm"):
        row = run(name, n, k, m, device, gen, copy, cfg)
        row["sweep"] = sweep
        rows.append(row)
    result = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
                  copy_gbps=copy, batch_invariant_fixed_config=batch_invariance(device, gen), rows=rows)
    out = Path(ARGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"fp8_gemm_{'cpu' if ARGS.smoke else 'cuda'}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, stem.with_suffix(".png"))
    print(f"device {result['device']}, copy {copy:.0f} GB/s, batch invariant (fixed config) "
          f"{result['batch_invariant_fixed_config']}")
    print(f"{'shape':16} {'M':>5} {'config':34} {'rel err':>8} {'ms':>8} {'graph':>8} {'chain':>8} {'wGB/s':>7} {'%copy':>6} "
          f"{'TFLOP/s':>8} {'%smm':>6} {'%smm-q':>6} {'x bf16':>6}")
    for r in rows:
        print(f"{r['shape']:16} {r['m']:5d} {str(r['config']):34} {r['rel_err']:8.1e} {r['ms']:8.4f} "
              f"{r.get('graph_ms') or float('nan'):8.4f} {r.get('chain_ms') or float('nan'):8.4f} {r['weight_gbps']:7.0f} {100 * r['copy_frac']:6.1f} "
              f"{r['tflops']:8.1f} {100 * (r.get('scaled_mm_frac') or float('nan')):6.1f} "
              f"{100 * (r.get('gemm_only_scaled_mm_frac') or float('nan')):6.1f} "
              f"{r['speedup_vs_bf16']:6.2f}{'  (' + r['sweep'] + ')' if r['sweep'] else ''}")
    ok = result["batch_invariant_fixed_config"] and all(r["rel_err"] < 2e-2 for r in rows)
    ok = ok and all(r.get("graph_equals_eager", True) is not False for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
