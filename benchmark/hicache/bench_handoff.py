"""How soon a HiCache load starts on its copy thread when the thread that submitted it stays busy.

The scheduler submits a host-hit load at admission and goes on building and launching the forward
(Python, holding the GIL); the forward then waits on the load's first layer. The woken copy thread
needs the GIL to plan and queue its copies, and the interpreter forces the busy holder to drop it
only after sys.getswitchinterval() (5 ms by default). `HiCacheController.load` therefore waits (at
most HAND_OVER_S) until the copy thread has started. This measures, on the same controller with
the hand-over on and off in alternation, the delay submit -> start (TransferOp.timeline) and how
long load() keeps its caller, while the caller spins `--busy-ms` of Python after each submit.
Host-side only: the numbers are the same kind on a CPU and on a GPU host (KV on the CPU here).

    python benchmark/hicache/bench_handoff.py --out-dir /tmp/out
    python benchmark/hicache/bench_handoff.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from sglang.bench_plot import import_pyplot


def _pool(pages: int, page: int):
    from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

    return NSATokenToKVPool(pages * page, page, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64, layer_num=4,
                            index_head_dim=128, index_layer_ids=[0, 2], device="cpu")


def measure(ctl, pages: int, page: int, busy_s: float, hand_over: bool, repeats: int) -> dict:
    ctl.hand_over_loads = hand_over
    slots = torch.arange(pages * page, dtype=torch.int64)
    start, held = [], []
    for i in range(repeats + 1):  # the first load is a warm-up (allocations, first-call paths)
        t0 = time.perf_counter()
        op = ctl.load(slots, slots)
        t1 = time.perf_counter()
        end, x = t1 + busy_s, 0
        while time.perf_counter() < end:  # the scheduler building and launching the forward
            x += 1
        ctl.wait_idle()
        ctl.poll()
        if op.error is not None:
            raise RuntimeError(op.error)
        if i:
            start.append(1e6 * (op.timeline["start"] - op.timeline["submit"]))
            held.append(1e6 * (t1 - t0))
    q = lambda v: {"median": statistics.median(v), "p95": sorted(v)[int(0.95 * (len(v) - 1))]}  # noqa: E731
    return {"start_after_submit_us": q(start), "load_call_us": q(held)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--busy-ms", type=float, default=10.0)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    if args.smoke:
        args.pages, args.page_size, args.repeats = 4, 4, 4
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.memory_pool_host import HostKVPool

    pool = _pool(args.pages, args.page_size)
    ctl = HiCacheController([(pool, HostKVPool(pool, args.pages * args.page_size))])
    rows = {"on": [], "off": []}
    try:
        for i in range(2 * 3):  # alternate: three rounds of each, medians of their medians
            mode = "on" if i % 2 == 0 else "off"
            rows[mode].append(measure(ctl, args.pages, args.page_size, args.busy_ms / 1e3, mode == "on",
                                      args.repeats))
    finally:
        ctl.shutdown()
    res = {"switch_interval_ms": 1e3 * sys.getswitchinterval(), "busy_ms": args.busy_ms, "pages": args.pages,
           "page_size": args.page_size, "device": "cpu"}
    for mode, rs in rows.items():
        res[mode] = {k: statistics.median(r[k]["median"] for r in rs) for k in rs[0]}
    res["start_delay_ratio_off_over_on"] = res["off"]["start_after_submit_us"] / max(res["on"]["start_after_submit_us"], 1e-9)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, "handoff" + ("_smoke" if args.smoke else ""))
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    for mode in ("off", "on"):
        r = res[mode]
        print(f"hand-over {mode:3}: load starts {r['start_after_submit_us']:8.0f} us after submit, "
              f"load() returns after {r['load_call_us']:6.0f} us")
    print(f"start delay off / on: {res['start_delay_ratio_off_over_on']:.1f}x (switch interval "
          f"{res['switch_interval_ms']:.1f} ms)")
    plt = import_pyplot(stem + ".png")
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    names = ["start after submit", "load() call"]
    keys = ["start_after_submit_us", "load_call_us"]
    for j, mode in enumerate(("off", "on")):
        ax.bar([i + 0.4 * j for i in range(2)], [res[mode][k] for k in keys], 0.4, label=f"hand-over {mode}")
    ax.set_xticks([i + 0.2 for i in range(2)], names)
    ax.set_ylabel("us (median)")
    ax.set_title(f"HiCache load hand-over, caller busy {args.busy_ms:g} ms", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=100)


if __name__ == "__main__":
    main()
