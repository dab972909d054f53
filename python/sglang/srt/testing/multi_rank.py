"""Run the scheduler on N real processes (gloo on CPU, NCCL on GPU) and collect what rank 0 saw.

Every rank builds a Scheduler for each case, receives the same requests (as the scheduler
process's broadcast would give them) and steps in lockstep; rank 0 returns the generated ids,
logprobs and KV statistics. Used by the CP / EP equivalence tests and benchmark/cp.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from dataclasses import dataclass, field

import torch.multiprocessing as mp


@dataclass
class Case:
    name: str
    server_args: dict  # ServerArgs kwargs (tp_size is set to the world size)
    prompts: list[list[int]]  # run together (one batch)
    max_new_tokens: int = 8
    followups: list[list[int]] = field(default_factory=list)  # run after the prompts (cache hits)
    return_logprob: bool = False
    logprob_start_len: int = -1
    env: dict = field(default_factory=dict)
    warmup: bool = False  # run a short request first, untimed (benchmarks)
    rounds: list[list[list[int]]] = field(default_factory=list)  # batches run one after another, after followups
    return_hidden_states: bool = False  # every request (the server needs --enable-return-hidden-states)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(case: Case, world_size: int, rank: int = 0, group=None) -> dict:
    """One case on this rank; returns {rid: {"ids", "logprobs", "input_logprobs"}, "_stats": ...}."""
    os.environ.update(case.env)  # before the model modules read it
    import torch

    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    sched = _scheduler(case, world_size, group)
    sa = sched.server_args
    from sglang.srt.layers.attention.nsa.cp_batch import DRAFT_KV_DEBUG_RECORDS as debug_records

    n_debug_before = len(debug_records)  # SGLANG_CP_DRAFT_SHARED_KV_DEBUG records of this case only
    out: dict = {}
    layer_ends: list[int] = []  # KVCache.on_layer_end on this rank's own pool
    sched.tp_worker.model_runner.token_to_kv_pool.register_layer_end_callback(layer_ends.append)

    def submit(batch: list[list[int]], tag: str) -> None:
        for i, ids in enumerate(batch):
            sp = SamplingParams(max_new_tokens=case.max_new_tokens, temperature=0.0, ignore_eos=True)
            sched.add_request(TokenizedGenerateReqInput(f"{tag}{i}", list(ids), sp, case.return_logprob,
                                                        case.logprob_start_len,
                                                        return_hidden_states=case.return_hidden_states))

    step_s: list[float] = []

    def drain() -> None:
        while sched.has_work():
            t0 = time.perf_counter()
            outs = sched.step()
            if sa.device == "cuda":
                torch.cuda.synchronize()
            step_s.append(time.perf_counter() - t0)
            for o in outs:
                r = out.setdefault(o.rid, {"ids": [], "logprobs": [], "input_logprobs": None, "hidden": []})
                r["ids"] += o.new_token_ids
                r["hidden"] += o.hidden_states or []
                r["logprobs"] += o.output_token_logprobs or []
                if o.input_token_logprobs is not None:
                    r["input_logprobs"] = o.input_token_logprobs

    if case.warmup:
        submit([case.prompts[0][:16]], "w")
        drain()
        out.clear()
        step_s.clear()
        layer_ends.clear()
        if sched.tp_worker.model_runner.attn_backend.comm_counter is not None:
            sched.tp_worker.model_runner.attn_backend.comm_counter.elements.clear()
    submit(case.prompts, "p")
    drain()
    if case.followups:
        submit(case.followups, "f")
        drain()
    for k, batch in enumerate(case.rounds):
        submit(batch, f"r{k}_")
        drain()
    draft = sched.tp_worker.kv_pools().get("draft")
    if draft is not None:
        out["_draft"] = {"pool_slots": draft.size, "debug": debug_records[n_debug_before:],
                         "accept_length": sched.tp_worker.avg_accept_length,
                         "state_equal_across_ranks": _draft_state_equal(sched.tp_worker, group)}
    out["_stats"] = _stats(sched, step_s, layer_ends)
    return out


def _draft_state_equal(worker, group) -> bool:
    """Every rank keeps the same next draft and draft hidden state per request slot (their
    schedulers accept the same drafts, else the ranks' batches and collectives part)."""
    if group is None or group.is_single:
        return True
    state = (worker.next_draft.float(), worker.draft_hidden.float().flatten())
    return all(bool((group.all_gather(x[None], dim=0) == x[None]).all()) for x in state)


def _scheduler(case: Case, world_size: int, group):
    """The case's Scheduler on this rank: its flags over the CPU defaults, TP (and CP) = the world."""
    import torch

    from sglang.srt.distributed.parallel_state import SINGLE_GROUP
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.server_args import ServerArgs

    kwargs = dict(device="cpu", random_seed=0, max_total_tokens=8192)
    kwargs.update(case.server_args)
    kwargs["tp_size"] = world_size
    if kwargs.get("enable_nsa_prefill_context_parallel"):
        kwargs["attn_cp_size"] = world_size
    sa = ServerArgs(**kwargs).resolve()
    torch.manual_seed(0)
    return Scheduler(sa, tp_group=group or SINGLE_GROUP)


def _stats(sched, step_s: list[float], layer_ends: list[int]) -> dict:
    """What the equivalence tests compare besides tokens: leaks, cache hits, CP traffic, pages."""
    mr = sched.tp_worker.model_runner
    counter = mr.attn_backend.comm_counter  # CP: the collectives' element counts
    return {"kv_leak": sched.kv_leak_report(), "step_s": step_s,
            "cached_tokens": sched.prefill_manager.num_cached_tokens,
            "cache_stats": dict(getattr(sched.tree_cache, "stats", {})), "layer_ends": layer_ends,
            "comm": dict(counter.elements) if counter is not None else {},
            "pool_slots": mr.token_to_kv_pool.size, "capacity": sched.max_total_num_tokens,
            # pages each rank stores now (the prefix cache keeps the finished requests' KV)
            "owned_pages": getattr(mr.token_to_kv_pool_allocator, "owned_pages", lambda: None)(),
            "dispatched": sum(getattr(m.experts.dispatcher, "elements_moved", 0)
                              for m in mr.model.modules() if hasattr(m, "experts"))}


def _worker(rank: int, world_size: int, port: int, cases: list[Case], queue) -> None:
    from sglang.srt.distributed.parallel_state import init_distributed

    try:
        import torch

        cuda = any(c.server_args.get("device") == "cuda" for c in cases)
        backend = "gloo"
        if cuda:
            # One GPU per rank over NCCL where there are enough; fewer GPUs than ranks (a 1-GPU
            # machine) share them over gloo, which moves CUDA tensors too (slowly): the CUDA code
            # path is tested, only NCCL itself is not.
            n_gpu = torch.cuda.device_count()
            torch.cuda.set_device(rank % n_gpu)
            backend = "nccl" if n_gpu >= world_size else "gloo"
        else:
            torch.set_num_threads(1)
        group = init_distributed(world_size, rank, f"tcp://127.0.0.1:{port}", backend, timeout_s=300)
        results = [run_case(c, world_size, rank, group) for c in cases]
        queue.put((rank, results, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


def run_multi_rank(cases: list[Case], world_size: int, timeout_s: float = 900) -> list[dict]:
    """Run `cases` on `world_size` processes; returns rank 0's result per case (raises with the
    failing rank's traceback)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, cases, queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(world_size):
            rank, results, err = queue.get(timeout=timeout_s)
            if err:
                raise RuntimeError(f"rank {rank} failed:\n{err}")
            got[rank] = results
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return got[0]
