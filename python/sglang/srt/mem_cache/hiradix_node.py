"""HiRadixCache's tree node (KV on the device, the host, or both) and the pins that keep nodes out
of eviction while a transfer or an admission reads them."""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.hicache_transfer import TransferOp
from sglang.srt.mem_cache.radix_cache import TreeNode

# Host hits shorter than this are recomputed rather than loaded (upstream's load-back threshold).
LOAD_BACK_THRESHOLD = 10


class HiTreeNode(TreeNode):
    __slots__ = ("host_value", "hit_count", "pending")

    def __init__(self, key=None, value=None, parent=None) -> None:
        super().__init__(key, value, parent)
        if value is None:
            self.value = None  # host-only (the root's value is never read)
        self.host_value: torch.Tensor | None = None
        self.hit_count = 0
        self.pending: list[TransferOp] = []  # transfers in flight that read or write this node

    @property
    def on_device(self) -> bool:
        return self.value is not None

    @property
    def host_ready(self) -> bool:
        """Backed up and acknowledged (a pending backup is not a host copy yet)."""
        return self.host_value is not None and not any(op.kind == "backup" for op in self.pending)


class Pin:
    """Keeps nodes out of both evictions for a moment (a pending entry that is no transfer)."""

    kind = "pin"

    def __init__(self, nodes: list[HiTreeNode]) -> None:
        self.nodes = list(nodes)
        for x in self.nodes:
            x.pending.append(self)

    def release(self) -> None:
        for x in self.nodes:  # includes halves split off meanwhile (_split extends self.nodes)
            x.pending.remove(self)


def device_busy(x: HiTreeNode) -> bool:
    """A transfer reads or writes the node's device slots (an L3 write reads only its host pages)."""
    return any(op.kind != "store" for op in x.pending)
