"""How a decode step's keys are split over programs of the sparse MLA kernel (sgl_kernel.sparse_mla).

Importing this module imports neither torch nor Triton (the memory plan sizes the split-K partials
with it before any kernel exists).

Two rules, one per promise:
- batch-invariant (`--enable-deterministic-inference`): a fixed chunking of a token's keys
  (`split_keys_for`, a function of the model only), so a request's reduction order is the same
  alone or in any batch;
- otherwise by batch size, the way FlashMLA's scheduler metadata does (`decode_split_keys`): about
  DECODE_TARGET_PROGRAMS programs per step. One request needs many splits to fill the GPU; 64 do
  not, and each split costs a [heads, latent] fp32 partial written and read back. On the H100 at
  V3.2's shapes (2048 keys, 128 heads, 32-head tiles) the fastest fixed split per batch was
  64 keys at batch 1 (0.018 ms vs 0.029 at the fixed 256), 512 at 16 (0.082 vs 0.105) and no split at
  64 (0.251 vs 0.403 ms): 128-256 programs each time. The default mode is not batch-invariant anyway
  (cuBLAS picks its GEMM kernels by the row count).
"""

from __future__ import annotations

import math

# 2 waves of the H100's / H200's 132 SMs: the program count the fastest split gave at batch 1, 16, 64
DECODE_TARGET_PROGRAMS = 264
# The decode tile (measured on the H200 and the H100, benchmark/kernels/bench_attention_kernels.py):
# its head block and key block set the split arithmetic above, so they live beside it.
MLA_DECODE = dict(block_h=32, block_n=64, num_warps=4)


def split_keys_for(max_keys: int, block_n: int = 32, max_splits: int = 32, min_keys: int = 256) -> int:
    """Keys per split-K chunk for up to `max_keys` keys per token: a fixed function of the model
    (index_topk, or the context length for dense attention), never of the batch."""
    keys = max(min_keys, math.ceil(max_keys / max_splits))
    return math.ceil(keys / block_n) * block_n


def decode_split_keys(batch: int, num_heads: int, max_keys: int, batch_invariant: bool,
                      block_h: int = MLA_DECODE["block_h"], block_n: int = MLA_DECODE["block_n"]) -> int:
    """Key slots per split-K chunk of a decode step of `batch` tokens; 0 = one chunk (the kernel
    writes the output directly, no partials, no combine)."""
    if batch_invariant:
        return split_keys_for(max_keys, block_n)
    head_blocks = math.ceil(num_heads / block_h)
    want = max(1, DECODE_TARGET_PROGRAMS // max(1, batch * head_blocks))
    splits = min(1 << (want.bit_length() - 1), max(1, math.ceil(max_keys / block_n)))
    if splits <= 1:
        return 0
    return math.ceil(math.ceil(max_keys / splits) / block_n) * block_n


def num_splits(max_keys: int, split_keys: int) -> int:
    """Programs per (token, head block) for a split of `split_keys` (0 = one, no partials)."""
    return math.ceil(max_keys / split_keys) if split_keys else 1


def partial_rows(batch: int, num_heads: int, max_keys: int, batch_invariant: bool) -> int:
    """(token, head, split) rows of the fp32 partials a decode step of `batch` tokens writes."""
    sk = decode_split_keys(batch, num_heads, max_keys, batch_invariant)
    return batch * num_heads * num_splits(max_keys, sk) if sk else 0
