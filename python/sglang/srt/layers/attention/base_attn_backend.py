"""The attention backend seam.

Rules every backend follows:
- `init_forward_metadata(forward_batch)` runs once per forward, before the model, after the
  scheduler has written the new tokens' slots into `req_to_token`.
- `forward_mla(...)` first stores the new tokens' latent KV at `forward_batch.out_cache_loc`
  (when `save_kv_cache`), then attends over the request's whole KV read back from the pool, so a
  cached prefix and a freshly computed one are read through the same (possibly lossy) storage.
- `topk_indices` (DSA) are request-local token positions, -1 padded; None means dense causal.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class AttentionBackend(ABC):
    @abstractmethod
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None: ...

    @abstractmethod
    def forward_mla(
        self,
        layer: torch.nn.Module,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        forward_batch: "ForwardBatch",
        topk_indices: torch.Tensor | None = None,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Returns the attention output [T, H, v_head_dim]."""
