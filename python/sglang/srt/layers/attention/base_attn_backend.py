"""The attention backend seam.

Rules every backend follows:
- `prepare_batch(forward_batch)` runs first, on the host: the batch the forward runs on. A plain
  backend returns it as it is; a wrapping backend may re-lay it out (context parallel: this rank's
  share of the tokens, nsa/cp_backend.py), so the model runner needs no mode of its own.
- `init_forward_metadata(forward_batch)` runs once per forward, before the model, after the
  scheduler's req_to_token writes reached the device. It builds everything the layers need
  (attention *and* the DSA indexer) from the batch's tensors and host lists; it never reads a
  device value back. A backend that can be captured in a CUDA graph (`supports_cuda_graph`) keeps
  that metadata in buffers preallocated by `init_cuda_graph_state` for the largest batch, sets it
  up once per captured batch size in `init_forward_metadata_capture_cuda_graph` and refreshes
  whatever is not a ForwardBatch buffer in `init_forward_metadata_replay_cuda_graph`.
- `forward_mla(...)` first stores the new tokens' latent KV at `forward_batch.out_cache_loc`
  (when `save_kv_cache`), then attends over the request's KV read back from the pool, so a cached
  prefix and a freshly computed one are read through the same (possibly lossy) storage. The layer
  hands over what the backend needs (`RadixAttention`: geometry and absorbed weights).
- DSA: `store_index_k` writes the indexer's K; `index_topk` returns request-local positions
  [T, index_topk] int32, ascending, -1 padded, always a tensor: a row no longer than index_topk
  selects all its causal positions; ties in the index score keep the lower position.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang.srt.layers.attention.nsa.nsa_indexer import Indexer
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class AttentionBackend(ABC):
    supports_cuda_graph: bool = False
    comm_counter = None  # context parallel: the elements its collectives moved (tests, stats)

    def prepare_batch(self, forward_batch: "ForwardBatch") -> "ForwardBatch":
        return forward_batch

    @abstractmethod
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None: ...

    def init_cuda_graph_state(self, max_bs: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in a CUDA graph")

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: "ForwardBatch") -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in a CUDA graph")

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: "ForwardBatch") -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in a CUDA graph")

    @abstractmethod
    def forward_mla(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        layer: "RadixAttention",
        forward_batch: "ForwardBatch",
        topk_indices: torch.Tensor | None = None,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Returns the attention output [T, H, v_head_dim]."""

    def store_index_k(self, layer_id: int, k: torch.Tensor, forward_batch: "ForwardBatch") -> None:
        raise NotImplementedError(f"{type(self).__name__} has no DSA indexer support")

    def index_topk(self, indexer: "Indexer", q: torch.Tensor, weights: torch.Tensor,
                   forward_batch: "ForwardBatch") -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no DSA indexer support")


class HybridAttnBackend(AttentionBackend):
    """One backend for prefill (extend / mixed), another for decode (as mini-sglang pairs them).
    CUDA graphs capture decode only, so the decode backend decides whether graphs are possible."""

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        self.prefill, self.decode = prefill, decode
        self.supports_cuda_graph = decode.supports_cuda_graph

    def _pick(self, forward_batch: "ForwardBatch") -> AttentionBackend:
        return self.decode if forward_batch.forward_mode.is_decode() else self.prefill

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        self._pick(forward_batch).init_forward_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs: int) -> None:
        self.decode.init_cuda_graph_state(max_bs)

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: "ForwardBatch") -> None:
        self.decode.init_forward_metadata_capture_cuda_graph(forward_batch)

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: "ForwardBatch") -> None:
        self.decode.init_forward_metadata_replay_cuda_graph(forward_batch)

    def forward_mla(self, q_nope, q_rope, latent, k_rope, layer, forward_batch, topk_indices=None,
                    save_kv_cache=True) -> torch.Tensor:
        return self._pick(forward_batch).forward_mla(q_nope, q_rope, latent, k_rope, layer, forward_batch,
                                                     topk_indices, save_kv_cache)

    def store_index_k(self, layer_id, k, forward_batch) -> None:
        self._pick(forward_batch).store_index_k(layer_id, k, forward_batch)

    def index_topk(self, indexer, q, weights, forward_batch) -> torch.Tensor:
        return self._pick(forward_batch).index_topk(indexer, q, weights, forward_batch)
