"""Tune the FP8 kernels' tile configs on this device and write its tables (issue 30, item 2).

    python benchmark/kernels/tune_fp8.py --out-dir $OUT            # GPU: <= ~400 s on an H100
    python benchmark/kernels/tune_fp8.py --smoke --out-dir /tmp/t  # CPU interpreter, tiny shapes, 2 configs

Cases: the W8A8 GEMM at DeepSeek-V3.2's and GLM-5's projection shapes (per GPU at --tp-size 8) x M in
1, 16, 64, 256, 1024, 4096; the FP8 fused MoE (E 256, top 8, H 7168, I 2048; and EP-local E 32: ids
over 256 experts, 32 of them here) x tokens in the same buckets. Per case a few candidates, the
heuristic's config first (so an entry is never slower than no table); each is checked against the
torch twin (computed once per case: rel err < 2e-2, no NaN) and timed -- decode-sized GEMMs per call
in one CUDA graph of calls over weights rotating past the L2 (how a decode step runs them), decode MoE
as CUDA-graph replays, else eager; do_bench's median. The MoE is tuned in two steps
(block_m x gate-up tile with the default down tile, then the down tile). The fastest per case goes to
`fp8_{gemm,moe}_<device>.json` in --config-dir (default sgl-kernel/sgl_kernel/configs; --smoke: the
out dir only) and a copy under --out-dir, with every timing in tune_fp8_<device>.json and a plot
(skipped without matplotlib). --budget-s stops starting new cases (the ones left keep the heuristic).
Every candidate compiles for sm_90a without spills and with a pipelined K loop
(benchmark/kernels/fp8_sm90_report.py checks that on CPU: run it after editing the lists below).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the M / token buckets, the goal sizes (1, 64, 4096) first: a budget cut drops the others
BUCKETS = [1, 64, 4096, 16, 256, 1024]
# (name, N, K) per GPU at --tp-size 8 (column shards split N, row shards split K; q_a / kv_a, the
# indexer's wq_b and the shared expert are replicated)
V32_GEMM = [("v32 fused_qkv_a", 2112, 7168), ("v32 q_b", 3072, 1536), ("v32 o_proj", 7168, 2048),
            ("v32 indexer wq_b", 8192, 1536), ("v32 shared gate_up", 4096, 7168), ("v32 shared down", 7168, 2048)]
GLM5_GEMM = [("glm5 fused_qkv_a", 2624, 6144), ("glm5 q_b", 2048, 2048), ("glm5 o_proj", 6144, 2048),
             ("glm5 indexer wq_b", 4096, 2048), ("glm5 shared gate_up", 4096, 6144), ("glm5 shared down", 6144, 2048)]
V32_MOE = [dict(experts=256, routed=256, hidden=7168, inter=2048, top_k=8),
           dict(experts=32, routed=256, hidden=7168, inter=2048, top_k=8)]  # EP 8: 32 local of 256
SMOKE_GEMM = [("tiny", 200, 256)]
SMOKE_MOE = [dict(experts=8, routed=8, hidden=256, inter=128, top_k=2),
             dict(experts=4, routed=8, hidden=256, inter=128, top_k=2)]
# Fp8GemmConfig fields: (block_m, block_n, split_k, group_m, num_warps, num_stages, prequant[, tma])
GEMM_CANDIDATES = {
    # decode M: enough programs streaming the weight (split-K is a run-time argument: no extra compile)
    1: [(16, 64, 1, 1, 4, 6, False), (16, 64, 4, 1, 4, 4, False), (16, 64, 8, 1, 4, 4, False),
        (16, 128, 4, 1, 4, 4, False), (16, 32, 4, 1, 4, 6, False), (16, 64, 4, 1, 4, 4, True)],
    64: [(64, 64, 1, 1, 4, 4, False), (32, 64, 2, 1, 4, 4, False), (64, 128, 1, 1, 4, 4, True),
         (16, 64, 4, 1, 4, 4, False), (32, 128, 1, 1, 4, 4, True)],
    256: [(64, 128, 1, 8, 4, 4, True), (128, 128, 1, 8, 8, 4, True), (64, 64, 1, 8, 4, 4, True),
          (64, 128, 2, 8, 4, 4, True), (64, 128, 1, 8, 4, 4, True, True)],
    4096: [(128, 128, 1, 8, 8, 4, True), (128, 128, 1, 8, 8, 4, True, True), (128, 128, 1, 8, 8, 3, True),
           (128, 64, 1, 8, 4, 4, True), (64, 256, 1, 8, 8, 4, True, True), (64, 128, 1, 8, 4, 4, True)],
}
# Fp8MoEConfig: gate-up (up_n, up_warps, up_stages), down (down_n, down_warps, down_stages)
MOE_UP = [(128, 4, 4), (128, 8, 3), (128, 4, 3), (64, 4, 4)]
MOE_DOWN = [(128, 4, 4), (64, 4, 5), (128, 8, 3), (256, 8, 3)]  # 256 at 128 rows would spill: not offered


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1, 2 configs")
    p.add_argument("--only", choices=["gemm", "moe"], default=None)
    p.add_argument("--budget-s", type=float, default=400.0, help="no new case starts after this many seconds")
    p.add_argument("--repeats", type=int, default=1, help="CPU repeats (GPU: do_bench's median)")
    p.add_argument("--out-dir", default=str(REPO / "benchmark" / "kernels" / "results"))
    p.add_argument("--config-dir", default=None, help="where the kernels read tables (default: the package's)")
    return p.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(REPO / "sgl-kernel"))
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "benchmark" / "kernels"))

import torch  # noqa: E402
import triton  # noqa: E402

from sglang.bench_plot import import_pyplot  # noqa: E402
from tqdm import tqdm  # noqa: E402

from sgl_kernel import fp8_tables  # noqa: E402
from sgl_kernel.fp8_gemm import Fp8GemmConfig, fp8_block_linear, fp8_block_linear_ref, gemm_shape_key, \
    heuristic_gemm_config  # noqa: E402
from sgl_kernel.fp8_moe import Fp8MoEConfig, fused_experts_fp8, heuristic_fp8_moe_config, moe_shape_key  # noqa: E402
from timing import chain_graph_ms, cuda_graph, median_ms, rotations  # noqa: E402

BLOCK = (128, 128)
FP8 = torch.float8_e4m3fn
T0 = time.monotonic()


def over_budget(share: float = 1.0) -> bool:
    return time.monotonic() - T0 > ARGS.budget_s * share


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.isnan().any():
        return float("inf")
    den = ref.float().norm().item()
    num = (out.float() - ref.float()).norm().item()
    return num / den if den else num


def time_fn(fn, device: str, graph: bool) -> float:
    if device == "cuda" and graph:
        g, _, _ = cuda_graph(fn)
        g.replay()
        torch.cuda.synchronize()
        ms = median_ms(g.replay, device, ARGS.repeats, gpu_rep_ms=40)
        del g
        return ms
    return median_ms(fn, device, ARGS.repeats, gpu_rep_ms=40)


def fp8_codes(shape: tuple[int, ...], device: str, gen) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=device) * 64).clamp_(-448, 448).to(FP8)


def block_scales(n: int, k: int, device: str, gen, lead: tuple[int, ...] = ()) -> torch.Tensor:
    return torch.rand(*lead, -(-n // 128), -(-k // 128), generator=gen, device=device) * 1e-4 + 5e-5


def try_candidates(cands: list, run, check) -> list[dict]:
    """Each candidate: checked, then timed; a compile failure (e.g. out of shared memory) or a wrong
    result is recorded and skipped."""
    rows = []
    for cfg in cands:
        row = {"config": cfg.to_json()}
        try:
            row["rel_err"] = check(cfg)
            if row["rel_err"] < 2e-2:
                row["ms"] = run(cfg)
            else:
                row["error"] = "does not match the twin"
        except Exception as e:  # noqa: BLE001 -- a candidate that cannot run is a result, not a crash
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    return rows


def dedup(cands: list) -> list:
    out = []
    for c in cands:
        if c not in out:
            out.append(c)
    return out


def gemm_candidates(m: int, n: int, k: int) -> list[Fp8GemmConfig]:
    bucket = 1 if m <= 16 else 64 if m <= 64 else 256 if m <= 512 else 4096
    cands = [heuristic_gemm_config(m, n, k, BLOCK)] + [Fp8GemmConfig(*c) for c in GEMM_CANDIDATES[bucket]]
    cands = dedup(cands)
    return cands[:2] if ARGS.smoke else cands


def tune_gemm(shapes: list, device: str, dt: torch.dtype, gen, report: list, table: dict, share: float) -> dict:
    """M outermost (BUCKETS' order): what the budget share cuts is the less used buckets."""
    ms = [1, 20] if ARGS.smoke else BUCKETS
    weights = {(n, k): (fp8_codes((n, k), device, gen), block_scales(n, k, device, gen)) for _, n, k in shapes}
    for m, (name, n, k) in tqdm([(m, sh) for m in ms for sh in shapes], desc="fp8 gemm"):
        if over_budget(share):
            break
        w, s = weights[n, k]
        x = torch.randn(m, k, generator=gen, device=device).to(dt)
        ref = fp8_block_linear_ref(x, w, s, BLOCK)
        if m <= 64 and device == "cuda":  # decode: per call in a graph over weights rotating past the L2
            sets = [(w, s)] + [(fp8_codes((n, k), device, gen), s) for _ in range(rotations(n * k) - 1)]

            def run(cfg, x=x, sets=sets):
                calls = [lambda w=w, s=s: fp8_block_linear(x, w, s, BLOCK, config=cfg) for w, s in sets]
                return chain_graph_ms(calls, device, ARGS.repeats)
        else:
            def run(cfg, x=x, w=w, s=s):
                return time_fn(lambda: fp8_block_linear(x, w, s, BLOCK, config=cfg), device, False)
        rows = try_candidates(
            gemm_candidates(m, n, k), run=run,
            check=lambda cfg: rel_err(fp8_block_linear(x, w, s, BLOCK, config=cfg), ref))
        best = pick(rows)
        report.append(dict(kind="fp8_gemm", shape=name, n=n, k=k, m=m, candidates=rows, best=best))
        if best is not None:
            table.setdefault(gemm_shape_key(n, k), {})[str(m)] = rows[best]["config"]
    return table


def pick(rows: list[dict]) -> int | None:
    timed = [i for i, r in enumerate(rows) if "ms" in r]
    return min(timed, key=lambda i: rows[i]["ms"]) if timed else None


def moe_weights(shape: dict, device: str, gen) -> dict:
    e, h, i = shape["experts"], shape["hidden"], shape["inter"]
    w13 = torch.empty(e, 2 * i, h, dtype=FP8, device=device)
    w2 = torch.empty(e, h, i, dtype=FP8, device=device)
    for j in range(e):  # one expert at a time: no fp32 copy of all experts
        w13[j] = fp8_codes((2 * i, h), device, gen)
        w2[j] = fp8_codes((h, i), device, gen)
    return dict(w13=w13, w2=w2, s13=block_scales(2 * i, h, device, gen, (e,)), s2=block_scales(h, i, device, gen, (e,)))


def moe_config(block_m: int, up: tuple, down: tuple) -> Fp8MoEConfig:
    return Fp8MoEConfig(block_m, *up, *down, group_m=1 if block_m <= 16 else 8)


def moe_block_ms(t: int, shape: dict) -> list[int]:
    avg = t * shape["top_k"] / shape["routed"]  # assignments per expert (EP-local: of the local ones)
    # 128 rows: the gate-up kernel spills at 128 x 128 (ptxas for sm_90a), see heuristic_fp8_moe_config
    return [16] if avg <= 4 else [16, 32] if avg <= 16 else [32, 64] if avg <= 64 else [64]


def tune_moe(device: str, dt: torch.dtype, gen, report: list, share: float) -> dict:
    from sglang.srt.layers.moe.fused_moe_native import fused_experts_fp8_native

    table: dict = {}
    shapes = SMOKE_MOE if ARGS.smoke else V32_MOE
    tokens = [1, 9] if ARGS.smoke else BUCKETS
    full = moe_weights(dict(shapes[0]), device, gen)  # the EP-local case uses its first experts
    for shape in shapes:
        w = {key: v[: shape["experts"]] for key, v in full.items()}
        key = moe_shape_key(shape["experts"], shape["hidden"], shape["inter"], shape["top_k"])
        for t in tqdm(tokens, desc=f"fp8 moe E={shape['experts']}"):
            if over_budget(share):
                break
            x = torch.randn(t, shape["hidden"], generator=gen, device=device).to(dt)
            scores = torch.rand(t, shape["routed"], generator=gen, device=device)
            ids = scores.topk(shape["top_k"], dim=1).indices.to(torch.int32)
            tw = torch.rand(t, shape["top_k"], generator=gen, device=device)
            n_chk = min(t, 8)
            args = (w["w13"], w["s13"], w["w2"], w["s2"])
            ref = fused_experts_fp8_native(x[:n_chk], *args, tw[:n_chk], ids[:n_chk], 0, BLOCK)

            def call(cfg, x=x, tw=tw, ids=ids):
                return fused_experts_fp8(x, *args, tw, ids, 0, BLOCK, config=cfg)

            def run(cfg, t=t, call=call):
                return time_fn(lambda: call(cfg), device, t <= 64)

            def check(cfg, n_chk=n_chk, ref=ref, call=call):
                return rel_err(call(cfg)[:n_chk], ref)

            heur = heuristic_fp8_moe_config(t, shape["top_k"], shape["experts"], BLOCK)
            step1 = [heur] + [moe_config(bm, up, MOE_DOWN[0]) for bm in moe_block_ms(t, shape) for up in MOE_UP]
            step1 = dedup(step1)[:2] if ARGS.smoke else dedup(step1)
            rows = try_candidates(step1, run, check)
            best = pick(rows)
            if best is not None and not ARGS.smoke and not over_budget(share):
                b = Fp8MoEConfig(**rows[best]["config"])
                up = (b.up_n, b.up_warps, b.up_stages)
                step2 = [c for c in dedup([moe_config(b.block_m, up, d) for d in MOE_DOWN]) if c.to_json() not in
                         [r["config"] for r in rows]]
                rows += try_candidates(step2, run, check)
                best = pick(rows)
            report.append(dict(kind="fp8_moe", shape=key, tokens=t, candidates=rows, best=best))
            if best is not None:
                table.setdefault(key, {})[str(t)] = rows[best]["config"]
    return table


def write_table(kind: str, configs: dict, device_key: str, dirs: list[Path]) -> list[Path]:
    body = dict(kind=kind, device=device_key, block=list(BLOCK), triton=triton.__version__, torch=torch.__version__,
                generated_by="benchmark/kernels/tune_fp8.py", configs=configs)
    paths = []
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        path = d / fp8_tables.table_file(kind, device_key)
        path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
        paths.append(path)
    return paths


def plot(report: list, path: Path) -> None:
    plt = import_pyplot(path)
    if plt is None:
        return
    rows = [r for r in report if r["best"] is not None and "ms" in r["candidates"][0]]
    labels = [f"{r['shape']} {r.get('m', r.get('tokens'))}" for r in rows]
    speed = [r["candidates"][0]["ms"] / r["candidates"][r["best"]]["ms"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.18), 4))
    ax.bar(range(len(rows)), speed)
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=5)
    ax.axhline(1.0, ls="--", c="gray")
    ax.set_ylabel("heuristic time / tuned time")
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    device = "cpu" if ARGS.smoke else "cuda"
    dt = torch.float32 if ARGS.smoke else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    dev_key = fp8_tables.device_name(device)
    out = Path(ARGS.out_dir)
    dirs = [out] if ARGS.smoke and ARGS.config_dir is None else [
        Path(ARGS.config_dir) if ARGS.config_dir else Path(fp8_tables.CONFIG_DIR), out]
    report: list = []
    written = []
    gemm: dict = {}
    # V3.2's GEMMs (until 40% of the budget), its MoE (until 85%), then GLM-5's GEMMs: what the
    # budget leaves out keeps the heuristic
    both = ARGS.only is None
    if ARGS.only in (None, "gemm"):
        tune_gemm(SMOKE_GEMM if ARGS.smoke else V32_GEMM, device, dt, gen, report, gemm, 0.4 if both else 0.7)
    if ARGS.only in (None, "moe"):
        written += write_table("fp8_moe", tune_moe(device, dt, gen, report, 0.85 if both else 1.0), dev_key, dirs)
        if device == "cuda":
            torch.cuda.empty_cache()  # the MoE's 11 GB of experts
    if ARGS.only in (None, "gemm"):
        if not ARGS.smoke:
            tune_gemm(GLM5_GEMM, device, dt, gen, report, gemm, 1.0)
        written += write_table("fp8_gemm", gemm, dev_key, dirs)
    fp8_tables.clear_cache()
    elapsed = time.monotonic() - T0
    summary = dict(device=dev_key, elapsed_s=elapsed, budget_s=ARGS.budget_s, tables=[str(p) for p in written],
                   cases=report)
    stem = out / f"tune_fp8_{dev_key}"
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    plot(report, stem.with_suffix(".png"))
    print(f"device {dev_key}: {len(report)} cases in {elapsed:.0f} s (budget {ARGS.budget_s:.0f} s); tables: "
          + ", ".join(str(p) for p in written))
    print(f"{'kind':8} {'shape':22} {'M/T':>5} {'heur ms':>9} {'best ms':>9} {'x':>5} best config")
    bad = 0
    for r in report:
        c = r["candidates"]
        ok = r["best"] is not None
        bad += not ok
        h = c[0].get("ms", float("nan"))
        b = c[r["best"]]["ms"] if ok else float("nan")
        print(f"{r['kind']:8} {r['shape']:22} {r.get('m', r.get('tokens')):5d} {h:9.4f} {b:9.4f} {h / b:5.2f} "
              f"{list(c[r['best']]['config'].values()) if ok else 'NONE: ' + str(c[0].get('error'))}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
