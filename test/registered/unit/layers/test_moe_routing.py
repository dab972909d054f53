"""MoE routing and expert compute against transformers' DeepSeek-V3.2 reference classes (CPU, fp32).

- `select_experts` vs `DeepseekV32TopkRouter` (same router weight + e_score_correction_bias) over a
  grid of expert counts, groups, top-k and normalisation settings: same expert set per token
  (order-free) and the same weights matched by expert id (atol 1e-6).
- `fused_experts_native` vs `DeepseekV32Experts`, and the whole `DeepseekV2MoE` block (shared
  experts included) vs `DeepseekV32MoE` loaded from the HF module's state dict (atol 1e-5).
- Expert-parallel slices (`expert_offset`): tokens routed to no local expert give exact zeros and
  the per-rank partial outputs add up to the full output.
"""

from __future__ import annotations


import pytest


import torch
from transformers import DeepseekV32Config
from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
    DeepseekV32Experts,
    DeepseekV32MoE,
    DeepseekV32TopkRouter,
)

from sglang.srt.layers.moe.fused_moe import FusedMoE
from sglang.srt.layers.moe.fused_moe_native import fused_experts_native
from sglang.srt.layers.moe.topk import TopKConfig, TopKOutput, select_experts
from sglang.srt.models.deepseek_v2 import DeepseekV2MoE

HIDDEN = 32
NUM_TOKENS = 64
WEIGHT_ATOL = 1e-6
OUT_ATOL = 1e-5

EXPERTS = [8, 16, 64]
GROUPS = [1, 2, 4, 8]
TOP_KS = [1, 2, 4, 8]
GRID = [(e, g, tg) for e in EXPERTS for g in GROUPS for tg in range(1, g + 1)]


def _hf_config(**kw) -> DeepseekV32Config:
    base = dict(hidden_size=HIDDEN, n_routed_experts=8, moe_intermediate_size=16, n_group=1, topk_group=1,
                num_experts_per_tok=2, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                num_hidden_layers=2, first_k_dense_replace=0, intermediate_size=64, vocab_size=64)
    base.update(kw)
    return DeepseekV32Config(**base)


