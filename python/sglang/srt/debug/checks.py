"""Debug checks, switched by environment variables read when a model is built (debug/hooks.py
installs them as forward hooks; off: no hook, nothing runs).

- SGLANG_DEBUG_CHECKS=1: invariant checks that cost a sync or a pass over the data
  (`debug_checks_active()` is False inside a CUDA-graph capture: the checks read values back).
- SGLANG_CP_POISON_PADDING=1: under context parallel, fill the dummy (compute-padding) rows of the
  hidden states with 1e4 before every layer; a real row that reads one shows up as a wrong token.
  The CP forward runs eagerly, so the fill costs nothing in a graph.
"""

from __future__ import annotations

import torch

from sglang.srt.utils.common import get_bool_env

DEBUG_CHECKS = get_bool_env("SGLANG_DEBUG_CHECKS")
POISON_ENV = "SGLANG_CP_POISON_PADDING"
POISON_VALUE = 1e4


class StaleTopkError(RuntimeError):
    pass


def debug_checks_active() -> bool:
    """SGLANG_DEBUG_CHECKS, but never inside a CUDA-graph capture (the checks read values back)."""
    return DEBUG_CHECKS and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def poison_padding_enabled() -> bool:
    return get_bool_env(POISON_ENV)


def assert_topk_matches_batch(topk: torch.Tensor, forward_batch, layer_id: int) -> None:
    """A shared IndexCache layer's inherited top-k must belong to this batch's layout: one row per
    token of this forward (a ForwardBatch), every index -1 or a causal position of that token's own
    request."""
    if topk.dim() != 2 or topk.shape[0] != forward_batch.num_tokens:
        raise StaleTopkError(f"layer {layer_id}: top-k has shape {tuple(topk.shape)} for a batch of "
                             f"{forward_batch.num_tokens} tokens (indices from another batch or layout)")
    bad = (topk >= 0) & (topk.long() > forward_batch.positions[:, None])
    if bool(bad.any()):
        row = int(bad.any(dim=1).nonzero()[0])
        raise StaleTopkError(f"layer {layer_id}: token {row} (position {int(forward_batch.positions[row])}) "
                             f"inherits non-causal top-k {topk[row][bad[row]].tolist()[:4]}")


def poison_padding_rows(forward_batch, *tensors: torch.Tensor | None) -> None:
    """Fill the dummy rows of the given [rows, hidden] tensors (None entries skipped) of a CP rank's
    share with POISON_VALUE, counted as "poisoned_rows" in the CP comm counter (tests read it); a
    batch without CP metadata is left alone."""
    cp = forward_batch.cp.metadata
    if cp is None:
        return
    for x in tensors:
        if x is not None:
            x.index_fill_(0, cp.dummy_idx, POISON_VALUE)
            cp.counter.add("poisoned_rows", cp.num_local - cp.valid_idx.numel())
