"""Process groups (TP / CP / EP) over torch.distributed: gloo on CPU, NCCL on GPU.

Groups are passed explicitly to the layers that need them (no global context to reset in tests);
a single-rank group is a no-op so the same model code runs without torch.distributed.

Each group has a device group (`group`: NCCL on GPU, for tensors) and, over the same ranks, a gloo
`cpu_group` for host objects -- the scheduler's per-iteration control messages, grammar readiness --
as upstream keeps one: pickled objects through NCCL cost a device round trip every iteration. When
the device group already is gloo (CPU runs) the two are the same group.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GroupCoordinator:
    rank: int = 0
    world_size: int = 1
    group: object | None = None  # torch.distributed.ProcessGroup (device collectives)
    cpu_group: object | None = None  # gloo ProcessGroup over the same ranks (host objects)

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_single:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.is_single:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def all_reduce_host(self, x: torch.Tensor, op: str = "min") -> torch.Tensor:
        """A host tensor reduced over the gloo cpu_group (scheduler decisions every rank must share)."""
        if self.is_single:
            return x
        if self.cpu_group is None:
            raise RuntimeError("all_reduce_host needs the group's gloo cpu_group (init_distributed makes it)")
        dist.all_reduce(x, op={"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}[op],
                        group=self.cpu_group)
        return x

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """A host object from rank `src` to every rank, over the gloo cpu_group (never the device)."""
        if self.is_single:
            return obj
        if self.cpu_group is None:
            raise RuntimeError("broadcast_object needs the group's gloo cpu_group (init_distributed makes it)")
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.cpu_group)
        return box[0]


SINGLE_GROUP = GroupCoordinator()


def init_distributed(
    world_size: int, rank: int, init_method: str, backend: str | None = None, timeout_s: float = 300
) -> GroupCoordinator:
    """Start torch.distributed for one group spanning all ranks of this server (TP, or CP for
    attention with EP for the experts: the same ranks). A collective that waits longer than
    `timeout_s` for a rank fails, so a dead rank stops the others instead of hanging them."""
    if world_size == 1:
        return SINGLE_GROUP
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=init_method, world_size=world_size, rank=rank,
                                timeout=timedelta(seconds=timeout_s))
    world = dist.group.WORLD
    # Every rank runs this, so new_group (a collective over all ranks) is called by all in order.
    cpu_group = world if dist.get_backend(world) == "gloo" else dist.new_group(
        backend="gloo", timeout=timedelta(seconds=timeout_s))
    return GroupCoordinator(rank=rank, world_size=world_size, group=world, cpu_group=cpu_group)


def node_ranks(world_size: int, nnodes: int, node_rank: int) -> range:
    """The global ranks a node runs (upstream's layout: node k runs a contiguous block)."""
    per = world_size // nnodes
    return range(node_rank * per, (node_rank + 1) * per)


def gpu_for_rank(rank: int, world_size: int, nnodes: int = 1) -> int:
    """The local GPU of global `rank` (ranks fill a node's GPUs in order, as node_ranks lays them out)."""
    return rank % (world_size // nnodes)


def bind_rank_gpu(rank: int, world_size: int, nnodes: int = 1) -> None:
    """Put this rank's CUDA work on its own GPU (NCCL refuses two ranks on one device)."""
    per_node = world_size // nnodes
    have = torch.cuda.device_count()
    if have < per_node:
        raise RuntimeError(f"{per_node} ranks per node need {per_node} GPUs, but this node has {have} "
                           "(lower --tp-size or raise --nnodes)")
    torch.cuda.set_device(gpu_for_rank(rank, world_size, nnodes))
