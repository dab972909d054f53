"""Vocab-parallel embedding and LM head (vocab split over TP ranks)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from sglang.srt.distributed.parallel_state import SINGLE_GROUP, GroupCoordinator
from sglang.srt.layers import batch_invariant
from sglang.srt.layers.linear import default_weight_loader
from sglang.srt.utils.common import cdiv


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group: GroupCoordinator = SINGLE_GROUP,
                 dtype=None) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.num_embeddings = num_embeddings
        self.shard = cdiv(num_embeddings, tp_group.world_size)
        self.start = tp_group.rank * self.shard
        self.end = min(self.start + self.shard, num_embeddings)
        self.weight = nn.Parameter(torch.zeros(self.shard, embedding_dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding shape mismatch: checkpoint {tuple(loaded.shape)}, "
                             f"expected ({self.num_embeddings}, {param.shape[1]})")
        part = loaded[self.start : self.end]
        param.data.zero_()
        default_weight_loader(param.narrow(0, 0, part.shape[0]), part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group.is_single:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(in_shard, input_ids - self.start, torch.zeros_like(input_ids))
        out = F.embedding(local, self.weight) * in_shard[:, None].to(self.weight.dtype)
        return self.tp_group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-sharded output projection; `logits(hidden)` returns the full vocab on every rank."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = batch_invariant.linear(hidden, self.weight)
        if not self.tp_group.is_single:
            out = self.tp_group.all_gather(out, dim=-1)
        return out[..., : self.num_embeddings]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # pragma: no cover - use logits()
        return self.logits(hidden)
