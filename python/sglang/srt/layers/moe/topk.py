"""MoE routing: sigmoid scores with a correction bias and grouped (node-limited) top-k."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.layers.batch_invariant import rowwise


@dataclass
class TopKConfig:
    top_k: int
    num_experts: int
    num_expert_group: int = 1
    topk_group: int = 1
    renormalize: bool = True  # norm_topk_prob
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"

    def __post_init__(self) -> None:
        if self.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(f"unsupported MoE scoring_func {self.scoring_func!r} (sigmoid or softmax)")
        if self.num_experts % self.num_expert_group:
            raise ValueError(f"n_routed_experts {self.num_experts} not divisible by n_group {self.num_expert_group}")
        if not 1 <= self.topk_group <= self.num_expert_group:
            raise ValueError(f"topk_group {self.topk_group} must be in [1, n_group={self.num_expert_group}]")
        # Fewer candidates than top_k would make topk pick masked (-inf) experts from unselected groups.
        candidates = self.topk_group * (self.num_experts // self.num_expert_group)
        if not 1 <= self.top_k <= candidates:
            raise ValueError(
                f"num_experts_per_tok {self.top_k} must be in [1, topk_group * n_routed_experts / n_group"
                f" = {candidates}]")


@dataclass
class TopKOutput:
    topk_weights: torch.Tensor  # [T, k] fp32, routed_scaling_factor already applied
    topk_ids: torch.Tensor  # [T, k] int64


def select_experts(
    router_logits: torch.Tensor, config: TopKConfig, correction_bias: torch.Tensor | None = None
) -> TopKOutput:
    """Grouped top-k over fp32 router logits [T, E].

    Expert choice uses `score + correction_bias`; the weights are the unbiased scores of the
    chosen experts. Groups are ranked by the sum of their top-2 biased scores (DeepSeek-V3).
    """
    logits = router_logits.float()
    scores = (rowwise(torch.sigmoid, logits, 0.0) if config.scoring_func == "sigmoid"
              else rowwise(lambda x: x.softmax(dim=-1), logits, float("-inf")))
    choice = scores if correction_bias is None else scores + correction_bias.float()
    t, e = choice.shape
    g = config.num_expert_group
    if g > 1:
        per = e // g
        grouped = choice.view(t, g, per)
        group_scores = grouped.topk(min(2, per), dim=-1).values.sum(dim=-1)
        group_idx = group_scores.topk(config.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        choice = choice.masked_fill(~group_mask[:, :, None].expand(t, g, per).reshape(t, e), float("-inf"))
    topk_ids = choice.topk(config.top_k, dim=-1, sorted=False).indices
    topk_weights = scores.gather(1, topk_ids)
    if config.renormalize:  # also for top_k == 1, as HF's DeepSeek-V3/V3.2/GLM-5 routers do
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    topk_weights = topk_weights * config.routed_scaling_factor
    return TopKOutput(topk_weights=topk_weights, topk_ids=topk_ids)
