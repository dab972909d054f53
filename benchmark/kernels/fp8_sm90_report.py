"""Compile the FP8 kernels for Hopper (sm_90a) on any machine, no GPU: registers, spills, shared memory,
software pipelining and MMA kind per config (Triton's own compiler and ptxas, as a GPU run would).

    python benchmark/kernels/fp8_sm90_report.py --out-dir /tmp/r              # heuristics + fixed + tuner candidates
    python benchmark/kernels/fp8_sm90_report.py --heuristics-only --out-dir /tmp/r

Each config is compiled with the specialisation a V3.2-shaped launch gets (16-byte aligned pointers,
sizes and row strides divisible by 16). A config is `bad` when ptxas spills, its shared memory exceeds
the 227 KB a Hopper block may use, or its K loop is not pipelined (no async copies: every K step
would wait on its loads). The heuristic and deterministic configs must not be bad (exit code 1);
tuner candidates that are bad are reported (they only lose the sweep). JSON under --out-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, do not interpret (set before triton is imported)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "sgl-kernel"))
sys.path.insert(0, str(REPO / "benchmark" / "kernels"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from tqdm import tqdm  # noqa: E402

from sgl_kernel import fp8_gemm, fp8_moe  # noqa: E402

BLOCK = (128, 128)
SMEM_LIMIT = 227 * 1024
GEMM_SHAPES = [(2112, 7168), (7168, 2048)]  # V3.2 fused_qkv_a, o_proj (tp 8)
MOE = dict(experts=(256, 32), top_k=8)


def ptxas_path() -> str | None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(90).path
    except Exception:  # noqa: BLE001 -- no CUDA backend in this triton build
        return None


def compile_report(fn, types: dict, consts: dict, warps: int, stages: int, div16: set) -> dict:
    sig = {k: types.get(k, "constexpr") for k in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(fn.arg_names) if k in div16}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(k.asm["ptx"])
        r = subprocess.run([ptxas_path(), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(d) / "k.o")],
                           capture_output=True, text=True)
    log = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    return dict(regs=int(regs.group(1)) if regs else None, spill_bytes=int(spill.group(1)) if spill else None,
                smem=k.metadata.shared, pipelined=("async_copy" in ttgir) or ("async_tma" in ttgir),
                mma="wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none")


_GEMM_T = {"X": "*fp8e4nv", "XS": "*fp32", "W": "*fp8e4nv", "WS": "*fp32", "Y": "*bf16", "P": "*fp32", "BIAS": "*bf16",
           "LOCKS": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_xsm": "i32", "stride_wn": "i32",
           "stride_wsn": "i32", "stride_ym": "i32", "stride_ps": "i32", "stride_pm": "i32", "SPLIT_K": "i32"}
_GEMM_DIV = {"X", "XS", "W", "WS", "Y", "P", "BIAS", "LOCKS", "M", "N", "K", "stride_xm", "stride_wn", "stride_ym", "stride_ps",
             "stride_pm"}


def gemm(cfg: fp8_gemm.Fp8GemmConfig) -> dict:
    bn, bk = BLOCK
    if cfg.tma:
        types = {"a_desc": f"tensordesc<fp8e4nv[{cfg.block_m}, {bk}]>", "b_desc": f"tensordesc<fp8e4nv[{cfg.block_n}, {bk}]>",
                 "XS": "*fp32", "WS": "*fp32", "Y": "*bf16", "BIAS": "*bf16", "M": "i32", "N": "i32", "K": "i32",
                 "stride_xsm": "i32", "stride_wsn": "i32", "stride_ym": "i32"}
        consts = dict(BN=bn, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m, HAS_BIAS=False)
        stages = fp8_gemm.fit_stages(cfg.num_stages, (cfg.block_m + cfg.block_n) * bk)
        return compile_report(fp8_gemm._w8a8_tma_kernel, types, consts, cfg.num_warps, stages,
                              {"XS", "WS", "Y", "BIAS", "M", "N", "K", "stride_ym"})
    mode = 2 if cfg.prequant else 1
    types = dict(_GEMM_T, X="*fp8e4nv" if mode == 2 else "*bf16")
    consts = dict(BN=bn, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m,
                  PARTIAL=cfg.split_k > 1, SERIAL=cfg.split_k > 1 and cfg.serial_reduce, A_MODE=mode, EVEN_K=True, HAS_BIAS=False, EPS=1e-10, PRECISION="tf32")
    stages = fp8_gemm.fit_stages(cfg.num_stages, (cfg.block_m * (1 if mode == 2 else 2) + cfg.block_n) * bk)
    return compile_report(fp8_gemm._w8_block_gemm_kernel, types, consts, cfg.num_warps, stages, _GEMM_DIV)


def moe(cfg: fp8_moe.Fp8MoEConfig) -> dict:
    bn, bk = BLOCK
    common = dict(BN=bn, BLOCK_M=cfg.block_m, BLOCK_K=bk, GROUP_M=cfg.group_m, A_FP8=True, EVEN_K=True, PRECISION="tf32")
    up_t = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
            "out_ptr": "*u8" if cfg.up_n == bk else "*bf16", "outs_ptr": "*fp32", "hd_ptr": "*bf16", "sorted_ptr": "*i32",
            "expert_ptr": "*i32", "npp_ptr": "*i32", "num_valid": "i32", "top_k": "i32", "K": "i32", "N": "i32",
            "num_pid_m": "i32", "stride_xm": "i32", "stride_xsm": "i32", "stride_we": "i32", "stride_wn": "i32",
            "stride_wse": "i32", "stride_wsn": "i32", "stride_om": "i32", "stride_osm": "i32"}
    dn_t = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "out_ptr": "*bf16",
            "weight_ptr": "*fp32", "sorted_ptr": "*i32", "expert_ptr": "*i32", "npp_ptr": "*i32", "num_valid": "i32",
            "K": "i32", "N": "i32", "num_pid_m": "i32", "stride_am": "i32", "stride_asm": "i32", "stride_we": "i32",
            "stride_wn": "i32", "stride_wse": "i32", "stride_wsn": "i32", "stride_om": "i32"}
    ptrs = lambda t: {k for k in t if k.endswith("_ptr")}  # noqa: E731
    up = compile_report(fp8_moe._gate_up_fp8_kernel, up_t, dict(common, BLOCK_N=cfg.up_n, OUT_FP8=cfg.up_n == bk,
                                                                    EPS=1e-10), cfg.up_warps,
                        fp8_moe.fit_stages(cfg.up_stages, (cfg.block_m + 2 * cfg.up_n) * bk),
                        ptrs(up_t) | {"K", "N", "stride_xm", "stride_we", "stride_wn", "stride_om"})
    down = compile_report(fp8_moe._down_fp8_kernel, dn_t, dict(common, BLOCK_N=cfg.down_n), cfg.down_warps,
                          fp8_moe.fit_stages(cfg.down_stages, (cfg.block_m + cfg.down_n) * bk),
                          ptrs(dn_t) | {"K", "N", "stride_am", "stride_we", "stride_wn", "stride_om"})
    return {"gate_up": up, "down": down}


def is_bad(rep: dict) -> bool:
    parts = rep.values() if "gate_up" in rep else [rep]
    return any(p["spill_bytes"] or p["smem"] > SMEM_LIMIT or not p["pipelined"] for p in parts)


def configs(heuristics_only: bool) -> list[tuple[str, str, object]]:
    out = []
    for m in (1, 16, 64, 256, 1024, 4096):
        for n, k in GEMM_SHAPES:
            out.append(("gemm", f"heuristic M={m} N={n} K={k}", fp8_gemm.heuristic_gemm_config(m, n, k, BLOCK)))
        for e in MOE["experts"]:  # E 32: an EP rank's experts, up to 1024 rows per expert at 4K tokens
            out.append(("moe", f"heuristic E={e} T={m}", fp8_moe.heuristic_fp8_moe_config(m, MOE["top_k"], e, BLOCK)))
    out += [("gemm", "fixed", fp8_gemm.fixed_gemm_config(BLOCK)), ("moe", "fixed", fp8_moe.fixed_fp8_moe_config(BLOCK))]
    if not heuristics_only:
        import tune_fp8  # noqa: F401 -- its candidate lists (argparse: it parses no argv of ours)

        for bucket, cands in tune_fp8.GEMM_CANDIDATES.items():
            out += [("gemm", f"candidate {bucket}", fp8_gemm.Fp8GemmConfig(*c)) for c in cands]
        for bm in (16, 32, 64):
            out += [("moe", "candidate", tune_fp8.moe_config(bm, up, tune_fp8.MOE_DOWN[0])) for up in tune_fp8.MOE_UP]
            out += [("moe", "candidate", tune_fp8.moe_config(bm, tune_fp8.MOE_UP[0], d)) for d in tune_fp8.MOE_DOWN[1:]]
    seen, uniq = set(), []
    for kind, label, cfg in out:  # one compile per distinct config (heuristic buckets repeat)
        if (kind, cfg) not in seen:
            seen.add((kind, cfg))
            uniq.append((kind, label, cfg))
    return uniq


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heuristics-only", action="store_true")
    p.add_argument("--out-dir", default=str(REPO / "benchmark" / "kernels" / "results"))
    args = p.parse_args()
    if ptxas_path() is None or not Path(ptxas_path()).exists():
        print("no ptxas in this triton build: nothing to report")
        return 2
    sys.argv = sys.argv[:1]  # tune_fp8 parses its own argv at import
    rows = []
    for kind, label, cfg in tqdm(configs(args.heuristics_only), desc="sm_90a compiles"):
        rep = gemm(cfg) if kind == "gemm" else moe(cfg)
        rows.append(dict(kind=kind, label=label, config=cfg.to_json(), report=rep, bad=is_bad(rep)))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_sm90_report.json").write_text(json.dumps(dict(triton=triton.__version__, rows=rows), indent=1))
    for r in rows:
        parts = r["report"].items() if r["kind"] == "moe" else [("", r["report"])]
        desc = "; ".join(f"{name} regs {p['regs']} spill {p['spill_bytes']} smem {p['smem'] // 1024}K "
                         f"{'pipelined' if p['pipelined'] else 'NOT pipelined'} {p['mma']}" for name, p in parts)
        print(f"{'BAD ' if r['bad'] else 'ok  '}{r['kind']:4} {r['label']:28} {list(r['config'].values())}: {desc}")
    bad_defaults = [r for r in rows if r["bad"] and not r["label"].startswith("candidate")]
    return 1 if bad_defaults else 0


if __name__ == "__main__":
    sys.exit(main())
