"""Compile every Triton kernel launch of the serving path for the H200 (sm_90) without a GPU.

Triton's interpreter never runs its compiler, so frontend errors, unsupported ops and tiles that
exceed Hopper's shared memory would first show on the device. This script runs the kernel
wrappers with real DeepSeek-V3.2 shapes (tiny token counts) while recording launches instead of
running them, then compiles each distinct launch to a cubin (ptxas ships with Triton) and checks
its shared memory against the per-block limit.

    TRITON_INTERPRET=0 python scripts/compile_sm90.py         # exits non-zero on any failure
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv", torch.bool: "i1"}
LAUNCH_OPTS = ("num_warps", "num_stages", "num_ctas")
launches: dict[tuple, tuple] = {}


def _record(self, *args, grid, warmup, **kwargs):
    names = self.arg_names
    opts = {k: kwargs.pop(k) for k in list(kwargs) if k in LAUNCH_OPTS}
    bound = dict(zip(names, args))
    bound.update(kwargs)
    sig, consts = {}, {}
    for i, name in enumerate(names):
        v = bound.get(name)
        if i in self.constexprs or (hasattr(self, "params") and self.params[i].is_constexpr):
            consts[name] = v
            sig[name] = "constexpr"
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i64" if abs(v) >= 2**31 else "i32"
        elif isinstance(v, float):
            sig[name] = "fp32"
        elif v is None:
            sig[name] = "constexpr"
            consts[name] = None
        else:
            raise TypeError(f"{self.fn.__name__}: cannot type argument {name}={v!r}")
    key = (self.fn.__name__, tuple(sorted(sig.items())), tuple(sorted((k, str(v)) for k, v in consts.items())),
           tuple(sorted(opts.items())))
    launches.setdefault(key, (self, sig, consts, opts))


def record_serving_launches() -> None:
    from sgl_kernel.indexer import index_scores, token_blocks
    from sgl_kernel.kv_store import store_index_k, store_mla_kv
    from sgl_kernel.moe import MoEConfig, fused_experts, get_moe_config, moe_align_block_size
    from sgl_kernel.mla_split import MLA_EXTEND, decode_split_keys, decode_tile
    from sgl_kernel.sparse_mla import mla_attention
    from sgl_kernel.topk import fast_topk

    bf = torch.bfloat16
    h, c, r, k_top, ctx = 128, 512, 64, 2048, 4096
    kv = torch.zeros(ctx + 64, 1, c + r, dtype=bf)
    kv_fp8 = torch.zeros(ctx + 64, c + 4 * (c // 128) + 2 * r, dtype=torch.uint8)  # DeepSeek's 656-byte rows
    r2t = torch.zeros(2, ctx, dtype=torch.int32)
    # the serving launches: decode at the backend's tile + split per batch (narrow, wide, deterministic), extend
    for t, inv in ((1, False), (16, False), (64, False), (1, True), (4, None)):
        q_lat, q_rope = torch.zeros(t, h, c, dtype=bf), torch.zeros(t, h, r, dtype=bf)
        ints = [torch.zeros(t, dtype=torch.long)] * 2
        topk = torch.zeros(t, k_top, dtype=torch.int32)
        split = 0 if inv is None else decode_split_keys(t, h, k_top, inv)
        tile = MLA_EXTEND if inv is None or not split else decode_tile(t, inv)
        for sparse, cache in ((topk, kv), (None, kv), (topk, kv_fp8)):
            mla_attention(q_lat, q_rope, cache, c, r2t, ints[0], ints[0], ints[1], sparse, 0.1,
                          split_keys=split, max_keys=k_top, **tile)
    store_mla_kv(kv, torch.zeros(3, dtype=torch.long), torch.zeros(3, c, dtype=bf), torch.zeros(3, r, dtype=bf))
    for data_dtype, row in ((torch.float8_e4m3fn, 64 * 132), (bf, 64 * 256)):
        buf = torch.zeros(8, row, dtype=torch.uint8)
        store_index_k(buf, torch.zeros(3, dtype=torch.long), torch.zeros(3, 128, dtype=bf), 64, data_dtype)
        for block_t in (1, 2):
            t = 4
            q, w = torch.zeros(t, 64, 128, dtype=bf), torch.zeros(t, 64)
            blocks = torch.tensor(token_blocks([0], [t], block_t), dtype=torch.int32)
            ints = torch.zeros(t, dtype=torch.long)
            index_scores(q, w, buf, 64, data_dtype, r2t, ints[:1], ints, ints, blocks, torch.zeros(t, ctx),
                         block_t=block_t, skip_below=k_top)
    for rows in (1, 64, 4096):
        fast_topk(torch.zeros(rows, ctx), torch.full((rows,), ctx, dtype=torch.int32), k_top)
    wide = 32768  # decode's split path (auto_split on a GPU), prefill's prefilter from 16K keys (topk_plan)
    fast_topk(torch.zeros(1, wide), torch.full((1,), wide, dtype=torch.int32), k_top, split=16)
    fast_topk(torch.zeros(4, wide), torch.full((4,), wide, dtype=torch.int32), k_top, prefilter=True)
    record_other_serving_launches()
    e, hid, inter, top = 8, 7168, 2048, 8
    w13, w2 = torch.zeros(e, 2 * inter, hid, dtype=bf), torch.zeros(e, hid, inter, dtype=bf)
    for t in (1, 64, 4096):  # decode, mid, prefill configs (the heuristic sees 256 experts)
        cfg = get_moe_config(t, top, 256, hid, inter, bf)
        x = torch.zeros(t, hid, dtype=bf)
        ids = torch.zeros(t, top, dtype=torch.int32)
        fused_experts(x, w13, w2, torch.zeros(t, top), ids, config=MoEConfig(**cfg.__dict__))
        moe_align_block_size(ids, 256, cfg.block_m)  # the real expert count


def record_other_serving_launches() -> None:
    """The dense short-prompt MHA (V3.2 heads / dims, the backend's tile), the FP8 KV store, the
    batch-invariant projections and RMSNorm (--enable-deterministic-inference, a decode row and a
    prefill block), the HiCache page-copy kernel (--hicache-io-backend kernel)."""
    from sgl_kernel import batch_invariant
    from sgl_kernel.kv_store import store_mla_kv
    from sgl_kernel.mha_prefill import mha_prefill
    from sgl_kernel.page_copy import copy_pages
    from sglang.srt.layers.attention.nsa.triton_backend import MHA_PREFILL

    bf = torch.bfloat16
    h, dn, dr, dv, t = 128, 128, 64, 128, 128
    mha_prefill(torch.zeros(t, h, dn, dtype=bf), torch.zeros(t, h, dr, dtype=bf), torch.zeros(t, h, dn, dtype=bf),
                torch.zeros(t, dr, dtype=bf), torch.zeros(t, h, dv, dtype=bf), torch.zeros(2, 3, dtype=torch.int32),
                torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.zeros(t, dtype=torch.long),
                0.1, torch.zeros(t, h, dv, dtype=bf), **MHA_PREFILL)
    store_mla_kv(torch.zeros(8, 1, 656, dtype=torch.uint8), torch.zeros(3, dtype=torch.long),
                 torch.zeros(3, 512, dtype=bf), torch.zeros(3, 64, dtype=bf))
    batch_invariant._num_sms = lambda device: 132  # the H100's / H200's split-K choice, not the CPU stand-in's
    for m in (1, 4096):
        for n, k in ((2112, 7168), (7168, 2048), (129280, 7168)):  # fused q_a / kv_a, o_proj (tp 8), lm_head
            batch_invariant.matmul(torch.zeros(m, k, dtype=bf), torch.zeros(k, n, dtype=bf))
        batch_invariant.rms_norm(torch.zeros(m, 7168, dtype=bf), torch.zeros(7168, dtype=bf), 1e-6)
    pages = torch.zeros(4, dtype=torch.long)
    copy_pages(torch.zeros(8, 64 * 656, dtype=torch.uint8), torch.zeros(8, 64 * 656, dtype=torch.uint8), pages, pages)


def main() -> int:
    JITFunction.run = _record
    record_serving_launches()
    target = GPUTarget("cuda", 90, 32)
    failures = []
    for (name, *_), (fn, sig, consts, opts) in launches.items():
        try:
            src = ASTSource(fn=fn, signature=sig, constexprs=consts)
            kernel = triton.compile(src, target=target, options=opts)
            smem = kernel.metadata.shared
            status = "ok" if smem <= SMEM_LIMIT else f"SHARED MEMORY {smem} > {SMEM_LIMIT}"
            if smem > SMEM_LIMIT:
                failures.append(name)
            print(f"{name:28s} {status:8s} smem {smem:7d} regs {getattr(kernel, 'n_regs', '?')} "
                  f"{ {k: v for k, v in consts.items() if k.isupper()} } {opts}")
        except Exception as e:  # report every failure, then fail
            failures.append(name)
            print(f"{name:28s} FAILED: {type(e).__name__}: {str(e)[:400]}")
    print(f"{len(launches)} launches compiled for sm_90, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
