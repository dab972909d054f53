"""NSA context parallel: a rank's share of a batch, planned on the host (`build_cp_forward_batch`,
which the CP backend's `prepare_batch` runs once per forward), and the gathers that bring its rows
back for the logits (`CPMetadata.logits_output`).

The plan: the batch's new tokens are split over the CP ranks (`mem_cache.cp_page_map.split_request`),
this rank's tokens laid out in per-request lanes padded with dummy rows (every rank has the same
row count), and the KV movement planned -- stores to this rank's physical slots (direct when the
batch is page-aligned and every valid row's page is verified to be this rank's, else all-gathered
rows each rank filters), and the view of every earlier page of each request's context that the
backend gathers per layer.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from sglang.srt.distributed.parallel_state import GroupCoordinator
from sglang.srt.layers.attention.nsa.utils import local_layout
from sglang.srt.mem_cache.cp_page_map import page_owner, physical_page, physical_slots, split_request
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    CPBatchInfo,
    ForwardBatch,
    ForwardMode,
    SpecInput,
)

logger = logging.getLogger(__name__)
# SGLANG_CP_DRAFT_SHARED_KV_DEBUG=1: log (and keep, for tests) per rank which pool each draft
# forward writes, its local rows and physical pages, and whether its hidden input was already
# local -- evidence that the draft KV is sharded like the target's. Read once: no cost when off.
DRAFT_SHARED_KV_DEBUG = os.environ.get("SGLANG_CP_DRAFT_SHARED_KV_DEBUG", "0") == "1"
DRAFT_KV_DEBUG_RECORDS: list[dict] = []


class CPLayoutError(RuntimeError):
    """A CP re-layout broke its own invariant (a page-aligned token on a rank that does not own its
    page, a draft's local rows that are not the target's split): KV would go to the wrong rank."""


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

    def logits_output(self, processor, hidden: torch.Tensor, topk_indices: torch.Tensor | None, lm_head,
                      local_batch: ForwardBatch):
        """The logits of the scheduler's batch from this rank's rows: the narrow gather (each
        request's last row) unless something needs every position (`needs_full_gather`)."""
        mode = local_batch.capture_hidden_mode
        if not needs_full_gather(self.global_batch):
            out = processor.project(cp_collect_last_token_hidden(hidden, self), lm_head, self.global_batch,
                                    pruned=True)
            if mode == CaptureHiddenMode.FULL_LOCAL:
                out.hidden_states = hidden  # this rank's rows, in its CP layout
        else:
            out = processor.project(cp_all_gather_hidden(hidden, self), lm_head, self.global_batch)
            if mode == CaptureHiddenMode.FULL_LOCAL:  # gathered for input logprobs; the draft wants its rows
                out.hidden_states = hidden
            elif topk_indices is not None and mode == CaptureHiddenMode.FULL:
                topk_indices = cp_all_gather_hidden(topk_indices, self)  # in the order of the hidden states
        if mode in (CaptureHiddenMode.FULL, CaptureHiddenMode.FULL_LOCAL):
            out.topk_indices = topk_indices
        return out


def needs_full_gather(forward_batch: ForwardBatch) -> bool:
    """Under CP only each request's last-token hidden state is gathered, unless something needs
    every position: input logprobs, all logits, or full hidden-state capture (EAGLE draft extend)."""
    wants_input_logprobs = forward_batch.return_logprob and forward_batch.forward_mode.is_extend() and any(
        s >= 0 for s in forward_batch.logprob_start_lens_cpu)
    return (wants_input_logprobs or forward_batch.return_all_logits
            or forward_batch.capture_hidden_mode == CaptureHiddenMode.FULL)


def cp_collect_last_token_hidden(hidden: torch.Tensor, md: CPMetadata) -> torch.Tensor:
    """Narrow gather: each request's last-token hidden state from the rank that computed it.
    Moves cp x bs x hidden elements (not total_tokens x hidden)."""
    mine = hidden[md.last_local_row]  # [B, H]; rows of other ranks' requests are ignored below
    got = md.all_gather_rows(mine, "narrow_gather").view(md.cp_size, -1, hidden.shape[-1])
    return got[md.last_owner, torch.arange(got.shape[1], device=hidden.device)]


def cp_all_gather_hidden(hidden: torch.Tensor, md: CPMetadata) -> torch.Tensor:
    """Full gather: every token's hidden state in the scheduler's (global) order."""
    return md.all_gather_rows(hidden, "full_gather")[md.full_gather_idx]


class _ViewTable:
    def __init__(self, req_to_token: torch.Tensor) -> None:
        self.req_to_token = req_to_token


# -- the host plan ----------------------------------------------------------------------------------
@dataclass
class _Split:
    token_ranks: list[list[int]]  # per request, the rank computing each new token
    aligned: bool  # every request split on page boundaries
    starts: list[int]  # each request's first token in the flat batch


def _split_tokens(fb: ForwardBatch, cp: int, ps: int, mode: str) -> _Split:
    loc = fb.host_rows["out_cache_loc"].to(torch.int64)
    starts = [0]
    for e in fb.extend_seq_lens_cpu[:-1]:
        starts.append(starts[-1] + e)
    token_ranks, aligned = [], True
    for i in range(fb.batch_size):
        s, e, pl = starts[i], fb.extend_seq_lens_cpu[i], fb.extend_prefix_lens_cpu[i]
        if fb.cp.split_by_slot_owner:  # slots placed by another forward's split: follow its pages
            token_ranks.append(page_owner(loc[s : s + e] // ps, cp).tolist())
            continue
        prev = page_owner(int(loc[s]) // ps, cp) if e and pl % ps else None
        split = split_request(pl, e, ps, cp, mode, prev)
        token_ranks.append(split.token_ranks)
        aligned &= split.page_aligned
    return _Split(token_ranks, aligned, starts)


@dataclass
class _LocalRows:
    """This rank's rows (host tensors), and where every rank's rows go when gathered."""

    lanes: list[int]
    valid: list[int]
    is_valid: torch.Tensor  # [T_local] bool
    safe: torch.Tensor  # [T_local] the global token of each row (0 for dummies)
    ids: torch.Tensor
    pos: torch.Tensor
    tok_req: torch.Tensor
    lane_starts: torch.Tensor
    store_loc: torch.Tensor
    full_gather_idx: torch.Tensor
    gathered_store_loc: torch.Tensor | None
    last_local_row: torch.Tensor
    last_owner: torch.Tensor

    @property
    def num_local(self) -> int:
        return int(self.is_valid.numel())


def _local_rows(fb: ForwardBatch, split: _Split, rank: int, cp: int, ps: int) -> _LocalRows:
    h = fb.host_rows
    ids, pos, loc = h["input_ids"], h["positions"], h["out_cache_loc"].to(torch.int64)
    layouts = [local_layout(split.token_ranks, r, cp) for r in range(cp)]
    lanes, rows, valid = layouts[rank]
    rows_t = torch.tensor(rows, dtype=torch.int64)
    is_valid = rows_t >= 0
    safe = rows_t.clamp(min=0)
    local_loc = torch.where(is_valid, loc[safe], 0)
    if split.aligned and bool((page_owner(local_loc // ps, cp)[is_valid] != rank).any()):
        raise CPLayoutError("CP page ownership check failed: a page-aligned split put a token on a "
                            "rank that does not own its page")
    # all-gathered rows (rank-major): global token index of each, for the fallbacks
    g_rows = torch.tensor([g for _, rr, _ in layouts for g in rr], dtype=torch.int64)
    full_gather_idx = torch.empty(fb.num_tokens, dtype=torch.int64)
    ok = g_rows >= 0
    full_gather_idx[g_rows[ok]] = torch.nonzero(ok).flatten()
    gathered_store_loc = None
    if not split.aligned:
        g_loc = torch.where(ok, loc[g_rows.clamp(min=0)], 0)
        mine = ok & (page_owner(g_loc // ps, cp) == rank)
        gathered_store_loc = torch.where(mine, physical_slots(g_loc, ps, cp), 0)
    last_global = torch.tensor([split.starts[i] + fb.extend_seq_lens_cpu[i] - 1 for i in range(fb.batch_size)],
                               dtype=torch.int64)
    last_flat = full_gather_idx[last_global]
    last_owner = last_flat // len(rows)
    lanes_t = torch.tensor(lanes)
    return _LocalRows(
        lanes=lanes, valid=valid, is_valid=is_valid, safe=safe,
        ids=torch.where(is_valid, ids[safe], 0),
        pos=torch.where(is_valid, pos[safe], 0),  # a dummy row reads its request's key 0
        tok_req=torch.repeat_interleave(torch.arange(fb.batch_size), lanes_t),
        lane_starts=torch.cumsum(lanes_t, 0) - lanes_t,
        store_loc=torch.where(is_valid, physical_slots(local_loc, ps, cp), 0),
        full_gather_idx=full_gather_idx, gathered_store_loc=gathered_store_loc,
        last_local_row=torch.where(last_owner == rank, last_flat % len(rows), 0), last_owner=last_owner)


@dataclass
class _View:
    """Every page of each request's context, in request order: which pages this rank sends and
    where each gathered page lands, and the view req_to_token table over them."""

    send_pages: torch.Tensor  # [M]
    view_dst: torch.Tensor  # [cp, M]
    num_view_pages: int
    table: torch.Tensor  # [B, max seq len] int32


def _plan_view(fb: ForwardBatch, req_to_token_cpu: torch.Tensor, rank: int, cp: int, ps: int) -> _View:
    req_rows, seq_lens = fb.host_rows["req_pool_indices"], fb.seq_lens_cpu
    view_pages, base = [], []
    for i in range(fb.batch_size):
        n_pages = -(-seq_lens[i] // ps)
        base.append(len(view_pages))
        view_pages.extend((req_to_token_cpu[int(req_rows[i]), : n_pages * ps : ps].to(torch.int64) // ps).tolist())
    vp = torch.tensor(view_pages, dtype=torch.int64)
    v_owner = page_owner(vp, cp)
    per_rank = [torch.nonzero(v_owner == r).flatten() for r in range(cp)]
    m = max(1, max(len(x) for x in per_rank))
    view_dst = torch.full((cp, m), len(view_pages), dtype=torch.int64)
    for r, x in enumerate(per_rank):
        view_dst[r, : len(x)] = x
    send_pages = torch.zeros(m, dtype=torch.int64)
    send_pages[: len(per_rank[rank])] = physical_page(vp[per_rank[rank]], cp)
    width = max(seq_lens) if seq_lens else 1
    p_ar = torch.arange(width)
    table = torch.zeros(fb.batch_size, width, dtype=torch.int32)
    for i, n in enumerate(seq_lens):
        table[i, :n] = ((base[i] + p_ar[:n] // ps) * ps + p_ar[:n] % ps).int()
    return _View(send_pages, view_dst, len(view_pages), table)


def _upload(rows: _LocalRows, view: _View, b: int, dev: torch.device) -> dict[str, torch.Tensor]:
    """The plan's tensors on the device, in one pinned copy (the table in a second)."""
    gstore = rows.gathered_store_loc if rows.gathered_store_loc is not None else torch.empty(0, dtype=torch.int64)
    parts = {
        "ids": rows.ids, "pos": rows.pos, "tok_req": rows.tok_req, "store": rows.store_loc,
        "full": rows.full_gather_idx, "last_row": rows.last_local_row, "last_owner": rows.last_owner,
        "send": view.send_pages, "view_dst": view.view_dst.reshape(-1), "arange": torch.arange(b),
        "lanes": torch.tensor(rows.lanes, dtype=torch.int64), "lane_starts": rows.lane_starts,
        "valid": torch.tensor(rows.valid, dtype=torch.int64), "dummy": torch.nonzero(~rows.is_valid).flatten(),
        "gstore": gstore,
    }
    packed = torch.cat(list(parts.values()))
    if dev.type == "cuda":
        packed = packed.pin_memory()
    up = packed.to(dev, non_blocking=True)
    out = dict(zip(parts, up.split([t.numel() for t in parts.values()])))
    out["table"] = view.table.to(dev, non_blocking=True)
    return out


# -- the rank's batch -------------------------------------------------------------------------------
def build_cp_forward_batch(fb: ForwardBatch, req_to_token_cpu: torch.Tensor, group: GroupCoordinator,
                           mode: str, page_size: int, counter: CommCounter) -> ForwardBatch:
    """This rank's share of `fb` (host work only; one upload)."""
    cp, rank, b = group.world_size, group.rank, fb.batch_size
    split = _split_tokens(fb, cp, page_size, mode)
    rows = _local_rows(fb, split, rank, cp, page_size)
    view = _plan_view(fb, req_to_token_cpu, rank, cp, page_size)
    d = _upload(rows, view, b, fb.input_ids.device)
    lanes = rows.lanes
    mode_local = fb.forward_mode if fb.forward_mode != ForwardMode.DECODE or all(x == 1 for x in lanes) \
        else ForwardMode.EXTEND
    common = dict(forward_mode=mode_local, batch_size=b, input_ids=d["ids"], positions=d["pos"], seq_lens=fb.seq_lens,
                  extend_prefix_lens=fb.extend_prefix_lens, extend_seq_lens=d["lanes"],
                  extend_start_loc=d["lane_starts"], token_to_req=d["tok_req"], seq_lens_cpu=list(fb.seq_lens_cpu),
                  extend_seq_lens_cpu=list(lanes), extend_prefix_lens_cpu=list(fb.extend_prefix_lens_cpu),
                  positions_cpu=rows.pos.tolist(), return_logprob=fb.return_logprob, sampling_info=fb.sampling_info,
                  capture_hidden_mode=fb.capture_hidden_mode)
    view_fb = ForwardBatch(req_pool_indices=d["arange"], out_cache_loc=d["store"],
                           req_to_token_pool=_ViewTable(d["table"]), **common)
    md = CPMetadata(
        cp_rank=rank, cp_size=cp, group=group, global_batch=fb, num_local=rows.num_local, valid_idx=d["valid"],
        dummy_idx=d["dummy"], page_aligned=split.aligned, store_loc=d["store"],
        gathered_store_loc=d["gstore"] if rows.gathered_store_loc is not None else None, full_gather_idx=d["full"],
        last_local_row=d["last_row"], last_owner=d["last_owner"], send_pages=d["send"], view_dst=d["view_dst"],
        num_view_pages=view.num_view_pages, view_fb=view_fb, counter=counter)
    local = ForwardBatch(req_pool_indices=fb.req_pool_indices, out_cache_loc=d["store"], cp=CPBatchInfo(metadata=md),
                         req_to_token_pool=fb.req_to_token_pool, token_to_kv_pool=fb.token_to_kv_pool,
                         attn_backend=fb.attn_backend, **common)
    if fb.spec is not None:
        local.spec = _local_spec_inputs(fb.spec, rows.safe, rows.num_local)
        if DRAFT_SHARED_KV_DEBUG:
            _record_draft_kv(fb, local, rows, split.aligned, rank)
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


def _record_draft_kv(fb: ForwardBatch, local: ForwardBatch, rows: _LocalRows, aligned: bool, rank: int) -> None:
    """SGLANG_CP_DRAFT_SHARED_KV_DEBUG: which pool and physical pages a draft forward writes."""
    pool = fb.token_to_kv_pool
    pages = torch.unique(rows.store_loc[rows.is_valid] // pool.page_size).tolist()
    rec = dict(rank=rank, pool=f"{type(pool).__name__}@{id(pool):x}", pool_layers=pool.layer_num,
               pool_slots=pool.size, local_rows=rows.num_local, valid_rows=int(rows.is_valid.sum()),
               hidden_rows=int(local.spec.hidden_states.shape[0]), hidden_local_input=bool(fb.spec.rows_local),
               direct_local_writes=aligned, physical_pages=pages)
    DRAFT_KV_DEBUG_RECORDS.append(rec)
    logger.info("CP draft shared KV: %s", rec)
