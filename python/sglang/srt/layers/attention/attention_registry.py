"""Attention backends by name (the --nsa-prefill-backend / --nsa-decode-backend choices), and the
other NSA option names ServerArgs offers (defined here once; the modules using them import them).
Storage choices live with storage: --nsa-index-k-dtype in mem_cache.index_k_format,
--nsa-prefill-cp-mode in mem_cache.cp_page_map.

Classes are imported on use, so ServerArgs can list the names without importing kernels.
"auto" picks Triton on CUDA and the torch reference on CPU; a backend the device cannot run is a
start-up error naming the flag (ServerArgs validates with `check_backend_runnable`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "sglang.srt.layers.attention.nsa.nsa_backend:NativeSparseAttnBackend",
    "triton": "sglang.srt.layers.attention.nsa.triton_backend:TritonNSABackend",
}
NSA_BACKEND_CHOICES = ["auto", *ATTENTION_BACKENDS]
MLA_PATHS = ["auto", "plain", "absorbed"]  # the torch backend's formulation (--mla-attn-path)
CP_MODE_ALIASES = {"zigzag": "in-seq-split", "interleave": "round-robin-split"}  # upstream's --cp-strategy
# Backends made of Triton kernels: they need a CUDA device, or TRITON_INTERPRET=1 on CPU.
TRITON_BACKENDS = {"triton"}  # also the MoE runner of that name


def resolve_backend_name(name: str, device: str) -> str:
    if name == "auto":
        return "triton" if device == "cuda" else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {NSA_BACKEND_CHOICES}")
    return name


def backend_unrunnable_reason(name: str, device: str) -> str | None:
    """Why backend `name` (resolved) cannot run on `device`, or None."""
    if name in TRITON_BACKENDS:
        from sgl_kernel.utils import triton_available

        if not triton_available(device):
            return (f"{name} needs a CUDA device or TRITON_INTERPRET=1 (Triton's interpreter) on {device}; "
                    "use torch on CPU")
    return None


def create_attn_backend(name: str, model_runner) -> "AttentionBackend":
    module, cls = ATTENTION_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(model_runner)


def create_hybrid_backend(prefill: str, decode: str, model_runner) -> "AttentionBackend":
    from sglang.srt.layers.attention.base_attn_backend import HybridAttnBackend

    p = create_attn_backend(prefill, model_runner)
    return p if prefill == decode else HybridAttnBackend(p, create_attn_backend(decode, model_runner))


def create_runner_backend(model_runner) -> "AttentionBackend":
    """A model runner's backend: the --nsa-prefill-backend / --nsa-decode-backend pair, wrapped by
    the context-parallel backend when the runner's ranks run attention CP (`cp_group`), which then
    re-lays each batch out through `prepare_batch`."""
    sa = model_runner.server_args
    backend = create_hybrid_backend(sa.nsa_prefill_backend, sa.nsa_decode_backend, model_runner)
    if model_runner.cp_group is None:
        return backend
    from sglang.srt.layers.attention.nsa.cp_backend import NSAContextParallelBackend

    return NSAContextParallelBackend.for_runner(backend, model_runner)
