"""The CP MoE compaction (nsa/cp_backend.install_moe_compaction): under context parallel a MoE
block's gate, top-k, experts and shared experts see only the valid rows of the rank's
compute-padded layout, and its output is the block's output on those rows, zeros in the dummy
rows; a batch without CP metadata goes through unchanged. Fast, CPU."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from sglang.srt.layers.attention.nsa.cp_backend import install_moe_compaction
from sglang.srt.model_executor.forward_batch_info import CPBatchInfo
from sglang.srt.models.deepseek_v2 import DeepseekV2MoE

HIDDEN = 16


def _moe() -> DeepseekV2MoE:
    cfg = SimpleNamespace(n_routed_experts=4, num_experts_per_tok=2, hidden_size=HIDDEN, moe_intermediate_size=8,
                          n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True,
                          routed_scaling_factor=1.0, scoring_func="sigmoid", topk_method="noaux_tc")
    torch.manual_seed(0)
    moe = DeepseekV2MoE(cfg, dtype=torch.float32)
    for p in moe.parameters():
        p.data.normal_(0, 0.2)
    return moe


def _batch(valid: list[int] | None, rows: int):
    md = None if valid is None else SimpleNamespace(valid_idx=torch.tensor(valid), num_local=rows)
    return SimpleNamespace(cp=CPBatchInfo(metadata=md))


def test_block_sees_valid_rows_only_and_restores_the_padded_layout():
    moe = _moe()
    plain = _moe()  # the same weights, no compaction
    wrapped = nn.ModuleList([moe])
    assert install_moe_compaction(wrapped) == 1
    seen = []
    moe.gate.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
    x = torch.randn(6, HIDDEN)
    x[[1, 4, 5]] = 1e4  # dummy rows: garbage that must not reach the gate
    valid = [0, 2, 3]
    out = moe(x, _batch(valid, 6))
    assert seen == [len(valid)]
    assert torch.equal(out[valid], plain(x[valid]))
    assert torch.equal(out[[1, 4, 5]], torch.zeros(3, HIDDEN))


def test_batch_without_cp_metadata_is_unchanged():
    moe, plain = _moe(), _moe()
    install_moe_compaction(nn.ModuleList([moe]))
    x = torch.randn(5, HIDDEN)
    assert torch.equal(moe(x, _batch(None, 5)), plain(x))
    assert torch.equal(moe(x), plain(x))  # no batch at all (a direct call)