def _ref_route(logits: torch.Tensor, bias: torch.Tensor, cfg: TopKConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent per-token reference (python loops + sort), valid for any group size incl. 1."""
    scores = logits.float().sigmoid()
    choice = scores + bias
    e, g = cfg.num_experts, cfg.num_expert_group
    per = e // g
    ids_out, w_out = [], []
    for t in range(scores.shape[0]):
        c = choice[t].view(g, per)
        gscore = c.sort(dim=-1, descending=True).values[:, : min(2, per)].sum(-1) if g > 1 else torch.zeros(1)
        groups = gscore.sort(descending=True).indices[: cfg.topk_group].tolist()
        allowed = [gi * per + j for gi in groups for j in range(per)]
        best = sorted(allowed, key=lambda x: -choice[t, x].item())[: cfg.top_k]
        w = scores[t, best]
        if cfg.renormalize:
            w = w / (w.sum() + 1e-20)
        ids_out.append(torch.tensor(best))
        w_out.append(w * cfg.routed_scaling_factor)
    return torch.stack(ids_out), torch.stack(w_out)


def _by_expert(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each token's (id, weight) pairs by expert id: order-free comparison."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


def _assert_same_routing(ours: TopKOutput, ref_ids: torch.Tensor, ref_w: torch.Tensor, what: str) -> None:
    assert ours.topk_ids.shape == ref_ids.shape, what
    assert ours.topk_weights.dtype == torch.float32, what
    oi, ow = _by_expert(ours.topk_ids.long(), ours.topk_weights)
    ri, rw = _by_expert(ref_ids.long(), ref_w.float())
    bad = (oi != ri).any(dim=-1)
    assert not bad.any(), f"{what}: expert sets differ for tokens {bad.nonzero().flatten().tolist()[:8]}"
    torch.testing.assert_close(ow, rw, atol=WEIGHT_ATOL, rtol=0, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("num_experts,n_group,topk_group", GRID)
def test_select_experts_matches_hf_router(num_experts, n_group, topk_group):
    per = num_experts // n_group
    g = torch.Generator().manual_seed(num_experts * 100 + n_group * 10 + topk_group)
    hidden = torch.randn(NUM_TOKENS, HIDDEN, generator=g)
    weight = torch.randn(num_experts, HIDDEN, generator=g) * 0.5
    bias = torch.randn(num_experts, generator=g) * 0.1  # random e_score_correction_bias
    checked = 0
    for top_k in TOP_KS:
        if top_k > topk_group * per:  # rejected by TopKConfig (tested below)
            continue
        for norm in (True, False):
            for scale in (1.0, 2.5):
                cfg = TopKConfig(top_k=top_k, num_experts=num_experts, num_expert_group=n_group,
                                 topk_group=topk_group, renormalize=norm, routed_scaling_factor=scale)
                what = f"E={num_experts} g={n_group} tg={topk_group} k={top_k} norm={norm} scale={scale}"
                logits = torch.nn.functional.linear(hidden, weight)
                ours = select_experts(logits, cfg, bias)
                # The independent reference covers every grid point (incl. 1 expert per group).
                _assert_same_routing(ours, *_ref_route(logits, bias, cfg), what + " [ref]")
                if per >= 2:  # HF ranks groups by topk(2) of each group: needs >= 2 experts per group
                    router = DeepseekV32TopkRouter(_hf_config(
                        n_routed_experts=num_experts, n_group=n_group, topk_group=topk_group,
                        num_experts_per_tok=top_k, norm_topk_prob=norm, routed_scaling_factor=scale))
                    with torch.no_grad():
                        router.weight.copy_(weight)
                        router.e_score_correction_bias.copy_(bias)
                        hf_logits, hf_w, hf_ids = router(hidden)
                    torch.testing.assert_close(logits, hf_logits, atol=1e-6, rtol=0)
                    _assert_same_routing(ours, hf_ids, hf_w, what + " [hf]")
                checked += 1
    assert checked > 0


def test_bias_changes_choice_not_weights():
    """The correction bias only steers the choice; weights are the unbiased sigmoid scores."""
    logits = torch.tensor([[0.0, 0.1, 0.2, 0.3]])
    cfg = TopKConfig(top_k=1, num_experts=4, renormalize=False)
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])
    out = select_experts(logits, cfg, bias)
    assert out.topk_ids.tolist() == [[0]]
    torch.testing.assert_close(out.topk_weights, torch.sigmoid(torch.tensor([[0.0]])))
    out = select_experts(logits, cfg, None)
    assert out.topk_ids.tolist() == [[3]]


def test_top1_renormalize_gives_scaling_factor():
    """norm_topk_prob with one expert per token: HF divides by the sum, so the weight is 1 * scale."""
    cfg = TopKConfig(top_k=1, num_experts=8, num_expert_group=2, topk_group=1, renormalize=True,
                     routed_scaling_factor=2.5)
    out = select_experts(torch.randn(5, 8, generator=torch.Generator().manual_seed(0)), cfg)
    torch.testing.assert_close(out.topk_weights, torch.full((5, 1), 2.5))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(top_k=2, num_experts=10, num_expert_group=4, topk_group=1), "not divisible"),
        (dict(top_k=2, num_experts=8, num_expert_group=2, topk_group=0), "topk_group"),
        (dict(top_k=2, num_experts=8, num_expert_group=2, topk_group=3), "topk_group"),
        (dict(top_k=2, num_experts=8, scoring_func="relu"), "scoring_func"),
        (dict(top_k=0, num_experts=8), "num_experts_per_tok"),
        (dict(top_k=9, num_experts=8), "num_experts_per_tok"),
        # 2 groups of 4 allowed out of 8 groups of 4 = 8 candidates < 12.
        (dict(top_k=12, num_experts=32, num_expert_group=8, topk_group=2), "num_experts_per_tok"),
    ],
)
def test_topk_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TopKConfig(**kwargs)


def test_moe_block_config_validation():
    with pytest.raises(ValueError, match="not divisible"):
        DeepseekV2MoE(_hf_config(n_routed_experts=12, n_group=8, topk_group=1))
    with pytest.raises(ValueError, match="topk_group"):
        DeepseekV2MoE(_hf_config(n_routed_experts=8, n_group=2, topk_group=4))
    cfg = _hf_config()
    cfg.scoring_func = "tanh"
    with pytest.raises(ValueError, match="tanh"):
        DeepseekV2MoE(cfg)


# ------------------------------------------------------------------------------------------------
# Expert computation
# ------------------------------------------------------------------------------------------------


def _random_experts(cfg: DeepseekV32Config, seed: int) -> DeepseekV32Experts:
    experts = DeepseekV32Experts(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * 0.2)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * 0.2)
    return experts


def _random_routing(t: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return ids, torch.rand(t, k, generator=g)


@pytest.mark.parametrize("num_experts,top_k,num_tokens", [(8, 2, 17), (16, 4, 33), (64, 8, 40), (8, 1, 1)])
def test_fused_experts_native_matches_hf_experts(num_experts, top_k, num_tokens):
    cfg = _hf_config(n_routed_experts=num_experts, num_experts_per_tok=top_k)
    hf = _random_experts(cfg, seed=num_experts)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    ids, w = _random_routing(num_tokens, num_experts, top_k, seed=2)
    with torch.no_grad():
        ref = hf(x, ids, w)
    ours = fused_experts_native(x, hf.gate_up_proj.data, hf.down_proj.data, w, ids)
    torch.testing.assert_close(ours, ref, atol=OUT_ATOL, rtol=0)

    # Same through the FusedMoE layer, loaded via its fused-checkpoint path.
    layer = FusedMoE(num_experts, HIDDEN, cfg.moe_intermediate_size, dtype=torch.float32)
    layer.load_fused_weight(hf.gate_up_proj.data, "gate_up_proj")
    layer.load_fused_weight(hf.down_proj.data, "down_proj")
    torch.testing.assert_close(layer(x, TopKOutput(w, ids)), ref, atol=OUT_ATOL, rtol=0)


def test_fused_experts_native_empty_and_dropped_slots():
    e, k, t = 8, 2, 6
    cfg = _hf_config(n_routed_experts=e, num_experts_per_tok=k)
    hf = _random_experts(cfg, seed=5)
    w13, w2 = hf.gate_up_proj.data, hf.down_proj.data
    empty = fused_experts_native(torch.zeros(0, HIDDEN), w13, w2, torch.zeros(0, k), torch.zeros(0, k, dtype=torch.long))
    assert empty.shape == (0, HIDDEN)
    x = torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(3))
    ids, w = _random_routing(t, e, k, seed=4)
    full = fused_experts_native(x, w13, w2, w, ids)
    # A -1 slot (dropped) contributes nothing: same as keeping only the other slot.
    dropped = ids.clone()
    dropped[:, 1] = -1
    only_first = fused_experts_native(x, w13, w2, w[:, :1], ids[:, :1])
    torch.testing.assert_close(fused_experts_native(x, w13, w2, w, dropped), only_first, atol=0, rtol=0)
    assert not torch.equal(full, only_first)


@pytest.mark.parametrize("ep_size", [2, 4])
def test_expert_parallel_slices(ep_size):
    """Each EP rank holds E/ep experts at expert_offset; ids stay global."""
    e, k, t = 16, 2, 24
    cfg = _hf_config(n_routed_experts=e, num_experts_per_tok=k)
    hf = _random_experts(cfg, seed=7)
    w13, w2 = hf.gate_up_proj.data, hf.down_proj.data
    x = torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(8))
    ids, w = _random_routing(t, e, k, seed=9)
    per = e // ep_size
    # Force the first 4 tokens onto rank 0's experts only.
    ids[:4] = torch.tensor([0, 1]) % per
    with torch.no_grad():
        ref = hf(x, ids, w)
    total = torch.zeros_like(x)
    for rank in range(ep_size):
        off = rank * per
        part = fused_experts_native(x, w13[off : off + per], w2[off : off + per], w, ids, expert_offset=off)
        local = ((ids >= off) & (ids < off + per)).any(dim=-1)
        assert torch.equal(part[~local], torch.zeros_like(part[~local])), f"rank {rank}: non-local tokens not zero"
        if rank > 0:
            assert torch.equal(part[:4], torch.zeros(4, HIDDEN))
        # Through the layer too (expert_offset attribute, local weight slice).
        layer = FusedMoE(per, HIDDEN, cfg.moe_intermediate_size, dtype=torch.float32)
        layer.w13_weight.data.copy_(w13[off : off + per])
        layer.w2_weight.data.copy_(w2[off : off + per])
        layer.expert_offset = off
        torch.testing.assert_close(layer(x, TopKOutput(w, ids)), part, atol=0, rtol=0)
        total += part
    torch.testing.assert_close(total, ref, atol=OUT_ATOL, rtol=0)


# ------------------------------------------------------------------------------------------------
# The whole MoE block
# ------------------------------------------------------------------------------------------------


def _load_ours_from_hf(ours: DeepseekV2MoE, hf: DeepseekV32MoE) -> None:
    sd = hf.state_dict()
    with torch.no_grad():
        ours.gate.weight.copy_(sd["gate.weight"])
        ours.gate.e_score_correction_bias.copy_(sd["gate.e_score_correction_bias"])
        ours.experts.load_fused_weight(sd["experts.gate_up_proj"], "gate_up_proj")
        ours.experts.load_fused_weight(sd["experts.down_proj"], "down_proj")
        gu = ours.shared_experts.gate_up_proj
        gu.weight_loader(gu.weight, sd["shared_experts.gate_proj.weight"], 0)
        gu.weight_loader(gu.weight, sd["shared_experts.up_proj.weight"], 1)
        dp = ours.shared_experts.down_proj
        dp.weight_loader(dp.weight, sd["shared_experts.down_proj.weight"])
    # Every HF tensor was used and every one of our parameters written.
    assert set(sd) == {"gate.weight", "gate.e_score_correction_bias", "experts.gate_up_proj", "experts.down_proj",
                       "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
                       "shared_experts.down_proj.weight"}


@pytest.mark.parametrize(
    "num_experts,n_group,topk_group,top_k,n_shared,norm,scale",
    [
        (8, 2, 1, 2, 1, True, 2.5),  # the tiny checkpoints' routing
        (16, 4, 2, 4, 2, True, 1.0),
        (64, 8, 4, 8, 1, False, 2.5),  # DeepSeek-V3 shaped
        (16, 1, 1, 1, 1, True, 2.5),  # GLM-5 style single group, top-1
    ],
)
def test_moe_block_matches_hf(num_experts, n_group, topk_group, top_k, n_shared, norm, scale):
    cfg = _hf_config(n_routed_experts=num_experts, n_group=n_group, topk_group=topk_group,
                     num_experts_per_tok=top_k, n_shared_experts=n_shared, norm_topk_prob=norm,
                     routed_scaling_factor=scale)
    torch.manual_seed(num_experts + top_k)
    hf = DeepseekV32MoE(cfg).eval()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        hf.gate.e_score_correction_bias.copy_(torch.randn(num_experts, generator=g) * 0.05)
    ours = DeepseekV2MoE(cfg, dtype=torch.float32)
    _load_ours_from_hf(ours, hf)
    x = torch.randn(2, 23, HIDDEN, generator=g)
    with torch.no_grad():
        ref = hf(x).reshape(-1, HIDDEN)
        out = ours(x.reshape(-1, HIDDEN))
    torch.testing.assert_close(out, ref, atol=OUT_ATOL, rtol=0)
    # The shared experts matter (guards against a silently skipped branch).
    with torch.no_grad():
        routed_only = hf.experts(x.reshape(-1, HIDDEN), *reversed(hf.gate(x)[1:]))
    assert (routed_only - ref).abs().max() > 1e-3
