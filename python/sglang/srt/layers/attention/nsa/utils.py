"""NSA helpers shared by the indexer, the backends and IndexCache, and the context-parallel
compute layout (lanes of valid + dummy rows). The CP page map and per-request split live in
`sglang.srt.mem_cache.cp_page_map` (storage rules: the allocator uses them too).
"""

from __future__ import annotations

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardBatch


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


# -- context parallel: a rank's compute layout (the page map and the split: mem_cache.cp_page_map)


def local_layout(token_ranks: list[list[int]], cp_rank: int, cp_size: int) -> tuple[list[int], list[int], list[int]]:
    """A rank's compute-padded row layout for a batch: request b gets a lane of
    max_r(#tokens of b on r) rows on every rank (at least 1), valid rows first (position order),
    then dummy rows -- so every rank has the same number of rows and communicator shapes match.

    Returns (lanes per request, the global flat token index of each local row (-1 = dummy),
    the local row index of each valid row)."""
    lanes, rows, valid = [], [], []
    offset = 0
    for tr in token_ranks:
        counts = [0] * cp_size
        for r in tr:
            counts[r] += 1
        lane = max(1, max(counts))
        mine = [offset + i for i, r in enumerate(tr) if r == cp_rank]
        valid.extend(range(len(rows), len(rows) + len(mine)))
        rows.extend(mine + [-1] * (lane - len(mine)))
        lanes.append(lane)
        offset += len(tr)
    return lanes, rows, valid
