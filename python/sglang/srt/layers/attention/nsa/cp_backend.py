"""NSA context parallel with shared KV: a rank's share of a batch, and the attention backend that
gives each rank's queries the full causal context.

Per forward (host, once): `build_cp_forward_batch` splits the batch's new tokens over the CP
ranks (`mem_cache.cp_page_map.split_request`), lays this rank's tokens out in per-request lanes padded with
dummy rows (every rank has the same row count), and plans the KV movement:
- stores: each rank writes the MLA KV and index K of its tokens into its own pool (physical
  slots of the pages it owns). Direct writes only when the batch is page-aligned and every valid
  row's page is verified to be this rank's; otherwise the new rows are all-gathered and each
  rank keeps those on its pages.
- views: attention and the indexer need every earlier token of the request, which lives on all
  ranks. Per layer each rank sends the pages it owns of the batch's contexts (all-gather) and the
  pages are placed into a transient view pool in request order; the wrapped backend (torch or
  Triton) runs unchanged on that view with a view req_to_token table. The view is freed after
  the layer, so what a rank keeps is only its own pages.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from sglang.srt.distributed.parallel_state import GroupCoordinator
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.nsa.utils import local_layout
from sglang.srt.mem_cache.cp_page_map import page_owner, physical_page, physical_slots, split_request
from sglang.srt.model_executor.forward_batch_info import CPBatchInfo, ForwardBatch, ForwardMode, SpecInput

logger = logging.getLogger(__name__)
# SGLANG_CP_DRAFT_SHARED_KV_DEBUG=1: log (and keep, for tests) per rank which pool each draft
# forward writes, its local rows and physical pages, and whether its hidden input was already
# local -- evidence that the draft KV is sharded like the target's. Read once: no cost when off.
DRAFT_SHARED_KV_DEBUG = os.environ.get("SGLANG_CP_DRAFT_SHARED_KV_DEBUG", "0") == "1"
DRAFT_KV_DEBUG_RECORDS: list[dict] = []


class CPLayoutError(RuntimeError):
    """A CP re-layout broke its own invariant (a page-aligned token on a rank that does not own its
    page, a draft's local rows that are not the target's split): the KV would go to the wrong rank."""


@dataclass
class CommCounter:
    """Elements moved by CP collectives, per kind (tests and benchmarks read it)."""

    elements: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, kind: str, n: int) -> None:
        self.elements[kind] = self.elements.get(kind, 0) + n


@dataclass
class CPMetadata:
    cp_rank: int
    cp_size: int
    group: GroupCoordinator
    global_batch: ForwardBatch  # the scheduler's batch (all tokens)
    num_local: int  # rows per rank (valid + dummy), equal on every rank
    valid_idx: torch.Tensor  # [V] local rows holding real tokens
    dummy_idx: torch.Tensor  # [T_local - V] padding rows
    page_aligned: bool
    store_loc: torch.Tensor  # [T_local] physical slot per local row (padding slot 0 for dummies)
    gathered_store_loc: torch.Tensor | None  # [cp * T_local] (not page-aligned batches)
    full_gather_idx: torch.Tensor  # [T] global token -> row of the all-gathered [cp * T_local]
    last_local_row: torch.Tensor  # [B] local row of each request's last token (0 where not mine)
    last_owner: torch.Tensor  # [B] rank holding each request's last token
    send_pages: torch.Tensor  # [M] this rank's physical pages of the batch contexts (0 = pad)
    view_dst: torch.Tensor  # [cp * M] view page of each gathered page (num_view_pages = dump)
    num_view_pages: int
    view_fb: ForwardBatch  # the local rows over the view table (what the wrapped backend sees)
    counter: CommCounter

    def all_gather_rows(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """[n, ...] on every rank -> [cp * n, ...] (rank-major)."""
        self.counter.add(kind, x.numel() * self.cp_size)
        return self.group.all_gather(x.contiguous(), dim=0)


class _ViewTable:
    def __init__(self, req_to_token: torch.Tensor) -> None:
        self.req_to_token = req_to_token


def build_cp_forward_batch(fb: ForwardBatch, req_to_token_cpu: torch.Tensor, group: GroupCoordinator,
                           mode: str, page_size: int, counter: CommCounter) -> ForwardBatch:
    """This rank's share of `fb` (host work only; one upload)."""
    cp, rank, ps = group.world_size, group.rank, page_size
    h = fb.host_rows
    ids, pos, loc = h["input_ids"], h["positions"], h["out_cache_loc"].to(torch.int64)
    b = fb.batch_size
    starts = [0]
    for e in fb.extend_seq_lens_cpu[:-1]:
        starts.append(starts[-1] + e)
    token_ranks, aligned = [], True
    for i in range(b):
        s, e, pl = starts[i], fb.extend_seq_lens_cpu[i], fb.extend_prefix_lens_cpu[i]
        if fb.cp.split_by_slot_owner:  # slots placed by another forward's split: follow its pages
            token_ranks.append(page_owner(loc[s : s + e] // ps, cp).tolist())
            continue
        prev = page_owner(int(loc[s]) // ps, cp) if e and pl % ps else None
        split = split_request(pl, e, ps, cp, mode, prev)
        token_ranks.append(split.token_ranks)
        aligned &= split.page_aligned
    layouts = [local_layout(token_ranks, r, cp) for r in range(cp)]
    lanes, rows, valid = layouts[rank]
    t_local = len(rows)
    rows_t = torch.tensor(rows, dtype=torch.int64)
    is_valid = rows_t >= 0
    safe = rows_t.clamp(min=0)
    lane_starts = torch.cumsum(torch.tensor(lanes), 0) - torch.tensor(lanes)
    tok_req = torch.repeat_interleave(torch.arange(b), torch.tensor(lanes))
    local_ids = torch.where(is_valid, ids[safe], 0)
    local_pos = torch.where(is_valid, pos[safe], 0)  # a dummy row reads its request's key 0
    local_loc = torch.where(is_valid, loc[safe], 0)
    owner = page_owner(local_loc // ps, cp)
    if aligned and bool((owner[is_valid] != rank).any()):
        raise CPLayoutError("CP page ownership check failed: a page-aligned split put a token on a "
                            "rank that does not own its page")
    store_loc = torch.where(is_valid, physical_slots(local_loc, ps, cp), 0)

    # all-gathered rows (rank-major): global token index of each, for the fallbacks
    g_rows = torch.tensor([g for _, rr, _ in layouts for g in rr], dtype=torch.int64)
    full_gather_idx = torch.empty(fb.num_tokens, dtype=torch.int64)
    ok = g_rows >= 0
    full_gather_idx[g_rows[ok]] = torch.nonzero(ok).flatten()
    gathered_store_loc = None
    if not aligned:
        g_loc = torch.where(ok, loc[g_rows.clamp(min=0)], 0)
        mine = ok & (page_owner(g_loc // ps, cp) == rank)
        gathered_store_loc = torch.where(mine, physical_slots(g_loc, ps, cp), 0)
    last_global = torch.tensor([starts[i] + fb.extend_seq_lens_cpu[i] - 1 for i in range(b)], dtype=torch.int64)
    last_flat = full_gather_idx[last_global]
    last_owner = last_flat // t_local
    last_local_row = torch.where(last_owner == rank, last_flat % t_local, 0)

    # the view: every page of each request's context, in request order
    req_rows = h["req_pool_indices"]
    seq_lens = fb.seq_lens_cpu
    view_pages, base = [], []
    for i in range(b):
        n_pages = -(-seq_lens[i] // ps)
        base.append(len(view_pages))
        view_pages.extend((req_to_token_cpu[int(req_rows[i]), : n_pages * ps : ps].to(torch.int64) // ps).tolist())
    n_view = len(view_pages)
    vp = torch.tensor(view_pages, dtype=torch.int64)
    v_owner = page_owner(vp, cp)
    per_rank = [torch.nonzero(v_owner == r).flatten() for r in range(cp)]
    m = max(1, max(len(x) for x in per_rank))
    view_dst = torch.full((cp, m), n_view, dtype=torch.int64)
    for r, x in enumerate(per_rank):
        view_dst[r, : len(x)] = x
    send_pages = torch.zeros(m, dtype=torch.int64)
    mine_v = per_rank[rank]
    send_pages[: len(mine_v)] = physical_page(vp[mine_v], cp)
    width = max(seq_lens) if seq_lens else 1
    p_ar = torch.arange(width)
    table = torch.zeros(b, width, dtype=torch.int32)
    for i in range(b):
        L = seq_lens[i]
        table[i, :L] = ((base[i] + p_ar[:L] // ps) * ps + p_ar[:L] % ps).int()

    dev = fb.input_ids.device
    packed = torch.cat([local_ids, local_pos, tok_req, store_loc, full_gather_idx, last_local_row, last_owner,
                        send_pages, view_dst.reshape(-1), torch.arange(b),
                        torch.tensor(lanes, dtype=torch.int64), lane_starts,
                        torch.tensor(valid, dtype=torch.int64),
                        torch.nonzero(~is_valid).flatten(),
                        gathered_store_loc if gathered_store_loc is not None else torch.empty(0, dtype=torch.int64)])
    if dev.type == "cuda":
        packed = packed.pin_memory()
    up = packed.to(dev, non_blocking=True)
    sizes = [t_local] * 4 + [fb.num_tokens, b, b, m, cp * m, b, b, b, len(valid), t_local - len(valid),
                             0 if gathered_store_loc is None else len(gathered_store_loc)]
    (d_ids, d_pos, d_tok_req, d_store, d_full, d_last_row, d_last_owner, d_send, d_view_dst, d_arange, d_lanes,
     d_lane_starts, d_valid, d_dummy, d_gstore) = up.split(sizes)
    d_table = table.to(dev, non_blocking=True)
    mode_local = fb.forward_mode if fb.forward_mode != ForwardMode.DECODE or all(x == 1 for x in lanes) \
        else ForwardMode.EXTEND
    common = dict(forward_mode=mode_local, batch_size=b, input_ids=d_ids, positions=d_pos, seq_lens=fb.seq_lens,
                  extend_prefix_lens=fb.extend_prefix_lens, extend_seq_lens=d_lanes, extend_start_loc=d_lane_starts,
                  token_to_req=d_tok_req, seq_lens_cpu=list(seq_lens), extend_seq_lens_cpu=list(lanes),
                  extend_prefix_lens_cpu=list(fb.extend_prefix_lens_cpu), positions_cpu=local_pos.tolist(),
                  return_logprob=fb.return_logprob, sampling_info=fb.sampling_info,
                  capture_hidden_mode=fb.capture_hidden_mode)
    view_fb = ForwardBatch(req_pool_indices=d_arange, out_cache_loc=d_store, req_to_token_pool=_ViewTable(d_table),
                           **common)
    md = CPMetadata(
        cp_rank=rank, cp_size=cp, group=group, global_batch=fb, num_local=t_local, valid_idx=d_valid,
        dummy_idx=d_dummy, page_aligned=aligned, store_loc=d_store,
        gathered_store_loc=d_gstore if gathered_store_loc is not None else None, full_gather_idx=d_full,
        last_local_row=d_last_row, last_owner=d_last_owner, send_pages=d_send, view_dst=d_view_dst,
        num_view_pages=n_view, view_fb=view_fb, counter=counter)
    local = ForwardBatch(req_pool_indices=fb.req_pool_indices, out_cache_loc=d_store, cp=CPBatchInfo(metadata=md),
                         req_to_token_pool=fb.req_to_token_pool, token_to_kv_pool=fb.token_to_kv_pool,
                         attn_backend=fb.attn_backend, **common)
    if fb.spec is not None:
        local.spec = _local_spec_inputs(fb.spec, safe, t_local)
        if DRAFT_SHARED_KV_DEBUG:
            _record_draft_kv(fb, local, store_loc, is_valid, aligned, rank)
    return local


def _local_spec_inputs(spec: SpecInput, safe_rows: torch.Tensor, t_local: int) -> SpecInput:
    """The NextN draft's inputs in this rank's layout. Hidden states / top-k already in it (the
    target's FULL_LOCAL capture of the same batch: same split, same rows) are used as they are --
    the prefill path, where no rank materialises the full hidden states; inputs in the scheduler's
    order (decode steps, a verify's accepted rows: a few rows per request) are sliced locally."""
    if spec.rows_local:
        if spec.hidden_states.shape[0] != t_local:
            raise CPLayoutError(f"CP draft extend: {spec.hidden_states.shape[0]} local hidden rows for a "
                                f"layout of {t_local} (the draft's split must equal the target's)")
        return SpecInput(spec.hidden_states, spec.topk_indices, rows_local=True)
    idx = safe_rows.to(spec.hidden_states.device, non_blocking=True)
    topk = spec.topk_indices[idx] if spec.topk_indices is not None else None
    return SpecInput(spec.hidden_states[idx], topk, rows_local=True)


def _record_draft_kv(fb: ForwardBatch, local: ForwardBatch, store_loc: torch.Tensor, is_valid: torch.Tensor,
                     aligned: bool, rank: int) -> None:
    """SGLANG_CP_DRAFT_SHARED_KV_DEBUG: which pool and physical pages a draft forward writes."""
    pool = fb.token_to_kv_pool
    pages = torch.unique(store_loc[is_valid] // pool.page_size).tolist()
    rec = dict(rank=rank, pool=f"{type(pool).__name__}@{id(pool):x}", pool_layers=pool.layer_num,
               pool_slots=pool.size, local_rows=local.num_tokens, valid_rows=int(is_valid.sum()),
               hidden_rows=int(local.spec.hidden_states.shape[0]), hidden_local_input=bool(fb.spec.rows_local),
               direct_local_writes=aligned, physical_pages=pages)
    DRAFT_KV_DEBUG_RECORDS.append(rec)
    logger.info("CP draft shared KV: %s", rec)


class NSAContextParallelBackend(AttentionBackend):
    """Wraps a torch or Triton NSA backend: stores go to this rank's pages, attention and the
    indexer run on a per-layer view of the full contexts."""

    supports_cuda_graph = False  # collectives + host-planned views per step

    def __init__(self, inner: AttentionBackend, pool) -> None:
        self.inner, self.pool = inner, pool

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        md: CPMetadata = forward_batch.cp.metadata
        md.view_fb.attn_backend = self.inner
        self.inner.init_forward_metadata(md.view_fb)
        forward_batch.attn_metadata = md

    # -- stores -----------------------------------------------------------------------------------
    def _store_rows(self, md: CPMetadata, kind: str, *rows: torch.Tensor):
        """(loc, rows...) to write into this rank's pool: direct when page-aligned, else gathered."""
        if md.page_aligned:
            return (md.store_loc, *rows)
        return (md.gathered_store_loc, *[md.all_gather_rows(r, kind) for r in rows])

    def store_index_k(self, layer_id: int, k: torch.Tensor, forward_batch: ForwardBatch) -> None:
        md: CPMetadata = forward_batch.cp.metadata
        loc, k_rows = self._store_rows(md, "store_index_k", k)
        store_fb = dataclasses.replace(md.view_fb, out_cache_loc=loc, token_to_kv_pool=self.pool)
        self.inner.store_index_k(layer_id, k_rows, store_fb)

    # -- views ------------------------------------------------------------------------------------
    def _gather_pages(self, md: CPMetadata, pages: torch.Tensor, kind: str) -> torch.Tensor:
        got = md.all_gather_rows(pages, kind)  # [cp * M, ...]
        view = pages.new_zeros((md.num_view_pages + 1, *pages.shape[1:]))
        view[md.view_dst] = got  # pad entries land on the dump page (last)
        return view

    def _mla_view(self, md: CPMetadata, layer_id: int):
        pages = self.pool.get_kv_pages(layer_id, md.send_pages)  # [M, ps, dim]
        view = self._gather_pages(md, pages, "view_kv")
        kv = view.reshape(-1, 1, view.shape[-1])
        return self.pool.layer_view(layer_id, kv=kv)

    def _index_view(self, md: CPMetadata, layer_id: int):
        rows = self.pool.get_index_k_pages(layer_id, md.send_pages)  # [M, page bytes]
        return self.pool.layer_view(layer_id, index_rows=self._gather_pages(md, rows, "view_index_k"))

    # -- attention / indexer ----------------------------------------------------------------------
    def forward_mla(self, q_nope, q_rope, latent, k_rope, layer, forward_batch: ForwardBatch, topk_indices=None,
                    save_kv_cache: bool = True) -> torch.Tensor:
        md: CPMetadata = forward_batch.cp.metadata
        if save_kv_cache:
            loc, lat, rope = self._store_rows(md, "store_kv", latent, k_rope)
            self.pool.set_mla_kv_buffer(layer.layer_id, loc, lat, rope)
        md.view_fb.token_to_kv_pool = self._mla_view(md, layer.layer_id)
        try:
            return self.inner.forward_mla(q_nope, q_rope, latent, k_rope, layer, md.view_fb, topk_indices,
                                          save_kv_cache=False)
        finally:
            md.view_fb.token_to_kv_pool = None  # the view is transient: freed after the layer

    def index_topk(self, indexer, q: torch.Tensor, weights: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        md: CPMetadata = forward_batch.cp.metadata
        md.view_fb.token_to_kv_pool = self._index_view(md, indexer.layer_id)
        try:
            return self.inner.index_topk(indexer, q, weights, md.view_fb)
        finally:
            md.view_fb.token_to_kv_pool = None


def cp_collect_last_token_hidden(hidden: torch.Tensor, md: CPMetadata) -> torch.Tensor:
    """Narrow gather: each request's last-token hidden state from the rank that computed it.
    Moves cp x bs x hidden elements (not total_tokens x hidden)."""
    mine = hidden[md.last_local_row]  # [B, H]; rows of other ranks' requests are ignored below
    got = md.all_gather_rows(mine, "narrow_gather").view(md.cp_size, -1, hidden.shape[-1])
    return got[md.last_owner, torch.arange(got.shape[1], device=hidden.device)]


def cp_all_gather_hidden(hidden: torch.Tensor, md: CPMetadata) -> torch.Tensor:
    """Full gather: every token's hidden state in the scheduler's (global) order."""
    return md.all_gather_rows(hidden, "full_gather")[md.full_gather_idx]
