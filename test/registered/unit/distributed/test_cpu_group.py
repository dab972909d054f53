"""Control messages go over the gloo cpu_group, never the device group: the scheduler process's
per-iteration broadcast of received messages and the grammar queue's ready list. Two real gloo
processes check that init_distributed gives every group a gloo cpu_group (the device group itself
when that is gloo already) that broadcasts objects. CPU, fast."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang.srt.distributed.parallel_state import GroupCoordinator
from sglang.srt.testing.multi_rank import free_port

DEVICE_GROUP, CPU_GROUP = object(), object()


@pytest.fixture
def broadcasts(monkeypatch):
    """Records the group of every object broadcast; this is rank 1, so it receives `reply`."""
    rec = SimpleNamespace(groups=[], reply=["from rank 0"])

    def fake(box, src=0, group=None):
        rec.groups.append(group)
        box[0] = rec.reply

    monkeypatch.setattr(dist, "broadcast_object_list", fake)
    return rec


def _group() -> GroupCoordinator:
    return GroupCoordinator(rank=1, world_size=2, group=DEVICE_GROUP, cpu_group=CPU_GROUP)


def test_scheduler_control_broadcast_uses_the_cpu_group(broadcasts):
    from sglang.srt.managers.scheduler_process import SchedulerProcess

    scheduler = SimpleNamespace(tp_worker=SimpleNamespace(world_group=_group()))
    proc = SchedulerProcess(scheduler, port_args=None, tp_rank=1)  # rank 1 opens no sockets
    assert proc.recv_requests(block=False) == ["from rank 0"]
    assert broadcasts.groups == [CPU_GROUP]


def test_grammar_ready_list_uses_the_cpu_group(broadcasts):
    from sglang.srt.constrained.grammar_manager import GrammarManager

    gm = GrammarManager(backend=None, world_group=_group())
    fut = Future()
    fut.set_result("compiled")
    req = SimpleNamespace(grammar=fut, grammar_wait_start=0.0, sampling_params=SimpleNamespace(think_end_ids=None))
    gm.grammar_queue.append(req)
    broadcasts.reply = [0]  # rank 0's ready list
    assert gm.get_ready_grammar_requests() == [req] and req.grammar == "compiled"
    assert broadcasts.groups == [CPU_GROUP]


def test_a_group_without_a_cpu_group_refuses_object_broadcasts():
    with pytest.raises(RuntimeError, match="cpu_group"):
        GroupCoordinator(rank=0, world_size=2, group=DEVICE_GROUP).broadcast_object([1])


def _rank(rank: int, port: int, queue) -> None:
    from sglang.srt.distributed.parallel_state import init_distributed

    try:
        g = init_distributed(2, rank, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=60)
        got = g.broadcast_object({"msgs": [rank]} if rank == 0 else None)
        queue.put((rank, got, dist.get_backend(g.cpu_group), g.cpu_group is g.group, None))
        dist.destroy_process_group()
    except BaseException as e:  # report, never hang the test
        queue.put((rank, None, None, None, repr(e)))


def test_init_distributed_gives_a_gloo_cpu_group():
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, queue), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    for rank, got, backend, same, err in results:
        assert err is None, err
        assert got == {"msgs": [0]} and backend == "gloo" and same  # gloo device group: reused
