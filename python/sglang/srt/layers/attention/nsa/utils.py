"""NSA helpers shared by the indexer, the backend and IndexCache."""

from __future__ import annotations

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.utils.common import get_bool_env

# SGLANG_DEBUG_CHECKS=1 turns on invariant checks that cost a sync or a pass over the data.
DEBUG_CHECKS = get_bool_env("SGLANG_DEBUG_CHECKS")


def debug_checks_active() -> bool:
    """SGLANG_DEBUG_CHECKS, but never inside a CUDA-graph capture (the checks read values back)."""
    return DEBUG_CHECKS and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class StaleTopkError(RuntimeError):
    pass


def assert_topk_matches_batch(topk: torch.Tensor, forward_batch: ForwardBatch, layer_id: int) -> None:
    """A shared IndexCache layer's inherited top-k must belong to this batch's layout: one row per
    token of this forward, every index -1 or a causal position of that token's own request."""
    if topk.dim() != 2 or topk.shape[0] != forward_batch.num_tokens:
        raise StaleTopkError(f"layer {layer_id}: top-k has shape {tuple(topk.shape)} for a batch of "
                             f"{forward_batch.num_tokens} tokens (indices from another batch or layout)")
    bad = (topk >= 0) & (topk.long() > forward_batch.positions[:, None])
    if bool(bad.any()):
        row = int(bad.any(dim=1).nonzero()[0])
        raise StaleTopkError(f"layer {layer_id}: token {row} (position {int(forward_batch.positions[row])}) "
                             f"inherits non-causal top-k {topk[row][bad[row]].tolist()[:4]}")
