"""MoE expert runners and token dispatchers by name, and the factories that build them.

Import-light: implementations are named as "module:attr" and imported on use, so ServerArgs can list
the --moe-runner-backend choices without importing kernels, and no base module imports its
subclasses. Each runner and dispatcher says whether it can be captured in a CUDA graph
(`supports_cuda_graph`); the model runner ANDs that with the attention backend's
(cuda_graph_runner.cuda_graph_decision).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from sglang.srt.layers.moe.token_dispatcher import BaseDispatcher


def _load(target: str):
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


# -- expert runners (--moe-runner-backend) --------------------------------------------------------
@dataclass(frozen=True)
class MoeRunner:
    """An expert runner: `load()` gives fn(hidden, w13, w2, topk_weights, topk_ids, expert_offset)
    -> [T, H] (fused_moe_native.fused_experts_native is the contract and the reference)."""

    name: str
    target: str  # "module:function"
    supports_cuda_graph: bool
    graph_blocker: str = ""  # why it cannot be captured, for the start-up message

    def load(self) -> Callable:
        return _load(self.target)


MOE_RUNNERS: dict[str, MoeRunner] = {}


def register_moe_runner(runner: MoeRunner) -> None:
    MOE_RUNNERS[runner.name] = runner


register_moe_runner(MoeRunner(
    "torch", "sglang.srt.layers.moe.fused_moe_native:fused_experts_native", supports_cuda_graph=False,
    graph_blocker="host sync: it reads the routed expert ids back (unique().tolist()) to loop over them"))
register_moe_runner(MoeRunner("triton", "sgl_kernel.moe:fused_experts", supports_cuda_graph=True))

MOE_RUNNER_BACKENDS = ["auto", *MOE_RUNNERS]


def resolve_moe_runner_backend(name: str, device: str) -> str:
    """auto: the Triton fused MoE on CUDA, the torch reference loop on CPU."""
    if name == "auto":
        return "triton" if device == "cuda" else "torch"
    return name


def get_moe_runner(name: str) -> MoeRunner:
    if name not in MOE_RUNNERS:
        raise ValueError(f"unknown MoE runner {name!r}; choose from {MOE_RUNNER_BACKENDS}")
    return MOE_RUNNERS[name]


# -- token dispatchers --------------------------------------------------------------------------
# "local": no EP, or EP under TP where every rank holds every token; "all_to_all": torch.distributed
# (the portable path); "deepep": DeepEP normal mode (start-up validation proved deep_ep importable).
TOKEN_DISPATCHERS: dict[str, str] = {
    "local": "sglang.srt.layers.moe.token_dispatcher:StandardDispatcher",
    "all_to_all": "sglang.srt.layers.moe.token_dispatcher:AllToAllDispatcher",
    "deepep": "sglang.srt.layers.moe.deepep_dispatcher:DeepEPDispatcher",
}


def get_dispatcher_class(kind: str) -> type["BaseDispatcher"]:
    if kind not in TOKEN_DISPATCHERS:
        raise ValueError(f"unknown MoE dispatcher {kind!r}; choose from {list(TOKEN_DISPATCHERS)}")
    return _load(TOKEN_DISPATCHERS[kind])


def create_dispatcher(kind: str, ep_group, num_experts: int) -> "BaseDispatcher":
    """A single-rank expert group needs no dispatch, whatever `kind` says."""
    if kind == "local" or ep_group.world_size == 1:
        return get_dispatcher_class("local")()
    return get_dispatcher_class(kind)(ep_group, num_experts)
