"""NSA context parallel with shared KV: the attention backend that gives each rank's queries the
full causal context, and the seam through which the model runner runs CP without a mode of its
own (`NSAContextParallelBackend.for_runner`).

Per forward: `prepare_batch` re-lays the batch out into this rank's share (host work, once:
cp_batch.build_cp_forward_batch). Then per layer:
- stores: each rank writes the MLA KV and index K of its tokens into its own pool (physical
  slots of the pages it owns): direct when the batch is page-aligned, else the new rows are
  all-gathered and each rank keeps those on its pages;
- views: attention and the indexer need every earlier token of the request, which lives on all
  ranks. Each rank sends the pages it owns of the batch's contexts (all-gather) and the pages are
  placed into a transient view pool in request order; the wrapped backend (torch or Triton) runs
  unchanged on that view with a view req_to_token table, freed after the layer.
The rank's rows carry dummy (compute-padding) rows between valid ones: the MoE blocks see only
the valid rows (`install_moe_compaction`), and the logits processor gathers the rows it needs back
into the scheduler's order (`CPMetadata.logits_output`).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.nsa.cp_batch import CommCounter, CPMetadata, build_cp_forward_batch
from sglang.srt.layers.moe.fused_moe import FusedMoE
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)


def _compact_valid_rows(module: nn.Module, args: tuple, kwargs: dict):
    fb = args[1] if len(args) > 1 else kwargs.get("forward_batch")
    cp = fb.cp.metadata if fb is not None else None
    if cp is None:
        return None
    return (args[0].index_select(0, cp.valid_idx), *args[1:]), kwargs


def _restore_padded_rows(module: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor):
    fb = args[1] if len(args) > 1 else kwargs.get("forward_batch")
    cp = fb.cp.metadata if fb is not None else None
    if cp is None:
        return None
    return out.new_zeros((cp.num_local, *out.shape[1:])).index_copy_(0, cp.valid_idx, out)


def install_moe_compaction(model: nn.Module) -> int:
    """CP compute padding: valid rows are interleaved with dummy lane rows. Each MoE block (a module
    whose `experts` is a FusedMoE, called as `block(hidden_states, forward_batch)`) gets only the
    valid rows -- gate, top-k, dispatch and shared experts never see a dummy row -- and its output
    is put back into the padded layout (zeros in the dummy rows). A wrapper by forward hooks: the
    module tree (and so the checkpoint names) stays as it is. Returns the blocks wrapped."""
    blocks = [m for m in model.modules() if isinstance(getattr(m, "experts", None), FusedMoE)]
    for m in blocks:
        m.register_forward_pre_hook(_compact_valid_rows, with_kwargs=True)
        m.register_forward_hook(_restore_padded_rows, with_kwargs=True)
    return len(blocks)


class NSAContextParallelBackend(AttentionBackend):
    """Wraps a torch or Triton NSA backend: stores go to this rank's pages, attention and the
    indexer run on a per-layer view of the full contexts."""

    supports_cuda_graph = False  # collectives + host-planned views per step

    def __init__(self, inner: AttentionBackend, pool, req_to_token_pool, group, mode: str, page_size: int) -> None:
        self.inner, self.pool, self.req_to_token_pool = inner, pool, req_to_token_pool
        self.group, self.mode, self.page_size = group, mode, page_size
        self.comm_counter = CommCounter()

    @classmethod
    def for_runner(cls, inner: AttentionBackend, runner) -> "NSAContextParallelBackend":
        """The backend of a model runner whose ranks run attention CP (`runner.cp_group`): it pads
        each rank's rows, so it also puts the MoE compaction on the runner's model."""
        sa = runner.server_args
        install_moe_compaction(runner.model)
        logger.info("context parallel over %d ranks (%s, page size %d)", runner.cp_group.world_size,
                    sa.nsa_prefill_cp_mode, runner.page_size)
        return cls(inner, runner.token_to_kv_pool, runner.req_to_token_pool, runner.cp_group,
                   sa.nsa_prefill_cp_mode, runner.page_size)

    def prepare_batch(self, forward_batch: ForwardBatch) -> ForwardBatch:
        """This rank's share of the batch (cp_batch.build_cp_forward_batch: host work, one upload)."""
        return build_cp_forward_batch(forward_batch, self.req_to_token_pool.req_to_token_cpu, self.group,
                                      self.mode, self.page_size, self.comm_counter)

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
