"""FP8 kernels (sgl_kernel.fp8_quant / fp8_gemm / fp8_moe) against their torch twins, on CPU under
TRITON_INTERPRET=1 (test/conftest.py) at tiny shapes; SGLANG_TEST_DEVICE=cuda runs them compiled.

Tolerances: the activation quant is byte-exact (same formula, IEEE division, round to nearest even).
The GEMMs sum the same products in another order (per K block, then scaled, vs one fp32 matmul of
dequantised operands): fp32 rounding, relative error <= 1e-5 (measured ~2e-7); with bf16 x the W8A16
output is rounded to bf16 once, <= 2^-8 relative. Exact (torch.equal): W8A8 with the activations
quantised once vs in the GEMM prologue, and the MoE's intermediate quantised in the gate-up epilogue
vs by its own launch (one formula, the same arithmetic after). Cost: ~40 s on an idle 2-core CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from sgl_kernel import moe as moe_mod
from sgl_kernel import fp8_moe as fp8_moe_mod, fp8_tables
from sgl_kernel.fp8_gemm import (Fp8GemmConfig, fixed_gemm_config, fp8_block_gemm, fp8_block_linear,
                                 fp8_block_linear_ref, get_gemm_config, heuristic_gemm_config)
from sgl_kernel.fp8_moe import Fp8MoEConfig, fixed_fp8_moe_config, fused_experts_fp8, get_fp8_moe_config
from sgl_kernel.fp8_quant import per_token_group_quant_fp8, per_token_group_quant_fp8_ref

from sglang.srt.layers.moe.fused_moe_native import fused_experts_fp8_native
from sglang.srt.model_loader.weight_utils import quantize_fp8_block

DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
BLOCK = (128, 128)
FP32_REL = 1e-5
# Hopper's FP8 tensor-core MMA accumulates with ~14 bits of mantissa before the fp32 add (DeepSeek-V3
# report, section 3.3.2): e4m3 x e4m3 dots differ from the fp32 twin by ~2^-14 per K block
# (8.6e-5 measured on the H100); the interpreter and W8A16 dots keep FP32_REL.
FP8_DOT_REL = 2**-12 if DEVICE == "cuda" else FP32_REL


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _fp8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w = w * (2.0 ** (torch.rand(n, 1, generator=g) * 2 - 1))  # row gains: the block scales differ
    q, s = quantize_fp8_block(w, BLOCK)
    return q.to(DEVICE), s.to(DEVICE)


def test_per_token_group_quant_is_byte_exact():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 200, generator=g) * torch.logspace(-3, 2, 7)[:, None]  # K 200: a partial group
    x[3] = 0  # an all-zero row gets the EPS floor, not 0/0
    for dt in (torch.float32, torch.bfloat16):
        xd = x.to(dt).to(DEVICE)
        q, s = per_token_group_quant_fp8(xd, 128)
        rq, rs = per_token_group_quant_fp8_ref(xd, 128)
        assert s.shape == (7, 2) and q.dtype == torch.float8_e4m3fn
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs), dt
        assert q.float().abs().amax(dim=1)[[0, 1, 2, 4, 5, 6]].eq(448).all()  # the group max maps to 448


@pytest.mark.parametrize("m,n,k", [(3, 80, 256), (20, 200, 160)])  # partial N and K blocks in both
def test_block_gemm_matches_twin(m, n, k):
    q, s = _fp8_weight(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    bias = torch.randn(n).to(DEVICE)
    configs = [None, Fp8GemmConfig(16, 64, split_k=2, group_m=1), Fp8GemmConfig(16, 64, split_k=3, prequant=False),
               Fp8GemmConfig(64, 64, group_m=2, tma=True), fixed_gemm_config(BLOCK)]  # tma: descriptor loads
    for fp8_act in (True, False):
        ref = fp8_block_linear_ref(x, q, s, BLOCK, bias, fp8_act)
        for cfg in configs:
            out = fp8_block_linear(x, q, s, BLOCK, bias, fp8_act, config=cfg)
            assert _rel(out, ref) < (FP8_DOT_REL if fp8_act else FP32_REL), (fp8_act, cfg)
    xb = x.bfloat16()
    assert _rel(fp8_block_linear(xb, q, s, BLOCK, None, False), fp8_block_linear_ref(xb, q, s, BLOCK, None, False)) < 2**-8
    assert fp8_block_linear(x[:0], q, s, BLOCK).shape == (0, n)


@pytest.mark.parametrize("m,n,k", [(20, 200, 256), (3, 80, 160)])  # even K (no masks) and a partial K block
def test_prequant_equals_prologue_bit_for_bit(m, n, k):
    """W8A8's two ways to the activation codes (quantise once, or per tile in the GEMM prologue) use one
    formula and the same arithmetic after: equal outputs, bit for bit, at every config; so does
    fp8_block_gemm on codes quantised by the caller."""
    from sgl_kernel.fp8_quant import per_token_group_quant_fp8

    q, s = _fp8_weight(n, k, seed=7)
    g = torch.Generator().manual_seed(8)
    bias = torch.randn(n, generator=g).to(DEVICE)
    for dt in (torch.float32, torch.bfloat16):
        x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m)[:, None]).to(dt).to(DEVICE)
        for tile in ((16, 64, 1, 1), (16, 64, 2, 1), (64, 128, 1, 8)):
            pre = fp8_block_linear(x, q, s, BLOCK, bias, config=Fp8GemmConfig(*tile, prequant=True))
            pro = fp8_block_linear(x, q, s, BLOCK, bias, config=Fp8GemmConfig(*tile, prequant=False))
            assert torch.equal(pre, pro), (dt, tile)
            given = fp8_block_gemm(*per_token_group_quant_fp8(x, BLOCK[1]), q, s, BLOCK, dt, bias,
                                   config=Fp8GemmConfig(*tile))
            assert torch.equal(given, pre), (dt, tile)
    with pytest.raises(ValueError, match="tma"):
        Fp8GemmConfig(64, 64, split_k=2, tma=True)
    with pytest.raises(ValueError, match="codes"):
        fp8_block_gemm(x, torch.ones(m, 2, device=DEVICE), q, s, BLOCK, x.dtype)


@pytest.mark.parametrize("split", [2, 3, 8])
def test_serial_split_k_equals_the_reduction_kernel_bit_for_bit(split):
    """Split-K reduced in the GEMM's own launch (the last split of a tile sums the partials) gives the
    bits of the separate reduction kernel (same order, s ascending), with and without bias, W8A8 and
    W8A16; launched again and again it stays equal (each tile's lock is re-zeroed: a lock left at a
    count would make a later launch sum before its partials exist) and leaves the ring at zero."""
    from sgl_kernel import fp8_gemm as mod

    q, s = _fp8_weight(200, 1024, seed=11)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(5, 1024, generator=g).to(DEVICE)
    bias = torch.randn(200, generator=g).to(DEVICE)
    for fp8_act in (True, False):
        for b in (None, bias):
            two = fp8_block_linear(x, q, s, BLOCK, b, fp8_act,
                                   config=Fp8GemmConfig(16, 64, split, 1, serial_reduce=False))
            for _ in range(20 if DEVICE == "cuda" else 2):  # a race would show as a changing output
                one = fp8_block_linear(x, q, s, BLOCK, b, fp8_act, config=Fp8GemmConfig(16, 64, split, 1))
                assert torch.equal(one, two), (split, fp8_act, b is None)
    assert int(mod._LOCKS[torch.device(DEVICE) if DEVICE == "cpu" else x.device][0].abs().sum()) == 0


def test_split_locks_ring_wraps_and_refuses_what_it_cannot_hold(monkeypatch):
    from sgl_kernel import fp8_gemm as mod

    monkeypatch.setattr(mod, "LOCK_RING", 10)
    monkeypatch.setattr(mod, "_LOCKS", {})
    dev = torch.device("cpu")
    a, b, c = mod.split_locks(dev, 4), mod.split_locks(dev, 4), mod.split_locks(dev, 4)
    assert a.data_ptr() != b.data_ptr() and c.data_ptr() == a.data_ptr()  # the third wraps to the start
    assert mod.split_locks(dev, 11) is None  # more tiles than the ring: the two-kernel reduction


def test_block_gemm_tile_wider_than_the_weight_block():
    """BLOCK_N 128 over 64-row weight blocks: two weight scales per tile (the outer-product promotion;
    narrower tiles take one scale per K step)."""
    block = (64, 128)
    g = torch.Generator().manual_seed(13)
    q, s = quantize_fp8_block(torch.randn(200, 256, generator=g) * 0.05 * (2.0 ** torch.rand(200, 1, generator=g)),
                              block)
    q, s = q.to(DEVICE), s.to(DEVICE)
    x = torch.randn(20, 256, generator=g).to(DEVICE)
    for fp8_act in (True, False):
        ref = fp8_block_linear_ref(x, q, s, block, None, fp8_act)
        for cfg in (Fp8GemmConfig(16, 128, 2, 1), Fp8GemmConfig(32, 128, prequant=False), Fp8GemmConfig(32, 128, tma=True)):
            out = fp8_block_linear(x, q, s, block, None, fp8_act, config=cfg)
            assert _rel(out, ref) < (FP8_DOT_REL if fp8_act else FP32_REL), (fp8_act, cfg)


def test_block_gemm_fixed_config_is_batch_invariant():
    """--enable-deterministic-inference: a row's output bits do not depend on the other rows."""
    q, s = _fp8_weight(96, 256, seed=3)
    x = torch.randn(24, 256, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    cfg = fixed_gemm_config(BLOCK)
    full = fp8_block_linear(x, q, s, BLOCK, config=cfg)
    for rows in (1, 5):
        assert torch.equal(fp8_block_linear(x[:rows], q, s, BLOCK, config=cfg), full[:rows]), rows


def test_gemm_configs_decode_and_prefill():
    dec = get_gemm_config(1, 7168, 2048, BLOCK)
    assert dec.block_m == 16 and dec.split_k > 1 and not dec.prequant  # memory bound: split K, prologue quant
    pre = get_gemm_config(4096, 7168, 2048, BLOCK)
    assert pre.block_m == 128 and pre.split_k == 1 and pre.prequant  # activations quantised once
    assert fixed_gemm_config(BLOCK).prequant and fixed_gemm_config(BLOCK).split_k == 1
    q, s = _fp8_weight(64, 128, seed=4)
    with pytest.raises(ValueError, match="scale"):
        fp8_block_linear(torch.zeros(2, 128, device=DEVICE), q, s[:, :0], BLOCK)
    with pytest.raises(ValueError, match="float8"):
        fp8_block_linear(torch.zeros(2, 128, device=DEVICE), q.float(), s, BLOCK)


def _experts(e: int, h: int, i: int, seed: int):
    def stack(shape, sd):
        parts = [_fp8_weight(*shape, seed=sd + j) for j in range(e)]
        return torch.stack([p for p, _ in parts]), torch.stack([p for _, p in parts])

    return (*stack((2 * i, h), seed), *stack((h, i), seed + 100))


@pytest.mark.parametrize("expert_offset", [0, 2])  # 2: an EP rank's experts; other ids contribute nothing
def test_fused_moe_fp8_matches_twin(monkeypatch, expert_offset):
    monkeypatch.setattr(moe_mod, "_POISON_INTERMEDIATES", True)  # a row left unwritten shows as NaN
    w13, s13, w2, s2 = _experts(4, 160, 128, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, 160, generator=g).to(DEVICE)
    ids = torch.randint(0, 6, (9, 2), generator=g).to(DEVICE)
    tw = torch.rand(9, 2, generator=g).to(DEVICE)
    # the heuristic (gate-up tile = one K block: quant fused in its epilogue), a 64-wide gate-up tile
    # (the intermediate quantised by its own launch) with 32-row blocks, a down tile over two weight blocks
    configs = [None, Fp8MoEConfig(block_m=32, up_n=64, up_warps=4, up_stages=2, down_n=64, group_m=2),
               Fp8MoEConfig(block_m=16, up_n=128, down_n=256, down_stages=2)]
    for fp8_act in (True, False):
        ref = fused_experts_fp8_native(x, w13, s13, w2, s2, tw, ids, expert_offset, BLOCK, fp8_act)
        for cfg in configs:
            out = fused_experts_fp8(x, w13, s13, w2, s2, tw, ids, expert_offset, BLOCK, fp8_act, config=cfg)
            assert not out.isnan().any() and _rel(out, ref) < (FP8_DOT_REL if fp8_act else FP32_REL), (fp8_act, cfg)
    cfg = fixed_fp8_moe_config(BLOCK)
    full = fused_experts_fp8(x, w13, s13, w2, s2, tw, ids, expert_offset, BLOCK, config=cfg)
    assert torch.equal(fused_experts_fp8(x[:3], w13, s13, w2, s2, tw[:3], ids[:3], expert_offset, BLOCK, config=cfg),
                       full[:3])  # batch invariant under the fixed config
    with pytest.raises(ValueError, match="w2_scale"):
        fused_experts_fp8(x, w13, s13, w2, s2[:, :1], tw, ids, expert_offset, BLOCK)


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
def test_fused_intermediate_quant_equals_separate_quant(dt):
    """The gate-up epilogue's fp8 codes + scales of SiLU(g)*u are the bytes per_token_group_quant_fp8
    gives on the intermediate rounded to the hidden dtype (what the twin quantises), on every row."""
    from sgl_kernel.fp8_quant import per_token_group_quant_fp8
    from sgl_kernel.moe import moe_align_block_size

    w13, s13, _, _ = _experts(3, 256, 256, seed=9)
    g = torch.Generator().manual_seed(10)
    x = (torch.randn(7, 256, generator=g) * 3).to(dt).to(DEVICE)
    ids = torch.randint(0, 3, (7, 2), generator=g).to(DEVICE)
    cfg = Fp8MoEConfig(block_m=16, up_n=128)
    route = (*moe_align_block_size(ids, 3, cfg.block_m), 2)
    a, a_s = per_token_group_quant_fp8(x, BLOCK[1])
    fq, fs = fp8_moe_mod.gate_up_stage(a, a_s, dt, w13, s13, route, BLOCK, cfg)
    sq, ss = fp8_moe_mod.gate_up_stage(a, a_s, dt, w13, s13, route, BLOCK, cfg, fuse_quant=False)
    assert fs.shape == (14, 2) and fq.dtype == torch.float8_e4m3fn
    assert torch.equal(fq.view(torch.uint8), sq.view(torch.uint8)) and torch.equal(fs, ss)
    assert fq.float().abs().amax(dim=1).eq(448).all()  # real values: each row's group max maps to 448


def test_config_tables_are_read_for_the_device(tmp_path, monkeypatch):
    """A tuned table (tune_fp8.py's format) is used for its shapes at the nearest M bucket (log scale);
    other shapes, and block sizes other than 128 x 128, fall back to the heuristic."""
    import json

    gemm = {"N=200,K=256": {"1": Fp8GemmConfig(16, 32, 2, 1, 4, 5, False).to_json(),
                            "64": Fp8GemmConfig(32, 64, 1, 4, 4, 2, True).to_json()}}
    moe = {"E=4,H=160,I=128,k=2": {"9": Fp8MoEConfig(32, 64, 4, 2, 64, 4, 2, 2).to_json()}}
    dev = fp8_tables.device_name(DEVICE)
    (tmp_path / fp8_tables.table_file("fp8_gemm", dev)).write_text(json.dumps({"configs": gemm}))
    (tmp_path / fp8_tables.table_file("fp8_moe", dev)).write_text(json.dumps({"configs": moe}))
    monkeypatch.setenv(fp8_tables.CONFIG_DIR_ENV, str(tmp_path))
    fp8_tables.clear_cache()
    try:
        assert get_gemm_config(3, 200, 256, BLOCK, DEVICE) == Fp8GemmConfig(16, 32, 2, 1, 4, 5, False)
        assert get_gemm_config(40, 200, 256, BLOCK, DEVICE) == Fp8GemmConfig(32, 64, 1, 4, 4, 2, True)
        assert get_gemm_config(40, 208, 256, BLOCK, DEVICE) == heuristic_gemm_config(40, 208, 256, BLOCK)
        assert get_gemm_config(40, 200, 256, (128, 64), DEVICE) == heuristic_gemm_config(40, 200, 256, (128, 64))
        assert get_fp8_moe_config(1, 2, 4, BLOCK, 160, 128, DEVICE) == Fp8MoEConfig(32, 64, 4, 2, 64, 4, 2, 2)
        q, s = _fp8_weight(200, 256, seed=11)
        x = torch.randn(3, 256, generator=torch.Generator().manual_seed(12)).to(DEVICE)
        assert _rel(fp8_block_linear(x, q, s, BLOCK), fp8_block_linear_ref(x, q, s, BLOCK)) < FP8_DOT_REL
    finally:
        monkeypatch.delenv(fp8_tables.CONFIG_DIR_ENV)
        fp8_tables.clear_cache()


@pytest.mark.parametrize("act", ["model_dtype", "fp8_e4m3"])
def test_fp8_model_with_triton_kernels_equals_twins(builtin_path, monkeypatch, act):
    """Feature on vs off: the FP8 tiny model through the Triton GEMM + FP8 fused MoE (interpreter on CPU)
    gives the logits of the torch twins.

    W8A16 (activations in fp32): the kernels' K-blocked sums vs the twins' matmuls, ~1e-6 relative
    (bound 1e-4). W8A8: every call equals its twin to fp32 rounding (the tests above), but the next
    layer re-quantises its input to e4m3, a step function: an fp32-ulp difference that lands on a
    rounding boundary moves that element by one e4m3 step (2^-4 relative), and such flips compound
    over the layers (2e-2 measured on CPU after an arithmetic-order change, 5e-7 before it). Bound:
    2^-4 relative -- a wrong scale, tile or row in any kernel is an O(1) error."""
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.layers.quantization import fp8_utils
    from sglang.srt.testing.runner_utils import prefill_all_logits

    import sgl_kernel.fp8_gemm as gemm_mod
    import sgl_kernel.fp8_moe as fp8_moe_mod

    calls = {"gemm": 0, "moe": 0}

    def spy(mod, name, key):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, **kw: (calls.__setitem__(key, calls[key] + 1), fn(*a, **kw))[1])

    spy(gemm_mod, "fp8_block_linear", "gemm")
    spy(fp8_moe_mod, "fused_experts_fp8", "moe")
    path = builtin_path("tiny-deepseek-v32-fp8")
    prompt = [[5, 17, 300, 41, 8, 99]]
    out = {}
    for tag, on in (("twin", False), ("triton", True)):
        monkeypatch.setattr(fp8_utils, "use_fp8_kernels", lambda device, on=on: on)  # either path on any device
        e = Engine(model_path=path, dtype="float32", device=DEVICE, max_total_tokens=1024, nsa_index_k_dtype="float32",
                   random_seed=0, moe_runner_backend="triton" if on else "torch", fp8_activation_dtype=act)
        try:
            out[tag] = torch.cat(prefill_all_logits(e.scheduler.tp_worker.model_runner, prompt))
        finally:
            e.shutdown()
        assert (calls["gemm"] > 0 and calls["moe"] > 0) == on, calls  # the path under test really ran
    assert _rel(out["triton"], out["twin"]) < (1e-4 if act == "model_dtype" else 2**-4)
