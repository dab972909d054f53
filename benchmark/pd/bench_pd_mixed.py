"""PD disaggregation vs one combined server under a mixed load (issue 23): decodes stream while long
prompts arrive. Disaggregation should keep the decodes' inter-token latency (ITL) flat, because the
long prefills run in another server; the combined server interleaves them with the decode steps.

    python benchmark/pd/bench_pd_mixed.py --smoke                   # CPU: tiny model, Mooncake over TCP
    python benchmark/pd/bench_pd_mixed.py --shape deepseek-v32 --layers 4 --experts 64 \\
        --backend cuda_ipc --long-len 16384 --out-dir OUT            # one GPU: both PD servers on it

One side at a time (combined, then prefill + decode + router; on one GPU the two PD servers share
it). Load: `--streams` requests with short prompts decode `--decode-len` tokens each (streamed);
once every stream produced tokens, `--long` prompts of `--long-len` tokens arrive every `--interval`
seconds; the streams stop (client disconnect) `--warm-s` after the last one answered. Per stream, ITL = gap between streamed events / tokens in the event. Reported: long-prompt
TTFT, ITL p50 / p99 / max overall and inside the windows where a long prompt was being prefilled
(sent .. its first token), decode tokens/s. JSON + a plot of ITL over time with the long prompts.
Random token ids (`/generate` input_ids), dummy weights on GPU (real V3.2 / GLM-5 layer shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time

import requests
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))

from sglang.bench_plot import import_pyplot  # noqa: E402
from sglang.srt.testing.pd import PDSetup  # noqa: E402
from streaming import stream  # noqa: E402
from sglang.srt.testing.server import ServerProcess  # noqa: E402


def _generate(base_url: str, ids: list[int], max_new: int) -> list[int]:
    r = requests.post(base_url + "/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}, timeout=1200)
    r.raise_for_status()
    return r.json()["output_ids"]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_load(base_url: str, args, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    short = [[rng.randrange(5, vocab) for _ in range(args.short_len)] for _ in range(args.streams)]
    longs = [[rng.randrange(5, vocab) for _ in range(args.long_len)] for _ in range(args.long)]
    t0 = time.perf_counter()
    res_streams: list[dict | None] = [None] * args.streams
    res_long: list[dict | None] = [None] * args.long
    errors: list[BaseException] = []

    stop = threading.Event()

    def run(slot: list, i: int, ids: list[int], max_new: int, first: threading.Event | None = None) -> None:
        try:
            slot[i] = stream(base_url, ids, max_new, t0, first, stop if first is not None else None)
        except BaseException as e:  # noqa: BLE001 -- reported after the run
            errors.append(e)
            if first is not None:
                first.set()

    firsts = [threading.Event() for _ in short]
    threads = [threading.Thread(target=run, args=(res_streams, i, ids, args.decode_len, firsts[i]))
               for i, ids in enumerate(short)]
    for t in threads:
        t.start()
    for ev in firsts:  # every stream is decoding, then a while of decode alone
        ev.wait(600)
    time.sleep(args.warm_s)
    longs_t = []
    for i, ids in enumerate(tqdm(longs, desc="long prompts")):
        th = threading.Thread(target=run, args=(res_long, i, ids, args.long_new))
        th.start()
        longs_t.append(th)
        time.sleep(args.interval)
    for th in longs_t:
        th.join()
    time.sleep(args.warm_s)  # decode alone again, then the streams stop
    stop.set()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return {"streams": res_streams, "long": res_long}


def summarize(load: dict) -> dict:
    windows = [(r["sent"], r["events"][0][0]) for r in load["long"] if r["events"]]
    itl, itl_in, itl_out, points = [], [], [], []
    for s in load["streams"]:
        ev = s["events"]
        for (ta, _), (tb, k) in zip(ev, ev[1:]):
            gap = (tb - ta) / k
            itl += [gap] * k
            (itl_in if any(lo <= tb and ta <= hi for lo, hi in windows) else itl_out).extend([gap] * k)
            points.append((tb, gap))
    ttft = [r["events"][0][0] - r["sent"] for r in load["long"] if r["events"]]
    first = min(s["events"][0][0] for s in load["streams"])
    last = max(s["events"][-1][0] for s in load["streams"])
    toks = sum(s["tokens"] - 1 for s in load["streams"])
    ms = 1e3
    return {"long_ttft_ms_median": statistics.median(ttft) * ms, "long_ttft_ms": [t * ms for t in ttft],
            "itl_ms": {"p50": pct(itl, 0.5) * ms, "p99": pct(itl, 0.99) * ms, "max": max(itl) * ms},
            "itl_during_long_prefill_ms": {"p50": pct(itl_in, 0.5) * ms, "p99": pct(itl_in, 0.99) * ms,
                                           "max": max(itl_in, default=float("nan")) * ms, "n": len(itl_in)},
            "itl_outside_ms": {"p50": pct(itl_out, 0.5) * ms, "p99": pct(itl_out, 0.99) * ms, "n": len(itl_out)},
            "decode_tok_per_s": toks / (last - first), "windows": windows, "points": points}


def raw_device_copy_gbps(nbytes: int) -> float:
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    return nbytes * 10 / (start.elapsed_time(end) / 1e3) / 1e9


def model_and_args(args) -> tuple[str, list[str], int]:
    if args.smoke:
        return "builtin:tiny-deepseek-v32", ["--max-total-tokens", "16384", "--device", "cpu"], 900
    from bench_e2e_vs_hf import make_config_dir

    path = make_config_dir(args.shape, args.layers, False, n_routed_experts=args.experts)
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    ctx = max(args.long_len + args.long_new, args.short_len + args.decode_len) + 64
    return path, ["--load-format", "dummy", "--dtype", "bfloat16", "--context-length", str(ctx),
                  "--max-total-tokens", str(args.kv_tokens), "--page-size", "64", "--cuda-graph-max-bs",
                  str(args.streams + args.long + 4), "--max-running-requests", str(args.streams + args.long + 4)], vocab


def plot(result: dict, path: str) -> None:
    plt = import_pyplot(path)
    if plt is None:
        return None

    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for ax, side in zip(axes, ("combined", "pd")):
        s = result[side]
        for lo, hi in s["windows"]:
            ax.axvspan(lo, hi, color="orange", alpha=0.25)
        if s["points"]:
            xs, ys = zip(*s["points"])
            ax.scatter(xs, [y * 1e3 for y in ys], s=3)
        ax.set_yscale("log")
        ax.set_ylabel("ITL (ms)")
        ax.set_title(f"{side}: ITL p99 {s['itl_ms']['p99']:.1f} ms, long-prompt TTFT {s['long_ttft_ms_median']:.0f} ms "
                     "(orange: a long prompt being prefilled)", fontsize=9)
    axes[-1].set_xlabel("seconds")
    fig.suptitle(result["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU, builtin tiny model, Mooncake TCP, small load")
    ap.add_argument("--shape", default="deepseek-v32", choices=["deepseek-v32", "glm-5"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64, help="routed experts (MoE width; attention / KV are real)")
    ap.add_argument("--backend", default="mooncake", choices=["mooncake", "cuda_ipc"])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--short-len", type=int, default=128)
    ap.add_argument("--decode-len", type=int, default=4096, help="max tokens of a stream (stopped earlier)")
    ap.add_argument("--long", type=int, default=6)
    ap.add_argument("--long-len", type=int, default=16384)
    ap.add_argument("--long-new", type=int, default=4)
    ap.add_argument("--check-new", type=int, default=16, help="tokens of the PD == combined greedy check")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--warm-s", type=float, default=1.0, help="decode alone this long before the first long prompt "
                    "and after the last")
    ap.add_argument("--kv-tokens", type=int, default=262144, help="GPU: KV capacity of each server")
    ap.add_argument("--server-timeout", type=float, default=600)
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if args.smoke:
        args.streams, args.decode_len, args.long, args.long_len, args.interval, args.short_len = 3, 3000, 2, 2048, 1.0, 32
    model, sargs, vocab = model_and_args(args)
    sargs += ["--random-seed", "0", "--grammar-backend", "none"]
    result = {"setting": vars(args)}
    warm_ids = [5 + i % (vocab - 10) for i in range(min(args.long_len, 2048))]
    rng = random.Random(2)  # the equivalence check: one request at a time, the same batch shapes
    check = [[rng.randrange(5, vocab) for _ in range(n)] for n in (args.short_len, args.long_len // 2, args.long_len)]
    tokens = {}
    for side in ("combined", "pd"):
        print(f"== {side}", flush=True)
        srv = ServerProcess(model, *sargs, timeout=args.server_timeout) if side == "combined" else \
            PDSetup(model, *sargs, backend=args.backend, timeout=args.server_timeout)
        try:
            stream(srv.base_url, warm_ids, 4, time.perf_counter())  # warm-up (compiles, first transfer)
            stream(srv.base_url, warm_ids[:64], 4, time.perf_counter())
            tokens[side] = [_generate(srv.base_url, ids, args.check_new) for ids in check]
            result[side] = summarize(run_load(srv.base_url, args, vocab, seed=1))
            print(side, json.dumps({k: v for k, v in result[side].items() if k not in ("points", "windows")}),
                  flush=True)
            if side == "pd":
                xfer = result["pd_transfer"] = srv.prefill.internal_state()["disaggregation"]
                xfer["gbps"] = xfer["bytes_sent"] / max(xfer["transfer_seconds"], 1e-9) / 1e9
                if args.backend == "cuda_ipc":  # vs a raw device copy of one request's bytes, one range
                    raw = raw_device_copy_gbps(xfer["bytes_sent"] // max(xfer["transfers"], 1))
                    xfer.update(raw_device_copy_gbps=raw, ratio_vs_raw=xfer["gbps"] / raw)
        finally:
            srv.stop()
    c, p = result["combined"], result["pd"]
    result["greedy_equal"] = tokens["pd"] == tokens["combined"]
    result["greedy_first_token_equal"] = [a[0] == b[0] for a, b in zip(tokens["pd"], tokens["combined"])]
    result["ratios_pd_over_combined"] = {
        "long_ttft": p["long_ttft_ms_median"] / c["long_ttft_ms_median"],
        "itl_p50": p["itl_ms"]["p50"] / c["itl_ms"]["p50"],
        "itl_p99": p["itl_ms"]["p99"] / c["itl_ms"]["p99"],
        "itl_max": p["itl_ms"]["max"] / c["itl_ms"]["max"],
        "itl_p99_during_long_prefill": p["itl_during_long_prefill_ms"]["p99"] / c["itl_during_long_prefill_ms"]["p99"],
        "decode_tok_per_s": p["decode_tok_per_s"] / c["decode_tok_per_s"],
    }
    try:
        import torch

        dev = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu"
    except Exception:  # noqa: BLE001
        dev = "?"
    result["device"] = dev
    result["title"] = (f"{'tiny model (smoke)' if args.smoke else f'{args.shape} x {args.layers} layers'}, {dev}: "
                       f"{args.streams} decodes x {args.decode_len} tok + {args.long} prompts x {args.long_len} tok "
                       f"every {args.interval}s; PD over {args.backend}")
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, "pd_mixed" + ("_smoke" if args.smoke else f"_{args.shape}"))
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, stem + ".png")
    brief = {side: {k: v for k, v in result[side].items() if k not in ("points", "windows")}
             for side in ("combined", "pd")}
    print(json.dumps({"ratios_pd_over_combined": result["ratios_pd_over_combined"], **brief,
                      "greedy_equal": result["greedy_equal"], "first_token_equal": result["greedy_first_token_equal"],
                      "pd_transfer": result.get("pd_transfer")}, indent=1))


if __name__ == "__main__":
    main()
