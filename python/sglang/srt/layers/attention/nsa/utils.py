"""NSA helpers shared by the indexer, the backends and IndexCache, and the context-parallel
compute layout (lanes of valid + dummy rows). The CP page map and per-request split live in
`sglang.srt.mem_cache.cp_page_map` (storage rules: the allocator uses them too).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# Upstream's knob (both spellings): requests with at most this many keys prefill through dense MHA.
DENSE_PREFILL_ENV = ("SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD", "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD")


@dataclass(frozen=True)
class DensePrefillRule:
    """Which requests of an extend run dense (non-absorbed) MHA instead of the sparse MLA path.

    A request qualifies when its whole KV (prefix + new) is at most `threshold` keys -- there the
    indexer selects every causal key, so both paths compute the same attention within rounding --
    and the dense form is the cheaper one: it first decompresses each key's latent through kv_b_proj
    (L x C x (nope + v) multiply-adds per head), then spends nope + rope + v per (row, key, head)
    where the absorbed form spends C + rope + C. A short extend over a long prefix (a decode-like
    chunk) stays sparse."""

    threshold: int  # 0: off
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def requests(self, seq_lens: list[int], extend_lens: list[int]) -> list[bool]:
        c, dn, dr, dv = self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        out = []
        for n, e in zip(seq_lens, extend_lens):
            if not (0 < e <= n <= self.threshold):
                out.append(False)
                continue
            keys = e * (n - (e - 1) / 2)  # causal keys summed over the new rows (positions n-e .. n-1)
            out.append(n * c * (dn + dv) + keys * (dn + dr + dv) < keys * (2 * c + dr))
        return out


def dense_prefill_rule(model_config, deterministic: bool) -> DensePrefillRule:
    """The rule for this model: threshold index_topk unless the env knob says otherwise (0 = off).
    Off for models without an indexer and under --enable-deterministic-inference (the two forms
    round differently, and a verify row must compute as plain decoding does)."""
    topk = model_config.index_topk
    raw = next((os.environ[k] for k in DENSE_PREFILL_ENV if os.environ.get(k, "") != ""), None)
    value = topk
    if raw is not None:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{DENSE_PREFILL_ENV[0]}={raw!r} is not an integer") from None
        if not 0 <= value <= max(topk, 0):
            raise ValueError(f"{DENSE_PREFILL_ENV[0]}={value} must be in [0, index_topk={topk}]: "
                             "above index_topk dense attention would see keys the indexer drops")
    off = deterministic or not topk or not (model_config.qk_nope_head_dim and model_config.v_head_dim)
    return DensePrefillRule(0 if off else value, model_config.kv_lora_rank,
                            model_config.qk_nope_head_dim, model_config.qk_rope_head_dim, model_config.v_head_dim)


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
