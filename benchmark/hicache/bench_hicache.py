"""HiCache benchmark: a host hit (prefix evicted to the host, loaded back layer by layer) vs
recomputing the prefix; prefill time with the layer-end host backup on vs off; host<->device copy
bandwidth of the controller vs a plain copy of the same bytes.

Method: one engine per configuration stays loaded; each repeat times every configuration in turn
and the reported time is the median. TTFT = a request with max_new_tokens 1, timed around
Engine.generate. A host hit is arranged by running the prompt, then filler prompts that evict it
from a device pool sized to hold about one prompt (checked: the re-run's prefix comes from the host).

    python benchmark/hicache/bench_hicache.py --device cpu --prefix-lens 256,1024
    python benchmark/hicache/bench_hicache.py --device cuda --dtype bfloat16 --prefix-lens 4096,32768
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sglang.srt.entrypoints.engine import Engine

SP = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(5, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_host_hit(args, length: int) -> dict:
    page = 64 if args.device == "cuda" else 1
    pool = (length // page + 2) * page * 2  # about two prompts: two fillers evict the first
    common = dict(model_path=args.model, device=args.device, dtype=args.dtype, random_seed=0, page_size=page,
                  max_total_tokens=pool, chunked_prefill_size=-1, max_prefill_tokens=max(16384, length + page))
    hi = Engine(enable_hierarchical_cache=True, **common)
    cold = Engine(disable_radix_cache=True, **common)
    tc = hi.scheduler.tree_cache
    hits, recompute = [], []
    for rep in range(args.repeats):
        prompt = _prompt(length, 1000 + rep)
        hi.generate(input_ids=prompt, sampling_params=SP)
        for k in range(2):
            hi.generate(input_ids=_prompt(length, 5000 + 10 * rep + k), sampling_params=SP)
        tc.controller.wait_idle()
        tc.check_events()
        m = tc.match_prefix(prompt)
        if m.host_hit_length < length // 2:
            raise RuntimeError(f"prefix not on the host (device {len(m.device_indices)}, host {m.host_hit_length})")
        hits.append(_timed(lambda: hi.generate(input_ids=prompt, sampling_params=SP)))
        recompute.append(_timed(lambda: cold.generate(input_ids=prompt, sampling_params=SP)))
    h, r = statistics.median(hits), statistics.median(recompute)
    return {"prefix_len": length, "host_hit_ttft_s": h, "recompute_ttft_s": r, "speedup": r / h}


def bench_backup_overhead(args, length: int) -> dict:
    common = dict(model_path=args.model, device=args.device, dtype=args.dtype, random_seed=0,
                  chunked_prefill_size=-1, max_prefill_tokens=max(16384, length + 64))
    engines = {"backup_on": Engine(enable_hierarchical_cache=True, **common), "backup_off": Engine(**common)}
    times = {k: [] for k in engines}
    for rep in range(args.repeats):
        prompt = _prompt(length, 9000 + rep)  # fresh each time: a full prefill, backed up at layer ends
        for name in (list(engines) if rep % 2 == 0 else list(reversed(engines))):
            times[name].append(_timed(lambda e=engines[name]: e.generate(input_ids=prompt, sampling_params=SP)))
    on, off = statistics.median(times["backup_on"]), statistics.median(times["backup_off"])
    tc = engines["backup_on"].scheduler.tree_cache
    tc.controller.wait_idle()
    tc.check_events()
    return {"prefix_len": length, "prefill_backup_on_s": on, "prefill_backup_off_s": off,
            "overhead": on / off - 1, "committed": tc.backup.stats["committed"]}


def bench_copy_bandwidth(args, tokens: int) -> dict:
    """Controller backup + load of `tokens` tokens of a real pool vs copying the same bytes once."""
    eng = Engine(enable_hierarchical_cache=True, model_path=args.model, device=args.device, dtype=args.dtype,
                 random_seed=0, max_total_tokens=tokens * 2)
    tc = eng.scheduler.tree_cache
    ctl, pool = tc.controller, eng.scheduler.tp_worker.model_runner.token_to_kv_pool
    dev = eng.scheduler.allocator.alloc(tokens)
    host = tc.host_allocator.alloc(tokens)
    nbytes = tokens * sum(h.get_size_bytes() for _, h in ctl.pairs) // tc.host_allocator.size

    def run(kind):
        op = ctl.backup(dev, host) if kind == "backup" else ctl.load(host, dev)
        while not op.done:
            ctl.wait_idle()
        ctl.poll()

    out = {"tokens": tokens, "bytes": nbytes}
    for kind in ("backup", "load"):
        run(kind)  # warm-up
        out[f"{kind}_GBps"] = nbytes / statistics.median(_timed(lambda: run(kind)) for _ in range(args.repeats)) / 1e9
    src = torch.empty(nbytes, dtype=torch.uint8, device=args.device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    plain = statistics.median(_timed(lambda: dst.copy_(src)) for _ in range(args.repeats))
    out["plain_d2h_GBps"] = nbytes / plain / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:tiny-deepseek-v32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefix-lens", default="256,1024")
    ap.add_argument("--copy-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    lens = [int(x) for x in args.prefix_lens.split(",")]
    res = {"device": args.device, "model": args.model,
           "host_hit": [bench_host_hit(args, n) for n in lens],
           "backup_overhead": [bench_backup_overhead(args, n) for n in lens],
           "copy": bench_copy_bandwidth(args, args.copy_tokens)}
    print(json.dumps(res, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
