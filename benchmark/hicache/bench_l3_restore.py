"""HiCache L3 (file tier): restoring a long prefix after a restart of the host tier vs recomputing it.

Per prefix length: an engine with `--hicache-storage-backend file` prefills the prompt once (backed
up to host, then written to files) and its writes are flushed. Then, per repeat:
- restore: the same engine's host tier is restarted (`flush_cache`: device radix, host pool and
  host radix emptied; the files stay) and the prompt is re-sent: L3 -> host pages -> layer-wise
  load -> only the last page is computed (checked: cached tokens come from storage);
- recompute: an engine without any prefix cache prefills the same prompt.
TTFT = a request with max_new_tokens 1, timed around Engine.generate; sides alternate; medians.
Both give the same greedy token (checked). Files are read through the OS page cache (not dropped).

    python benchmark/hicache/bench_l3_restore.py --lens 1024,2048,4032 --out benchmark/hicache/results/l3_restore_cpu.json
    python benchmark/hicache/bench_l3_restore.py --smoke
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time

import torch

from sglang.srt.entrypoints.engine import Engine

from sglang.bench_plot import import_pyplot

SP = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(5, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench_len(args, length: int, directory: str) -> dict:
    page = args.page_size
    common = dict(model_path=args.model, device=args.device, dtype=args.dtype, random_seed=0, page_size=page,
                  max_total_tokens=(length // page + 4) * page, chunked_prefill_size=-1,
                  max_prefill_tokens=length + page)
    l3 = Engine(enable_hierarchical_cache=True, hicache_storage_backend="file",
                hicache_storage_backend_extra_config=json.dumps({"file_path": directory}), **common)
    cold = Engine(disable_radix_cache=True, **common)
    for eng in (l3, cold):  # warm-up: the first forwards of an engine are slower
        eng.generate(input_ids=_prompt(length, 3 + length), sampling_params=SP)
    prompt = _prompt(length, 7 + length)
    first = l3.generate(input_ids=prompt, sampling_params=SP)
    want = first["output_ids"]
    if not want:  # e.g. longer than the model's context (the tiny models: 4096)
        raise RuntimeError(f"a {length}-token prompt was not served: {first['meta_info']}")
    tc = l3.scheduler.tree_cache
    tc.controller.wait_idle()
    tc.check_events()
    tc.controller.wait_idle()
    tc.check_events()
    tc.controller.storage.flush()
    restore, recompute = [], []
    for rep in range(args.repeats):
        def run_restore():
            l3.flush_cache()  # the host tier restarts empty; the files stay
            before = tc.stats["storage_loaded_tokens"]
            t, res = _timed(lambda: l3.generate(input_ids=prompt, sampling_params=SP))
            got = tc.stats["storage_loaded_tokens"] - before
            if res["output_ids"] != want or got < length - 2 * page:
                raise RuntimeError(f"restore read {got} tokens from L3, output {res['output_ids']} vs {want}")
            restore.append(t)

        def run_recompute():
            t, res = _timed(lambda: cold.generate(input_ids=prompt, sampling_params=SP))
            if res["output_ids"] != want:
                raise RuntimeError("recompute output differs")
            recompute.append(t)

        for fn in ((run_restore, run_recompute) if rep % 2 == 0 else (run_recompute, run_restore)):
            fn()
    r, c = statistics.median(restore), statistics.median(recompute)
    return {"prefix_len": length, "page_size": page, "restore_ttft_s": r, "recompute_ttft_s": c, "speedup": c / r,
            "restore_all_s": restore, "recompute_all_s": recompute}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:tiny-deepseek-v32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lens", default="1024,2048,4032", help="prompt lengths (tiny models: context 4096)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="storage directory (default: a fresh temporary one, removed)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (a .png plot next to it)")
    args = ap.parse_args()
    if args.smoke:
        args.lens, args.repeats = "256", 1
    from tqdm import tqdm

    directory = args.dir or tempfile.mkdtemp(prefix="hicache-l3-bench-")
    try:
        rows = [bench_len(args, n, directory) for n in tqdm([int(x) for x in args.lens.split(",")],
                                                          desc="prefix lengths", file=sys.stderr)]
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    result = {"device": args.device, "model": args.model, "backend": "file", "rows": rows}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        plot(result, args.out.replace(".json", ".png"))


def plot(result: dict, path: str) -> None:
    plt = import_pyplot(path)
    if plt is None:
        return None

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["recompute_ttft_s"] for r in rows], 0.4, label="recompute")
    ax.bar([i + 0.2 for i in x], [r["restore_ttft_s"] for r in rows], 0.4, label="restore from L3 (file)")
    ax.set_xticks(list(x), [f"{r['prefix_len']}\n{r['speedup']:.1f}x" for r in rows])
    ax.set_xlabel("prefix tokens (speedup)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"L3 restore after a host-tier restart, {result['device']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
