"""Offline engine vs transformers `generate`: same tiny model, same prompts, batch 16, greedy.

Writes JSON + a bar plot; the ratio (ours / transformers output tokens/s) is measured in one run.

    python benchmark/offline/bench_engine_vs_hf.py --model builtin:tiny-deepseek-v32 --batch 16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from sglang.bench_plot import import_pyplot


def run(args) -> dict:
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.model_loader.builtin import resolve_model_path
    from sglang.srt.testing.reference import load_hf_reference

    path = resolve_model_path(args.model)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(5, 1000, (args.batch, args.input_len), generator=g)
    dtype = getattr(torch, args.dtype)
    sp = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}

    engine = Engine(model_path=path, dtype=args.dtype, device=args.device, nsa_index_k_dtype=args.index_k_dtype,
                    disable_radix_cache=True, max_total_tokens=args.batch * (args.input_len + args.output_len) * 2)
    hf = load_hf_reference(path, dtype).to(args.device)
    x = prompts.to(args.device)
    mask = torch.ones_like(x)
    gen = dict(do_sample=False, max_new_tokens=args.output_len, min_new_tokens=args.output_len, pad_token_id=1)

    def run_ours() -> tuple[int, float]:
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts.tolist(), sampling_params=sp)
        return sum(len(o["output_ids"]) for o in outs), time.perf_counter() - t0

    @torch.no_grad()
    def run_hf() -> tuple[int, float]:
        t0 = time.perf_counter()
        ref = hf.generate(x, attention_mask=mask, **gen)
        return int((ref.shape[1] - args.input_len) * ref.shape[0]), time.perf_counter() - t0

    run_ours(), run_hf()  # warm-up
    # Interleaved repeats: machine noise hits both sides alike; report the median of each.
    samples = [(run_ours(), run_hf()) for _ in range(args.repeats)]
    ours_tps = sorted(n / t for (n, t), _ in samples)
    hf_tps = sorted(n / t for _, (n, t) in samples)
    mid = len(samples) // 2
    return {
        "model": args.model, "device": args.device, "dtype": args.dtype, "batch": args.batch,
        "input_len": args.input_len, "output_len": args.output_len, "index_k_dtype": args.index_k_dtype,
        "ours_output_tok_s": ours_tps[mid], "hf_output_tok_s": hf_tps[mid],
        "ratio": ours_tps[mid] / hf_tps[mid], "repeats": args.repeats,
        "ours_samples_tok_s": ours_tps, "hf_samples_tok_s": hf_tps,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
    }


def plot(result: dict, path: str) -> None:
    plt = import_pyplot(path)
    if plt is None:
        return None

    fig, ax = plt.subplots(figsize=(5, 3.5))
    names, vals = ["sglang Engine", "transformers generate"], [result["ours_output_tok_s"], result["hf_output_tok_s"]]
    ax.bar(names, vals, color=["#2b7bba", "#999999"])
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{result['model']} bs={result['batch']} {result['device']} index K {result['index_k_dtype']}\n"
                 f"ratio {result['ratio']:.2f}x (median of {result['repeats']})", fontsize=9)
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:tiny-deepseek-v32")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--input-len", type=int, default=96)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--index-k-dtype", default="fp8_e4m3")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    result = run(args)
    os.makedirs(args.out_dir, exist_ok=True)
    tag = f"{args.model.replace('builtin:', '').replace('/', '_')}_{args.device}_{args.index_k_dtype}"
    stem = os.path.join(args.out_dir, f"engine_vs_hf_{tag}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    plot(result, stem + ".png")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
