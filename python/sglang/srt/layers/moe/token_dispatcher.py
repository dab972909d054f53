"""Token dispatchers: the seam between routing and expert computation.

A dispatcher moves (hidden, topk) to where the experts live and brings results back. The
standard dispatcher keeps everything local (TP experts or a single rank); expert-parallel
dispatchers (all-to-all over torch.distributed, DeepEP where installed) implement the same
two calls. Rule: `combine(dispatch(x))` returns rows in the order and count of `x`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from sglang.srt.layers.moe.topk import TopKOutput


@dataclass
class DispatchOutput:
    hidden_states: torch.Tensor
    topk: TopKOutput
    handle: object = None  # dispatcher-private state needed by combine


class BaseDispatcher(ABC):
    @abstractmethod
    def dispatch(self, hidden_states: torch.Tensor, topk: TopKOutput) -> DispatchOutput: ...

    @abstractmethod
    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor: ...


class StandardDispatcher(BaseDispatcher):
    def dispatch(self, hidden_states: torch.Tensor, topk: TopKOutput) -> DispatchOutput:
        return DispatchOutput(hidden_states, topk)

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor:
        return expert_output
