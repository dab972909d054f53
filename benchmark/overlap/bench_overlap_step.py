"""How much of a decode step the overlap scheduler hides: per batch size, the median wall time of one
scheduler iteration (`Scheduler.step()`, no device sync between iterations) beside the GPU busy time
of an iteration (torch.profiler's device intervals, merged, over the same kind of steps), with the
overlap scheduler (default) and --disable-overlap-schedule, in one run. Also per step: kernel
launches, host<->device copies and host syncs, and where in our code the copies and syncs come from
(the profiler's Python stacks), so what keeps the GPU waiting has a name.

Real DeepSeek-V3.2 layer shapes (transformers' config), random weights, `--layers` layers with
`--experts` routed experts (a decode step at batch 1 reads 8 experts whatever their count):

    python benchmark/overlap/bench_overlap_step.py --layers 2 --experts 16 --out-dir /tmp/out
    python benchmark/overlap/bench_overlap_step.py --smoke       # tiny shapes on CPU: exercises the script

Goal (issue 29): overlap step <= 1.1x the GPU busy time at batch 1 and 64. `--modes eagle` times a
speculative step the same way (the config then gets one MTP layer; natural drafts: a step's shapes,
and so its cost, do not depend on what it accepts).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
import traceback
import warnings

import torch

from sglang.bench_plot import import_pyplot

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
from bench_e2e_vs_hf import make_config_dir  # noqa: E402

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "aten::_local_scalar_dense")
COPY_CALLS = ("cudaMemcpyAsync",)


MODES = {"overlap": {}, "sync": {"disable_overlap_schedule": True},
         "det": {"enable_deterministic_inference": True},  # det: overlap + batch-invariant kernels
         # eagle: a speculative step (3 draft steps, a 4-row verify, the draft extend) under overlap;
         # its shapes are fixed by the batch, so its wall vs GPU busy does not depend on acceptance
         "eagle": {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3}}


def _engine(path: str, args, mode: str):
    from sglang.srt.entrypoints.engine import Engine

    max_bs = max(args.batch_sizes)
    kw = dict(MODES[mode])
    if mode == "eagle" and args.hot_vocab:
        # FR-Spec's draft head over a hot-token subset, as bench_speculative --hot-vocab (the lowest ids)
        os.makedirs(args.out_dir, exist_ok=True)
        kw["speculative_token_map"] = os.path.join(args.out_dir, f"hot_{args.hot_vocab}.pt")
        with open(os.path.join(path, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        torch.save(torch.arange(min(args.hot_vocab, vocab)), kw["speculative_token_map"])
    return Engine(model_path=path, tokenizer_path=path, load_format="dummy", dtype=args.dtype, device=args.device,
                  context_length=args.prompt_len + args.gen_len + 64, max_running_requests=max_bs,
                  cuda_graph_max_bs=max_bs, disable_radix_cache=True, random_seed=0,
                  max_total_tokens=max_bs * (args.prompt_len + args.gen_len + 64), **kw)


def _start(engine, bs: int, args) -> None:
    """bs requests admitted and decoding (prefill done), each with room for every measured step."""
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(bs)
    for p in torch.randint(5, vocab, (bs, args.prompt_len), generator=g).tolist():
        engine._submit(None, p, {"temperature": 0, "max_new_tokens": args.gen_len, "ignore_eos": True}, False, -1, 0)
    sched = engine.scheduler
    while sched.waiting_queue or len(sched.running) < bs:
        sched.step()
    for _ in range(3):  # a few decode steps: graphs warm, the overlap pipeline full
        sched.step()


def _drain(engine) -> None:
    sched = engine.scheduler
    while sched.has_work():
        sched.step()
    sched.finish_idle_step()


def _merged_busy_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, -1.0
    for s, e in sorted(intervals):
        if s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy


def _our_frame(stack: list[str]) -> str:
    for fr in stack:
        if "sglang" in fr and "bench_overlap_step" not in fr:
            return fr.split("sglang/", 1)[-1]
    return stack[0] if stack else "?"


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if f"{os.sep}sglang{os.sep}" in f.filename
              and "bench_overlap_step" not in f.filename]
    return " < ".join(f"{f.filename.split('sglang' + os.sep)[-1]}:{f.lineno}" for f in frames[::-1][:3]) or "?"


def trace_host_waits(sched, steps: int) -> dict:
    """Per step, where our code makes the host wait for the GPU (CUDA sync debug mode's warnings)
    and where it uploads from pageable memory (a staged, synchronous copy), by call site."""
    counts: collections.Counter = collections.Counter()
    orig_to, orig_tensor, orig_show = torch.Tensor.to, torch.tensor, warnings.showwarning

    def to(self, *a, **k):
        out = orig_to(self, *a, **k)
        if self.device.type == "cpu" and out.device.type == "cuda" and not self.is_pinned():
            counts[f"pageable upload @ {_where()}"] += 1
        return out

    def tensor(*a, **k):
        out = orig_tensor(*a, **k)
        if out.device.type == "cuda":
            counts[f"torch.tensor upload @ {_where()}"] += 1
        return out

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            counts[f"sync @ {_where()}"] += 1
        else:
            orig_show(message, category, filename, lineno, file, line)

    torch.cuda.synchronize()
    try:
        torch.Tensor.to, torch.tensor, warnings.showwarning = to, tensor, show
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            for _ in range(steps):
                sched.step()
            torch.cuda.set_sync_debug_mode("default")
    finally:
        torch.Tensor.to, torch.tensor, warnings.showwarning = orig_to, orig_tensor, orig_show
    return {k: v / steps for k, v in counts.most_common(20)}


def measure(engine, bs: int, args, device: str) -> dict:
    sched = engine.scheduler
    _start(engine, bs, args)
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        sched.step()
        walls.append(time.perf_counter() - t0)
    row = {"step_ms": 1e3 * statistics.median(walls), "step_ms_all": [1e3 * w for w in walls]}
    if device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        n = args.profile_steps
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            for _ in range(n):
                sched.step()
            torch.cuda.synchronize()
        events = prof.events()
        gpu = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name
                   and "Memset" not in e.name]
        copies = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" in e.name]
        by_kind = collections.Counter(e.name for e in copies)
        kernel_us = collections.Counter()
        for e in kernels:
            kernel_us[e.name[:90]] += e.time_range.end - e.time_range.start
        sources: dict[str, collections.Counter] = {"copy": collections.Counter(), "sync": collections.Counter()}
        for e in events:
            if e.device_type != torch.autograd.DeviceType.CPU:
                continue
            kind = "sync" if e.name in SYNC_CALLS else "copy" if e.name in COPY_CALLS else None
            if kind is None:
                continue
            stack = list(e.stack or [])
            parent = e.cpu_parent
            while not stack and parent is not None:
                stack, parent = list(parent.stack or []), parent.cpu_parent
            sources[kind][f"{e.name} @ {_our_frame(stack)}"] += 1
        row.update(gpu_busy_ms=_merged_busy_us(gpu) / 1e3 / n, kernels_per_step=len(kernels) / n,
                   copies_per_step=len(copies) / n, copy_kinds={k: v / n for k, v in by_kind.items()},
                   top_kernels_ms={k: v / 1e3 / n for k, v in kernel_us.most_common(10)},
                   copy_sources={k: v / n for k, v in sources["copy"].most_common(12)},
                   sync_sources={k: v / n for k, v in sources["sync"].most_common(12)})
        row["step_over_busy"] = row["step_ms"] / row["gpu_busy_ms"] if row["gpu_busy_ms"] else None
        row["host_waits"] = trace_host_waits(sched, args.trace_steps)
    _drain(engine)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="deepseek-v32")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--trace-steps", type=int, default=5, help="steps traced for host waits (sync debug mode)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--modes", default="overlap,sync", help=f"comma list of {sorted(MODES)}")
    p.add_argument("--hot-vocab", type=int, default=0,
                   help="eagle: the draft head over the first N token ids (FR-Spec; 0: the full vocabulary)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    if args.smoke:
        args.device, args.dtype, args.steps, args.gen_len = "cpu", "float32", 6, 24
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.steps = min(args.steps, args.gen_len - 8)
    args.profile_steps = min(args.profile_steps, args.gen_len - args.steps - 6)
    args.trace_steps = max(1, min(args.trace_steps, args.gen_len - args.steps - args.profile_steps - 5))
    extra = {"num_nextn_predict_layers": 1} if "eagle" in args.modes.split(",") else {}
    path = make_config_dir(args.shape, args.layers, args.smoke, n_routed_experts=args.experts, **extra)
    result = {"shape": args.shape, "layers": args.layers, "experts": args.experts, "hot_vocab": args.hot_vocab, "device": args.device,
              "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "modes": {}}
    for mode in args.modes.split(","):
        engine = _engine(path, args, mode)
        result["modes"][mode] = {bs: measure(engine, bs, args, args.device) for bs in args.batch_sizes}
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()
    os.makedirs(args.out_dir, exist_ok=True)
    name = f"overlap_{args.shape}_{args.layers}l_{'smoke' if args.smoke else args.device}"
    with open(os.path.join(args.out_dir, name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'mode':8} {'bs':>4} {'step ms':>8} {'gpu ms':>8} {'ratio':>6} {'kern':>6} {'copies':>6}")
    for mode, rows in result["modes"].items():
        for bs, r in rows.items():
            print(f"{mode:8} {bs:4d} {r['step_ms']:8.3f} {r.get('gpu_busy_ms', float('nan')):8.3f} "
                  f"{r.get('step_over_busy') or float('nan'):6.2f} {r.get('kernels_per_step', 0):6.0f} "
                  f"{r.get('copies_per_step', 0):6.1f}")
            for k, ms in (r.get("top_kernels_ms") or {}).items():
                print(f"    kern {ms:7.3f} ms  {k}")
            for k in ("copy_sources", "sync_sources"):
                for src, c in (r.get(k) or {}).items():
                    print(f"    {k[:4]} {c:5.1f}/step  {src}")
            for src, c in (r.get("host_waits") or {}).items():
                print(f"    wait {c:5.1f}/step  {src}")
    plt = import_pyplot(os.path.join(args.out_dir, name + ".png"))
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, rows in result["modes"].items():
        bss = sorted(rows)
        ax.plot(bss, [rows[b]["step_ms"] for b in bss], "o-", label=f"{mode} step")
        if args.device == "cuda":
            ax.plot(bss, [rows[b]["gpu_busy_ms"] for b in bss], "x--", label=f"{mode} GPU busy")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("ms per scheduler step")
    ax.legend()
    ax.set_title(f"{args.shape} x {args.layers} layers, {args.experts} experts, {result['device_name']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, name + ".png"), dpi=100)


if __name__ == "__main__":
    main()
