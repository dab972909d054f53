"""HiCache multi-turn workload, on vs off (the measurement of upstream's HiCache blog, on CPU).

`--conversations` conversations are re-sent round-robin for `--turns` turns; each turn appends
`--turn-tokens` new user tokens to the conversation's history (previous prompts + greedy outputs)
and generates `--gen` tokens. All histories together hold more KV than the device pool
(`--device-tokens`), so by a conversation's next turn its prefix has left the device: with HiCache
on it comes back from host memory (layer-wise load), off (the plain radix cache) it is recomputed.

Method: both engines stay loaded; each repeat runs the whole workload on each side (order
alternating per repeat; one untimed warm-up repeat first) from a flushed cache; TTFT = time from submitting a request to its first
token (the engine's streaming loop); throughput = workload tokens (prompt + generated) / wall time.
Medians over repeats; ratios are off / on for TTFT and on / off for throughput, from the same run.
Both sides must produce the same greedy outputs (checked).

    python benchmark/hicache/bench_multiturn.py --out benchmark/hicache/results/multiturn_cpu.json
    python benchmark/hicache/bench_multiturn.py --smoke          # seconds: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from sglang.srt.entrypoints.engine import Engine

from sglang.bench_plot import import_pyplot

HERE = os.path.dirname(os.path.abspath(__file__))


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(5, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _request(eng: Engine, ids: list[int], gen: int) -> tuple[float, float, list[int], int]:
    """(TTFT s, latency s, output ids, cached tokens) of one streamed request."""
    sp = {"temperature": 0, "max_new_tokens": gen, "ignore_eos": True}
    t0 = time.perf_counter()
    pending = eng._submit(None, ids, sp, False, -1, 0, False, None)  # streaming loop: first token time
    ttft = None
    for _ in eng._run([pending]):
        if ttft is None:
            ttft = time.perf_counter() - t0
    res = pending.result()
    return ttft, time.perf_counter() - t0, res["output_ids"], res["meta_info"]["cached_tokens"]


def run_workload(eng: Engine, args) -> dict:
    eng.flush_cache()
    hist = [[] for _ in range(args.conversations)]
    ttft, cached, outputs, tokens = [], [], [], 0
    t0 = time.perf_counter()
    for turn in range(args.turns):
        for c in range(args.conversations):
            ids = hist[c] + _tokens(args.turn_tokens, 1000 * c + turn)
            t, _, out, hit = _request(eng, ids, args.gen)
            ttft.append({"turn": turn, "conv": c, "prompt": len(ids), "ttft_s": t, "cached": hit})
            outputs.append(out)
            tokens += len(ids) + len(out)
            hist[c] = ids + out
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "throughput_tok_s": tokens / wall, "requests": ttft,
            "outputs": outputs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:tiny-deepseek-v32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=256)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--device-tokens", type=int, default=2048)
    ap.add_argument("--hicache-ratio", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed repeats first (first forwards warm up)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one repeat")
    ap.add_argument("--out", default=None, help="JSON path (a .png plot next to it)")
    args = ap.parse_args()
    if args.smoke:
        args.conversations, args.turns, args.turn_tokens, args.gen, args.device_tokens, args.repeats = 3, 2, 64, 4, 256, 1
        args.warmup = 0
    from tqdm import tqdm

    common = dict(model_path=args.model, device=args.device, dtype=args.dtype, random_seed=0, page_size=1,
                  max_total_tokens=args.device_tokens, chunked_prefill_size=-1,
                  max_prefill_tokens=args.device_tokens)
    total_kv = args.conversations * args.turns * (args.turn_tokens + args.gen)
    print(f"KV of all conversations at the end: {total_kv} tokens; device pool {args.device_tokens}", file=sys.stderr)
    engines = {"on": Engine(enable_hierarchical_cache=True, hicache_ratio=args.hicache_ratio, **common),
               "off": Engine(**common)}
    runs = {k: [] for k in engines}
    for rep in tqdm(range(args.warmup + args.repeats), desc="repeats (first: warm-up)", file=sys.stderr):
        for side in (("on", "off") if rep % 2 == 0 else ("off", "on")):
            r = run_workload(engines[side], args)
            if rep >= args.warmup:
                runs[side].append(r)
    for a, b in zip(runs["on"], runs["off"]):
        if a["outputs"] != b["outputs"]:
            raise RuntimeError("HiCache on and off produced different greedy outputs")

    def summary(side: str) -> dict:
        rs = runs[side]
        later = lambda r: [x["ttft_s"] for x in r["requests"] if x["turn"] > 0]  # noqa: E731
        per_turn = [statistics.median(statistics.mean(x["ttft_s"] for x in r["requests"] if x["turn"] == t)
                                      for r in rs) for t in range(args.turns)]
        return {"mean_ttft_s": statistics.median(statistics.mean(x["ttft_s"] for x in r["requests"]) for r in rs),
                "mean_ttft_later_turns_s": statistics.median(statistics.mean(later(r)) for r in rs),
                "throughput_tok_s": statistics.median(r["throughput_tok_s"] for r in rs),
                "wall_s": statistics.median(r["wall_s"] for r in rs),
                "cached_tokens": sum(x["cached"] for x in rs[-1]["requests"]),
                "mean_ttft_per_turn_s": per_turn}

    on, off = summary("on"), summary("off")
    stats = engines["on"].scheduler.tree_cache.stats
    result = {"device": args.device, "model": args.model, "args": {k: v for k, v in vars(args).items() if k != "out"},
              "total_kv_tokens": total_kv, "on": on, "off": off,
              "ttft_ratio": off["mean_ttft_s"] / on["mean_ttft_s"],
              "ttft_ratio_later_turns": off["mean_ttft_later_turns_s"] / on["mean_ttft_later_turns_s"],
              "throughput_ratio": on["throughput_tok_s"] / off["throughput_tok_s"],
              "hicache_loaded_tokens": stats["loaded_tokens"], "outputs_equal": True}
    print(json.dumps({k: v for k, v in result.items()}, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        plot(result, args.out.replace(".json", ".png"))


def plot(result: dict, path: str) -> None:
    plt = import_pyplot(path)
    if plt is None:
        return None

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    turns = range(len(result["on"]["mean_ttft_per_turn_s"]))
    w = 0.38
    a.bar([t - w / 2 for t in turns], [x * 1e3 for x in result["off"]["mean_ttft_per_turn_s"]], w, label="HiCache off")
    a.bar([t + w / 2 for t in turns], [x * 1e3 for x in result["on"]["mean_ttft_per_turn_s"]], w, label="HiCache on")
    a.set_xlabel("turn")
    a.set_ylabel("mean TTFT (ms)")
    a.set_title(f"TTFT: {result['ttft_ratio']:.2f}x lower (turns>0: {result['ttft_ratio_later_turns']:.2f}x)")
    a.legend()
    b.bar(["off", "on"], [result["off"]["throughput_tok_s"], result["on"]["throughput_tok_s"]], color=["C0", "C1"])
    b.set_ylabel("tokens / s (prompt + generated)")
    b.set_title(f"throughput {result['throughput_ratio']:.2f}x")
    fig.suptitle(f"multi-turn, {result['device']}, {result['model']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
