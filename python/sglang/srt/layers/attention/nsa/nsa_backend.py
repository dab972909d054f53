"""Native sparse attention (DSA) backend, torch reference implementation ("torch").

The CPU path, and the plain twin the Triton backend is tested against. MLA over the paged latent
cache, dense (DeepSeek-V3) or restricted to the indexer's top-k (DeepSeek-V3.2 / GLM-5), in two
equivalent formulations:
- plain ("MHA"): expand the cached latents with kv_b_proj into per-head K/V, then attend;
- absorbed ("MQA"): fold kv_b_proj's K half into q and its V half into the output, and attend
  directly over the latent cache (what decode kernels such as FlashMLA do).
`mla_path="auto"` uses absorbed wherever the indexer selected keys (decode, and extend with top-k:
the selected latents are gathered per query, as FlashMLA's sparse prefill does) and plain for dense
extend. Forcing "plain" keeps the dense masked formulation, the reference for the gathered path.

KV is read through `pool.get_mla_kv` (dequantised there for an FP8 cache, --kv-cache-dtype fp8_e4m3).
Decode and top-k extend are vectorised over tokens (chunked by a memory bound); dense extend runs
per request on host-known lengths. Nothing reads a device value back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.layers.attention.attention_registry import MLA_PATHS
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.nsa.nsa_indexer import causal_topk, index_scores, index_score_dtype
from sglang.srt.layers.attention.nsa.utils import DensePrefillRule, dense_prefill_rule
from sglang.srt.mem_cache.index_k_format import fp8_round_trip
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

# Queries are processed in chunks so a [heads, chunk, keys] score block (or a [chunk, keys, D]
# gather) stays within this many elements; GPUs get larger blocks.
SCORE_BLOCK_ELEMS = 2**26
SCORE_BLOCK_ELEMS_CUDA = 2**29


def query_chunk(per_query_elems: int, device: torch.device | str = "cpu") -> int:
    elems = SCORE_BLOCK_ELEMS_CUDA if torch.device(device).type == "cuda" else SCORE_BLOCK_ELEMS
    return max(1, elems // max(per_query_elems, 1))


@dataclass
class NSAMetadata:
    """Per-forward KV layout, shared by every layer and by the DSA indexer."""

    page_table: torch.Tensor  # [B, W] KV slot of each position (0 past seq_len), W = max seq len
    kv_valid: torch.Tensor  # [B, W] bool
    seq_lens: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    starts: list[int]
    dense: list[bool]  # per request: extend through dense MHA (nsa.utils.DensePrefillRule)

    def kv_indices(self, i: int) -> torch.Tensor:
        return self.page_table[i, : self.seq_lens[i]]


def build_nsa_metadata(forward_batch: ForwardBatch, dense_rule: DensePrefillRule | None = None) -> NSAMetadata:
    r2t = forward_batch.req_to_token_pool.req_to_token
    width = forward_batch.max_seq_len
    table = r2t[forward_batch.req_pool_indices, :width].long()
    valid = torch.arange(width, device=table.device)[None, :] < forward_batch.seq_lens[:, None]
    starts, acc = [], 0
    for e in forward_batch.extend_seq_lens_cpu:
        starts.append(acc)
        acc += e
    return NSAMetadata(
        page_table=torch.where(valid, table, torch.zeros_like(table)),
        kv_valid=valid,
        seq_lens=list(forward_batch.seq_lens_cpu),
        prefix_lens=list(forward_batch.extend_prefix_lens_cpu),
        extend_lens=list(forward_batch.extend_seq_lens_cpu),
        starts=starts,
        dense=(dense_rule.requests(forward_batch.seq_lens_cpu, forward_batch.extend_seq_lens_cpu)
               if dense_rule is not None and not forward_batch.forward_mode.is_decode()
               else [False] * forward_batch.batch_size),
    )


def topk_to_mask(topk: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[..., K] request-local positions (-1 = none) -> [..., num_keys] bool selection mask."""
    idx = torch.where(topk >= 0, topk.long(), torch.full_like(topk, num_keys, dtype=torch.long))
    mask = torch.zeros(*topk.shape[:-1], num_keys + 1, dtype=torch.bool, device=topk.device)
    mask.scatter_(-1, idx, True)
    return mask[..., :num_keys]


