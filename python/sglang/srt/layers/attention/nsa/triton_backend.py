"""NSA backend on the Triton kernels of sgl_kernel ("triton"): the GPU serving path.

Per layer: KV store (one kernel), q absorption (one bmm), sparse or dense-causal MLA over the paged
latent cache (sgl_kernel.sparse_mla; split-K + combine in decode), output projection (one bmm).
Indexer: index-K store (quantise + scale write, one kernel), scores over the paged FP8 index K
with head weights, ReLU and head sum fused (sgl_kernel.indexer), then a length-aware, tie-stable
top-k (sgl_kernel.topk). All metadata comes from the ForwardBatch and host lists; decode is
CUDA-graph capturable (scores width = context length, fixed split-K chunking).
With `--kv-cache-dtype fp8_e4m3` the pool's buffer is uint8 FP8 rows (mem_cache/kv_fp8_format.py): the
store kernel quantises, the attention kernel dequantises keys as it loads them; nothing else changes.

Equivalence with the torch twin (NativeSparseAttnBackend) is tested on CPU under Triton's
interpreter, kernel by kernel and through the whole model against transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sgl_kernel.mla_split import MLA_EXTEND, decode_split_keys, decode_tile, graph_partial_rows
from sgl_kernel.topk_plan import prefilter_for, scratch_bytes_per_row

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.nsa.nsa_indexer import causal_topk, fold_fp8_query
from sglang.srt.layers.attention.nsa.utils import dense_prefill_rule
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.utils.common import upload

# Scores of one extend chunk ([tokens, width] fp32) stay within this many bytes.
CPU_SCORE_BUDGET = 2**26
CUDA_SCORE_BUDGET_MAX = 2**31
INDEX_ROWS_PER_BLOCK = 128  # token block x index heads: the M of the scoring matmul
# MLA tiles per mode: sgl_kernel.mla_split (decode_tile, MLA_EXTEND).
INDEX_BLOCK_N = 128
# Dense MHA of short prefills (sgl_kernel.mha_prefill): the fastest of 5 tiles on the H100 at 1K / 2K
# tokens, 128 heads (0.31 / 0.75 ms, against 0.91 / 3.30 ms for the sparse kernel over all keys).
MHA_PREFILL = dict(block_m=64, block_n=64, num_warps=4, num_stages=2)


@dataclass
class DenseMHAMetadata:
    """The extend's dense requests (nsa.utils.DensePrefillRule): their query blocks, and every key
    of theirs gathered once per forward (all layers read the same slots)."""

    q_blocks: torch.Tensor  # int32 [NB, 3] (first row, rows, dense request) -- mha_prefill.plan_q_blocks
    kv_start: torch.Tensor  # int32 [D] first key row of each dense request in `slots`
    kv_len: torch.Tensor  # int32 [D]
    slots: torch.Tensor  # int64 [L] KV slots of the dense requests' keys, request after request
    every_request: bool  # no sparse request: the sparse kernel is skipped


@dataclass
class TritonNSAMetadata:
    req_to_token: torch.Tensor  # device [slots + 1, context] int32
    score_width: int  # W of the index score buffer (> every position in the batch)
    index_blocks: torch.Tensor  # int32 [NB, 2]: (first token, count) blocks of one request
    block_t: int
    # extend: (token start, token end, first block, end block) per score chunk
    chunks: list[tuple[int, int, int, int]]
    split: bool = False  # decode: split-K attention
    split_keys: int = 0  # decode: key slots per split-K chunk (0: one chunk), mla_split.decode_split_keys
    tile: dict | None = None  # decode: the launch tile (mla_split.decode_tile)
    partial: tuple[torch.Tensor, torch.Tensor] | None = None  # preallocated split-K buffers
    dense: DenseMHAMetadata | None = None  # extend: requests that run dense MHA


class TritonNSABackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, model_runner) -> None:
        mc = model_runner.model_config
        # KV is read through forward_batch.token_to_kv_pool / req_to_token_pool (a CP view may
        # stand in for the rank's own pool); the runner's pool only sizes the graph buffers.
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.device = model_runner.device
        self.context_len = mc.context_len
        self.num_heads = mc.num_attention_heads // model_runner.tp_group.world_size
        self.kv_lora_rank = mc.kv_lora_rank
        self.topk_width = mc.index_topk if mc.is_dsa else 0
        self.index_heads = mc.index_n_heads if mc.is_dsa else 0
        # Decode split-K (sgl_kernel.mla_split): a fixed chunking of a token's keys under
        # deterministic inference (batch-invariant results), else chosen by the batch size.
        self.max_keys = self.topk_width if mc.is_dsa else self.context_len
        self.batch_invariant = bool(model_runner.server_args.enable_deterministic_inference)
        self.dense_rule = dense_prefill_rule(mc, model_runner.server_args.enable_deterministic_inference)
        self._graph_md: dict[int, TritonNSAMetadata] = {}
        self._graph_partial: tuple[torch.Tensor, torch.Tensor] | None = None
        self._graph_blocks: torch.Tensor | None = None

    # -- metadata ---------------------------------------------------------------------------------
    def _block_t(self) -> int:
        return max(1, INDEX_ROWS_PER_BLOCK // max(self.index_heads, 1))

    def _score_budget(self) -> int:
        if torch.device(self.device).type != "cuda":
            return CPU_SCORE_BUDGET
        # A fresh reading each prefill: free device memory plus what the caching allocator holds.
        free, _ = torch.cuda.mem_get_info()
        cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        return int(min(CUDA_SCORE_BUDGET_MAX, (free + cached) // 4))

    def _decode_metadata(self, r2t: torch.Tensor, width: int, blocks: torch.Tensor) -> TritonNSAMetadata:
        tile = decode_tile(len(blocks), self.batch_invariant)
        sk = decode_split_keys(len(blocks), self.num_heads, self.max_keys, self.batch_invariant, tile)
        return TritonNSAMetadata(r2t, width, blocks, 1, [], split=True, split_keys=sk, tile=tile)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        width = max(fb.max_seq_len, 1)
        if fb.forward_mode.is_decode():
            bs = fb.batch_size
            blocks = torch.stack([torch.arange(bs, device=fb.positions.device),
                                  torch.ones(bs, dtype=torch.int64, device=fb.positions.device)], 1).int()
            fb.attn_metadata = self._decode_metadata(fb.req_to_token_pool.req_to_token, width, blocks)
            return
        fb.attn_metadata = self._extend_metadata(fb, width)

    def _extend_metadata(self, fb: ForwardBatch, width: int) -> TritonNSAMetadata:
        """Token blocks for the index scores, grouped into chunks whose [tokens, width] score buffer
        fits the memory budget. Blocks whose rows are no longer than index_topk are left out: their
        top-k is every causal key, no score needed."""
        block_t = self._block_t()
        row_bytes = 4 * width + scratch_bytes_per_row(width, self.topk_width)  # scores + top-k scratch
        chunk = max(block_t, self._score_budget() // row_bytes)
        blocks: list[tuple[int, int]] = []
        chunks: list[tuple[int, int, int, int]] = []
        t_total = fb.num_tokens
        starts, acc = [], 0
        for e in fb.extend_seq_lens_cpu:
            starts.append(acc)
            acc += e
        host_pos = fb.positions_cpu
        for cs in range(0, t_total, chunk):
            ce = min(cs + chunk, t_total)
            b0 = len(blocks)
            if self.topk_width:
                for s, e, p in zip(starts, fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu):
                    lo, hi = max(s, cs), min(s + e, ce)
                    for t0 in range(lo, hi, block_t):
                        n = min(block_t, hi - t0)
                        last = max(host_pos[t0 : t0 + n]) if host_pos is not None else p + (t0 - s) + n - 1
                        if last + 1 > self.topk_width:  # a row longer than index_topk
                            blocks.append((t0, n))
            chunks.append((cs, ce, b0, len(blocks)))
        table = upload(torch.tensor(blocks, dtype=torch.int32).reshape(-1, 2), fb.positions.device)
        return TritonNSAMetadata(fb.req_to_token_pool.req_to_token, width, table, block_t, chunks,
                                 dense=self._dense_metadata(fb, starts))

    def _dense_metadata(self, fb: ForwardBatch, starts: list[int]) -> DenseMHAMetadata | None:
        from sgl_kernel.mha_prefill import plan_q_blocks

        dense = self.dense_rule.requests(fb.seq_lens_cpu, fb.extend_seq_lens_cpu)
        reqs = [i for i, d in enumerate(dense) if d]
        if not reqs:
            return None
        lens = [fb.seq_lens_cpu[i] for i in reqs]
        blocks = plan_q_blocks([starts[i] for i in reqs], [fb.extend_seq_lens_cpu[i] for i in reqs],
                               MHA_PREFILL["block_m"])
        kv_start = [sum(lens[:j]) for j in range(len(lens))]
        key_req = [i for i, n in zip(reqs, lens) for _ in range(n)]
        key_pos = [p for n in lens for p in range(n)]
        # one upload for the step: [blocks | kv_start | kv_len | key request | key position]
        nb, d, n = len(blocks), len(reqs), len(key_req)
        flat = [x for b in blocks for x in b] + kv_start + lens + key_req + key_pos
        dev = upload(torch.tensor(flat, dtype=torch.int64), fb.positions.device)
        o = 3 * nb
        q_blocks, kv_s, kv_l = dev[:o].view(nb, 3).int(), dev[o: o + d].int(), dev[o + d: o + 2 * d].int()
        rows = fb.req_pool_indices[dev[o + 2 * d: o + 2 * d + n]]
        slots = fb.req_to_token_pool.req_to_token[rows, dev[o + 2 * d + n:]].long()
        return DenseMHAMetadata(q_blocks, kv_s, kv_l, slots, every_request=len(reqs) == fb.batch_size)

    # -- CUDA graphs (decode) -----------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int) -> None:
        dev = self.req_to_token_pool.req_to_token.device
        n = graph_partial_rows(max_bs, self.num_heads, self.max_keys, self.batch_invariant)
        self._graph_partial = (torch.empty(n * self.kv_lora_rank, dtype=torch.float32, device=dev),
                               torch.empty(n, dtype=torch.float32, device=dev))
        ar = torch.arange(max_bs, device=dev, dtype=torch.int32)
        self._graph_blocks = torch.stack([ar, torch.ones_like(ar)], 1)

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        bs = forward_batch.batch_size
        md = self._decode_metadata(self.req_to_token_pool.req_to_token, self.context_len, self._graph_blocks[:bs])
        md.partial = self._graph_partial
        self._graph_md[bs] = md
        forward_batch.attn_metadata = md

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        # Everything the captured kernels read lives in the graph's static ForwardBatch buffers
        # and in the preallocated partials: nothing to refresh.
        forward_batch.attn_metadata = self._graph_md[forward_batch.batch_size]

    # -- attention --------------------------------------------------------------------------------
    def forward_mla(self, q_nope, q_rope, latent, k_rope, layer, forward_batch: ForwardBatch, topk_indices=None,
                    save_kv_cache: bool = True) -> torch.Tensor:
        from sgl_kernel.kv_store import store_mla_kv
        from sgl_kernel.sparse_mla import mla_attention

        fb = forward_batch
        md: TritonNSAMetadata = fb.attn_metadata
        pool = fb.token_to_kv_pool
        if save_kv_cache:
            store_mla_kv(pool.get_kv_store_buffer(layer.layer_id), fb.out_cache_loc, latent, k_rope)
        dm = md.dense
        if dm is not None and dm.every_request:
            out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], layer.v_head_dim)
        else:
            q_lat = layer.absorb_q(q_nope)
            split = md.split
            o_lat = mla_attention(
                q_lat, q_rope, pool.get_key_buffer(layer.layer_id), layer.kv_lora_rank, md.req_to_token,
                fb.req_pool_indices, fb.token_to_req, fb.positions, topk_indices, layer.scaling,
                split_keys=md.split_keys if split else 0,
                max_keys=(topk_indices.shape[1] if topk_indices is not None else md.score_width) if split else 0,
                partial=md.partial, **(md.tile if split else MLA_EXTEND))
            out = layer.project_out(o_lat)
        if dm is not None:  # the dense requests' rows, over every key (computed sparse above if mixed)
            self._dense_mha(q_nope, q_rope, layer, pool, fb, dm, out)
        return out

    @staticmethod
    def _dense_mha(q_nope, q_rope, layer, pool, fb: ForwardBatch, dm: DenseMHAMetadata, out: torch.Tensor) -> None:
        """Non-absorbed MLA: decompress the keys' latents through kv_b_proj, then causal MHA."""
        from sgl_kernel.mha_prefill import mha_prefill

        latent, k_rope = pool.get_mla_kv(layer.layer_id, dm.slots)  # [L, C], [L, R]
        dn = layer.qk_nope_head_dim
        kv = torch.nn.functional.linear(latent.to(q_nope.dtype), layer.kv_b_weight)
        kv = kv.view(latent.shape[0], layer.num_local_heads, dn + layer.v_head_dim)
        mha_prefill(q_nope, q_rope, kv[..., :dn], k_rope.to(q_rope.dtype), kv[..., dn:], dm.q_blocks, dm.kv_start,
                    dm.kv_len, fb.positions, layer.scaling, out, **MHA_PREFILL)

    # -- DSA indexer --------------------------------------------------------------------------------
    def store_index_k(self, layer_id: int, k: torch.Tensor, forward_batch: ForwardBatch) -> None:
        from sgl_kernel.kv_store import store_index_k

        pool = forward_batch.token_to_kv_pool
        store_index_k(pool.get_index_k_store_buffer(layer_id), forward_batch.out_cache_loc, k, pool.page_size,
                      pool.data_dtype)

    @staticmethod
    def _score_inputs(pool, indexer, q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = torch.float32 if q.dtype == torch.float32 else torch.bfloat16
        if pool.index_k_fp8:
            return fold_fp8_query(q, weights, indexer.softmax_scale, dtype)
        return q.to(dtype).contiguous(), (weights.float() * indexer.softmax_scale).contiguous()

    def index_topk(self, indexer, q: torch.Tensor, weights: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        from sgl_kernel.indexer import index_scores
        from sgl_kernel.topk import fast_topk

        fb = forward_batch
        md: TritonNSAMetadata = fb.attn_metadata
        k_top = indexer.index_topk
        decode = fb.forward_mode.is_decode()
        if not decode and not md.index_blocks.shape[0]:
            return causal_topk(fb.positions, k_top)  # host-known: no row longer than index_topk
        pool = fb.token_to_kv_pool
        qk, w = self._score_inputs(pool, indexer, q, weights)
        buf = pool.get_index_k_buffer(indexer.layer_id)
        common = dict(index_k_buffer=buf, page_size=pool.page_size, data_dtype=pool.data_dtype,
                      req_to_token=md.req_to_token, req_pool_indices=fb.req_pool_indices,
                      token_to_req=fb.token_to_req, positions=fb.positions, skip_below=k_top,
                      block_n=INDEX_BLOCK_N)
        lengths = fb.positions + 1
        if decode:
            scores = torch.empty(qk.shape[0], md.score_width, dtype=torch.float32, device=qk.device)
            index_scores(qk, w, blocks=md.index_blocks, out=scores, block_t=1, **common)
            return fast_topk(scores, lengths, k_top)
        out = torch.empty(qk.shape[0], k_top, dtype=torch.int32, device=qk.device)
        for ts, te, b0, b1 in md.chunks:
            scores = torch.empty(te - ts, md.score_width, dtype=torch.float32, device=qk.device)
            index_scores(qk, w, blocks=md.index_blocks[b0:b1], out=scores, block_t=md.block_t, out_row0=ts, **common)
            fast_topk(scores, lengths[ts:te], k_top, out=out[ts:te], prefilter=prefilter_for(md.score_width, k_top))
        return out
