"""Debug checks, switched by environment variables read once per forward (off: one dict lookup).

- SGLANG_DEBUG_CHECKS=1: invariant checks that cost a sync or a pass over the data
  (`debug_checks_active()` is False inside a CUDA-graph capture: the checks read values back).
- SGLANG_CP_POISON_PADDING=1: under context parallel, fill the dummy (compute-padding) rows of the
  hidden states with 1e4 before every layer; a real row that reads one shows up as a wrong token.
  The CP forward runs eagerly, so the fill costs nothing in a graph.
"""

from __future__ import annotations

from typing import Callable

import torch

from sglang.srt.utils.common import get_bool_env

DEBUG_CHECKS = get_bool_env("SGLANG_DEBUG_CHECKS")
POISON_VALUE = 1e4


def debug_checks_active() -> bool:
    """SGLANG_DEBUG_CHECKS, but never inside a CUDA-graph capture (the checks read values back)."""
    return DEBUG_CHECKS and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def cp_padding_poison(forward_batch) -> Callable[..., None] | None:
    """None unless SGLANG_CP_POISON_PADDING is set and `forward_batch` is a CP rank's share; else
    a function poisoning the dummy rows of the given [rows, hidden] tensors (None entries skipped),
    counted as "poisoned_rows" in the CP comm counter (tests read it)."""
    cp = forward_batch.cp_metadata
    if cp is None or not get_bool_env("SGLANG_CP_POISON_PADDING"):
        return None

    def poison(*tensors: torch.Tensor | None) -> None:
        for x in tensors:
            if x is not None:
                x.index_fill_(0, cp.dummy_idx, POISON_VALUE)
                cp.counter.add("poisoned_rows", cp.num_local - cp.valid_idx.numel())

    return poison