class NativeSparseAttnBackend(AttentionBackend):
    def __init__(self, model_runner) -> None:
        mla_path = model_runner.server_args.mla_attn_path
        if mla_path not in MLA_PATHS:
            raise ValueError(f"mla_path {mla_path!r} not in {MLA_PATHS}")
        self.mla_path = mla_path  # KV is read through forward_batch.token_to_kv_pool (see triton_backend)
        self.dense_rule = dense_prefill_rule(model_runner.model_config,
                                             model_runner.server_args.enable_deterministic_inference)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        forward_batch.attn_metadata = build_nsa_metadata(forward_batch, self.dense_rule)

    # -- attention --------------------------------------------------------------------------------
    def forward_mla(self, q_nope, q_rope, latent, k_rope, layer, forward_batch: ForwardBatch, topk_indices=None,
                    save_kv_cache: bool = True) -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        if save_kv_cache:
            pool.set_mla_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, latent, k_rope)
        md: NSAMetadata = forward_batch.attn_metadata
        if forward_batch.forward_mode.is_decode():
            slots, valid = ((md.page_table, md.kv_valid) if topk_indices is None
                            else self._topk_slots(md.page_table, topk_indices))
            return self._attend_sparse(pool, layer, q_nope, q_rope, slots, valid)
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], layer.v_head_dim)
        reqs = [True] * forward_batch.batch_size
        if topk_indices is not None and self.mla_path != "plain":
            dense = md.dense
            # Gathered sparse attention, vectorised over tokens: each row picks its request's table.
            spans = ([(0, q_nope.shape[0])] if not any(dense) else
                     [(s, s + e) for s, e, d in zip(md.starts, md.extend_lens, dense) if e and not d])
            k = topk_indices.shape[1]
            step = query_chunk(k * max(layer.num_local_heads, layer.kv_lora_rank + layer.qk_rope_head_dim),
                               q_nope.device)
            for a, b in spans:
                for c in range(a, b, step):
                    rows = slice(c, min(c + step, b))
                    table = md.page_table[forward_batch.token_to_req[rows]]
                    slots, valid = self._topk_slots(table, topk_indices[rows])
                    out[rows] = self._attend_sparse(pool, layer, q_nope[rows], q_rope[rows], slots, valid)
            if not any(dense):
                return out
            topk_indices, reqs = None, dense  # what is left: the dense requests
        return self._extend_per_request(pool, layer, q_nope, q_rope, forward_batch, md, topk_indices, out, reqs)

    def _extend_per_request(self, pool, layer, q_nope, q_rope, forward_batch, md: NSAMetadata, topk_indices,
                            out: torch.Tensor, reqs: list[bool]):
        """Dense (or plain-with-top-k) extend of the requests `reqs` marks: each request's queries
        over its own cached keys. A dense request (md.dense) ignores top-k: it selects every key."""
        absorbed = self.mla_path == "absorbed"
        for i in range(forward_batch.batch_size):
            s, e = md.starts[i], md.extend_lens[i]
            if e == 0 or not reqs[i]:
                continue
            latent, k_rope = pool.get_mla_kv(layer.layer_id, md.kv_indices(i))  # [L, c], [L, r]
            kv = None if absorbed else self._expand_kv(layer, latent, q_nope.dtype)
            step = query_chunk(layer.num_local_heads * md.seq_lens[i], q_nope.device)
            for c in range(0, e, step):
                rows = slice(s + c, s + min(c + step, e))
                topk = topk_indices[rows] if topk_indices is not None and not md.dense[i] else None
                mask = self._extend_mask(md, i, forward_batch.positions[rows], topk)
                if absorbed:
                    out[rows] = self._attend_absorbed(layer, q_nope[rows], q_rope[rows], latent[None], k_rope[None],
                                                      mask)
                else:
                    out[rows] = self._attend_plain(layer, q_nope[rows], q_rope[rows], kv, k_rope, mask)
        return out

    @staticmethod
    def _topk_slots(table: torch.Tensor, topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Request-local top-k positions [n, K] (-1 = none) -> (KV slots [n, K], valid [n, K]).
        `table` is [n, W] (one row per query) or [1, W] (all queries of one request)."""
        idx = topk.long().clamp(min=0)
        slots = table.expand(idx.shape[0], -1).gather(1, idx)
        return slots, topk >= 0

    @staticmethod
    def _extend_mask(md: NSAMetadata, i: int, qpos: torch.Tensor, topk: torch.Tensor | None) -> torch.Tensor:
        """[n, L] allowed keys of request i's queries at positions qpos (causal, and top-k if any).
        Positions, not offsets: a CP rank's rows of a request are not consecutive."""
        L = md.seq_lens[i]
        mask = torch.arange(L, device=qpos.device)[None, :] <= qpos[:, None]
        if topk is not None:
            mask &= topk_to_mask(topk, L)
        return mask

    @staticmethod
    def _softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = scores.float().masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1)

    # -- plain (MHA) path -------------------------------------------------------------------------
    @staticmethod
    def _expand_kv(layer, latent: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        kv = torch.nn.functional.linear(latent.to(dtype), layer.kv_b_weight)
        kv = kv.view(latent.shape[0], layer.num_local_heads, layer.qk_nope_head_dim + layer.v_head_dim)
        k_nope, v = kv.split([layer.qk_nope_head_dim, layer.v_head_dim], dim=-1)
        return k_nope, v

    def _attend_plain(self, layer, q_nope, q_rope, kv, k_rope, mask) -> torch.Tensor:
        k_nope, v = kv
        scores = torch.einsum("ehd,lhd->hel", q_nope, k_nope)
        scores = scores + torch.einsum("ehr,lr->hel", q_rope, k_rope.to(q_rope.dtype))
        probs = self._softmax(scores * layer.scaling, mask[None])
        return torch.einsum("hel,lhv->ehv", probs.to(v.dtype), v)

    # -- absorbed (MQA) path ----------------------------------------------------------------------
    def _attend_absorbed(self, layer, q_nope, q_rope, latent, k_rope, mask) -> torch.Tensor:
        """Absorbed MLA of n queries over keys shared by all of them (latent [1, K, c], k_rope
        [1, K, r]) or gathered per query ([n, K, .]); mask [n, K] says which keys each may see."""
        q_lat = layer.absorb_q(q_nope)
        latent = latent.to(q_lat.dtype)
        scores = torch.matmul(q_lat, latent.transpose(-1, -2))  # [n, h, K]
        scores = scores + torch.matmul(q_rope, k_rope.to(q_rope.dtype).transpose(-1, -2))
        probs = self._softmax(scores * layer.scaling, mask[:, None, :])
        return layer.project_out(torch.matmul(probs.to(q_lat.dtype), latent))

    def _attend_sparse(self, pool, layer, q_nope, q_rope, slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Absorbed MLA of n queries, each over its own gathered keys: slots / valid [n, K].
        Top-k indices are causal-valid by construction, so no causal mask is applied here."""
        latent, k_rope = pool.get_mla_kv(layer.layer_id, slots)  # [n, K, c], [n, K, r]
        return self._attend_absorbed(layer, q_nope, q_rope, latent, k_rope, valid)

    # -- DSA indexer --------------------------------------------------------------------------------
    def store_index_k(self, layer_id: int, k: torch.Tensor, forward_batch: ForwardBatch) -> None:
        forward_batch.token_to_kv_pool.set_index_k(layer_id, forward_batch.out_cache_loc, k)

    def index_topk(self, indexer, q: torch.Tensor, weights: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """Score every causal key of each token's request, keep the top index_topk (reference)."""
        from sgl_kernel.topk import fast_topk_ref

        k_top = indexer.index_topk
        positions = forward_batch.positions
        if forward_batch.max_seq_len <= k_top:  # host-known: every row keeps all its keys
            return causal_topk(positions, k_top)
        md: NSAMetadata = forward_batch.attn_metadata
        pool = forward_batch.token_to_kv_pool
        dtype = index_score_dtype(pool, q.device)
        qf = (fp8_round_trip(q) if pool.index_k_fp8 else q.float()).to(dtype)
        keys = pool.get_index_k(indexer.layer_id, md.page_table).to(dtype)  # [B, W, D]
        out = torch.empty(q.shape[0], k_top, dtype=torch.int32, device=q.device)
        # Decode: row b is request b's only token. Extend: each request's tokens against its own keys
        # (broadcast, no per-token copy of the keys), in chunks of rows.
        spans = ([(0, q.shape[0], None)] if forward_batch.forward_mode.is_decode() else
                 [(s, s + e, i) for i, (s, e) in enumerate(zip(md.starts, md.extend_lens)) if e])
        for s, e, i in spans:
            kk = keys if i is None else keys[i : i + 1, : md.seq_lens[i]]
            step = query_chunk(kk.shape[1] * max(kk.shape[2], q.shape[1]), q.device)
            for c in range(s, e, step):
                rows = slice(c, min(c + step, e))
                scores = index_scores(qf[rows], kk, weights[rows], indexer.softmax_scale)
                out[rows] = fast_topk_ref(scores, positions[rows] + 1, k_top)
        return out
