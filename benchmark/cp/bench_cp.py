"""Context-parallel prefill: latency vs prompt length at cp = 1, 2, ... and the bytes the prefill
tail moves with the narrow (last-token) gather vs the full gather. JSON + plot.

Each cp size runs in its own set of processes (gloo on CPU, NCCL on GPUs: one rank per GPU);
each point prefills one prompt (chunking off) and decodes one token; the prefill step's time is
the median over repeats.

    # GPUs (issue 12): V3.2-shaped layers, dummy weights
    python benchmark/cp/bench_cp.py --device cuda --cp-sizes 1,2,4 --lens 8192,32768,131072 \\
        --model-path /path/to/config_dir --load-format dummy
    # CPU smoke run (tiny builtin model)
    python benchmark/cp/bench_cp.py --cp-sizes 1,2 --lens 256,512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from sglang.bench_plot import import_pyplot
from sglang.srt.testing.multi_rank import Case, run_case, run_multi_rank


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="builtin:tiny-deepseek-v32")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cp-sizes", default="1,2")
    p.add_argument("--lens", default="256,512")
    p.add_argument("--mode", default="in-seq-split", choices=["in-seq-split", "round-robin-split"])
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    from sglang.srt.model_loader.builtin import resolve_model_path

    model = resolve_model_path(args.model_path) if args.model_path.startswith("builtin:") else args.model_path
    lens = [int(x) for x in args.lens.split(",")]
    g = torch.Generator().manual_seed(0)
    rows = []
    for cp in [int(x) for x in args.cp_sizes.split(",")]:
        base = dict(model_path=model, load_format=args.load_format, device=args.device, chunked_prefill_size=-1,
                    max_prefill_tokens=max(lens), max_total_tokens=2 * max(lens) + 1024, disable_radix_cache=True)
        if args.page_size:
            base["page_size"] = args.page_size
        if cp > 1:
            base.update(enable_nsa_prefill_context_parallel=True, nsa_prefill_cp_mode=args.mode)
        cases = [Case(f"cp{cp}-{n}-{r}", base, [torch.randint(3, 250, (n,), generator=g).tolist()], 1, warmup=True)
                 for n in lens for r in range(args.repeats)]
        results = [run_case(c, 1) for c in cases] if cp == 1 else run_multi_rank(cases, cp)
        for n in lens:
            mine = [r["_stats"] for c, r in zip(cases, results) if c.name.startswith(f"cp{cp}-{n}-")]
            comm = mine[-1]["comm"]
            rows.append({"cp": cp, "len": n, "prefill_s": statistics.median(s["step_s"][0] for s in mine),
                         "narrow_gather_elems": comm.get("narrow_gather", 0), "view_elems": comm.get("view_kv", 0)})
            print(rows[-1], flush=True)
    for r in rows:
        base = next(x for x in rows if x["cp"] == 1 and x["len"] == r["len"]) if any(x["cp"] == 1 for x in rows) else r
        r["speedup_vs_cp1"] = base["prefill_s"] / r["prefill_s"]
    os.makedirs(args.out_dir, exist_ok=True)
    out = os.path.join(args.out_dir, f"cp_prefill_{args.device}.json")
    with open(out, "w") as f:
        json.dump({"args": vars(args), "torch": torch.__version__, "rows": rows}, f, indent=1)
    plot(rows, args, out.replace(".json", ".png"))
    print("wrote", out)


def plot(rows: list[dict], args, path: str) -> None:
    plt = import_pyplot(path)
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for cp in sorted({r["cp"] for r in rows}):
        pts = [r for r in rows if r["cp"] == cp]
        ax.plot([r["len"] for r in pts], [r["prefill_s"] for r in pts], marker="o", label=f"cp={cp}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill step (s)")
    ax.set_title(f"CP prefill ({args.mode}, {args.device})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
