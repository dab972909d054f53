"""Serving benchmark of our server vs transformers `generate` on the same model and prompts.

Starts the server on a builtin model and loads transformers' model next to the client; each
repeat runs bench_serving (streaming /v1/completions, fixed concurrency) and then transformers
`generate` over the same prompts in batches of the same concurrency, so machine noise hits both
sides alike. Reported: the median output tokens/s of each side over the repeats, and their ratio.

    python benchmark/serving/bench_serving_vs_hf.py --model builtin:tiny-deepseek-v32 --num-prompts 64 \\
        --max-concurrency 16 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_serving  # noqa: E402


def load_hf(model_dir: str, prompts: list[list[int]]):
    from sglang.srt.testing.reference import load_hf_reference

    hf = load_hf_reference(model_dir)
    with torch.no_grad():  # warm-up
        x = torch.tensor(prompts[:2])
        hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=2, min_new_tokens=2,
                    pad_token_id=1)
    return hf


def run_hf(hf, prompts: list[list[int]], output_len: int, batch: int) -> dict:
    gen = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=1)
    with torch.no_grad():
        t0, n = time.perf_counter(), 0
        for i in range(0, len(prompts), batch):
            x = torch.tensor(prompts[i : i + batch])
            out = hf.generate(x, attention_mask=torch.ones_like(x), **gen)
            n += (out.shape[1] - x.shape[1]) * x.shape[0]
        dt = time.perf_counter() - t0
    return {"output_tokens": int(n), "duration_s": dt, "output_throughput": n / dt}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:tiny-deepseek-v32")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--server-args", default="", help="extra launch_server flags, space separated")
    p.add_argument("--server-threads", type=int, default=None,
                   help="OMP_NUM_THREADS for the server (CPU: leave cores to the HTTP and client processes)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (ours, transformers, ours, ...)")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()

    from sglang.srt.managers.tokenizer_utils import load_tokenizer
    from sglang.srt.model_loader.builtin import resolve_model_path
    from sglang.srt.testing.server import ServerProcess

    model_dir = resolve_model_path(args.model)
    os.makedirs(args.out_dir, exist_ok=True)
    tag = args.model.replace("builtin:", "").replace("/", "_")
    stem = os.path.join(args.out_dir, f"serving_vs_hf_{tag}")
    # Token-id prompts of one length: both sides see identical inputs and transformers needs no padding.
    tok = load_tokenizer(model_dir)
    g = torch.Generator().manual_seed(1)
    special = set(tok.all_special_ids)
    prompts = []
    while len(prompts) < args.num_prompts:
        ids = torch.randint(0, len(tok), (args.input_len,), generator=g).tolist()
        if not special & set(ids):
            prompts.append(ids)
    reqs = [bench_serving.RequestInput(prompt=ids, prompt_len=len(ids), output_len=args.output_len)
            for ids in prompts]
    bench_argv = ["--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
                  "--random-output-len", str(args.output_len), "--output-file", stem + "_ours.json"]
    env = {"OMP_NUM_THREADS": str(args.server_threads)} if args.server_threads else None
    hf_model = load_hf(model_dir, prompts)
    ours_runs, hf_runs = [], []
    with ServerProcess(args.model, *args.server_args.split(), env=env) as server:
        bargs = bench_serving.parse_args(["--base-url", server.base_url, *bench_argv])
        for _ in range(args.repeats):  # interleaved: the server idles while transformers runs
            ours_runs.append(asyncio.run(bench_serving.run_benchmark(bargs, reqs)))
            hf_runs.append(run_hf(hf_model, prompts, args.output_len, args.max_concurrency))
    ours_tps = [r["summary"]["output_throughput"] for r in ours_runs]
    hf_tps = [r["output_throughput"] for r in hf_runs]
    # The per-request details (JSON + plot) are those of the run with the median throughput.
    ours = ours_runs[ours_tps.index(statistics.median_low(ours_tps))]
    with open(stem + "_ours.json", "w") as f:
        json.dump(ours, f, indent=2)
    bench_serving.plot(ours, stem + "_ours.png")

    s = ours["summary"]
    result = {
        "model": args.model, "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
        "input_len": args.input_len, "output_len": args.output_len, "server_args": args.server_args,
        "server_threads": args.server_threads, "repeats": args.repeats,
        "method": "interleaved repeats (ours, transformers, ...), median of each side",
        "ours_output_throughput": statistics.median(ours_tps), "hf_output_throughput": statistics.median(hf_tps),
        "ratio": statistics.median(ours_tps) / statistics.median(hf_tps),
        "ours_output_throughput_runs": ours_tps, "hf_output_throughput_runs": hf_tps,
        "ours_median_ttft_ms": s["median_ttft_ms"], "ours_median_tpot_ms": s["median_tpot_ms"],
        "ours_completed": sum(r["summary"]["completed"] for r in ours_runs),
        "ours_failed": sum(r["summary"]["failed"] for r in ours_runs), "hf": hf_runs,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
