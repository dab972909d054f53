"""How a decode step's keys are split over programs of the sparse MLA kernel (sgl_kernel.sparse_mla).

Importing this module imports neither torch nor Triton (the memory plan sizes the split-K partials
with it before any kernel exists).

Two rules, one per promise:
- batch-invariant (`--enable-deterministic-inference`): a fixed chunking of a token's keys
  (`split_keys_for`, a function of the model only), so a request's reduction order is the same
  alone or in any batch;
- otherwise by batch size, the way FlashMLA's scheduler metadata does (`decode_split_keys`): a
  program count per step for the batch's tile (`decode_tile`). One request needs many splits to
  fill the GPU; 64 do not, and each split costs a [heads, latent] fp32 partial written and read
  back. On the H100 at V3.2's shapes (2048 keys, 128 heads) the 32-head tile's fastest fixed split
  was 64 keys at batch 1 (0.018 ms vs 0.029 at the fixed 256), 512 at 16 (0.082 vs 0.105) and none
  at 64 (0.251 vs 0.403 ms): 128-256 programs each time. The default mode is not batch-invariant
  anyway (cuBLAS picks its GEMM kernels by the row count).
"""

from __future__ import annotations

import math

# The decode tiles (H100, 2026-12-07 (f), benchmark/kernels/bench_attention_kernels.py) and the
# programs a step aims at with each: 32 heads x 64 keys, 4 warps, 2 per SM (2 waves of the H100's /
# H200's 132 SMs); 64 heads x 64 keys, 8 warps, 3 stages (a wgmma M of 64), 1 per SM. The wide tile
# won from batch 16 up (0.066 vs 0.080 ms at 16, 0.197 vs 0.253 at 64 in a graph) and at the fixed
# split (0.31 vs 0.41 ms at 64, equal at 1); the narrow one at batch 1, where only a 64-key split
# fills the GPU (0.018 ms).
MLA_DECODE = dict(block_h=32, block_n=64, num_warps=4)
MLA_DECODE_WIDE = dict(block_h=64, block_n=64, num_warps=8, num_stages=3)
DECODE_TARGET_PROGRAMS = 264  # narrow tile
WIDE_TARGET_PROGRAMS = 132  # wide tile
WIDE_MIN_BATCH = 8
# Extend (one split per token, the output written directly): 3 stages, the gathered K tiles prefetched
# two blocks ahead (H100 32K prefill 79 vs 122 ms at 2).
MLA_EXTEND = dict(block_h=64, block_n=64, num_warps=8, num_stages=3)


def decode_tile(batch: int, batch_invariant: bool) -> dict:
    """The decode launch tile for `batch` tokens (one tile for every batch when batch-invariant)."""
    return MLA_DECODE_WIDE if batch_invariant or batch >= WIDE_MIN_BATCH else MLA_DECODE


def split_keys_for(max_keys: int, block_n: int = 32, max_splits: int = 32, min_keys: int = 256) -> int:
    """Keys per split-K chunk for up to `max_keys` keys per token: a fixed function of the model
    (index_topk, or the context length for dense attention), never of the batch."""
    keys = max(min_keys, math.ceil(max_keys / max_splits))
    return math.ceil(keys / block_n) * block_n


def decode_split_keys(batch: int, num_heads: int, max_keys: int, batch_invariant: bool,
                      tile: dict | None = None) -> int:
    """Key slots per split-K chunk of a decode step of `batch` tokens with `tile` (default:
    decode_tile's); 0 = one chunk (the kernel writes the output directly, no partials, no combine)."""
    tile = tile or decode_tile(batch, batch_invariant)
    block_h, block_n = tile["block_h"], tile["block_n"]
    if batch_invariant:
        return split_keys_for(max_keys, block_n)
    head_blocks = math.ceil(num_heads / block_h)
    target = WIDE_TARGET_PROGRAMS if block_h >= 64 else DECODE_TARGET_PROGRAMS  # 64-head tiles: 1 per SM
    want = max(1, target // max(1, batch * head_blocks))
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


def graph_partial_rows(max_batch: int, num_heads: int, max_keys: int, batch_invariant: bool | None) -> int:
    """Partial rows the decode CUDA graphs share (one buffer for batch sizes 1..max_batch: the largest
    step's); batch_invariant None = either mode (the memory plan, which does not know it)."""
    modes = (False, True) if batch_invariant is None else (batch_invariant,)
    return max(partial_rows(b, num_heads, max_keys, inv) for b in range(1, max_batch + 1) for inv in modes)
