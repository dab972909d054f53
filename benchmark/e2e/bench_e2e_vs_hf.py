"""End to end on one GPU: our engine vs transformers, on real DeepSeek-V3.2 (or GLM-5) layer shapes
with random weights. The headline baseline is transformers with its default attention
(`hf`, sdpa); `hf_eager` (attn_implementation="eager") is reported beside it.

The config is transformers' own (`DeepseekV32Config()` / `GlmMoeDsaConfig()`, i.e. the real model
sizes) with N layers, the first dense and the rest MoE (256 experts, 8 active). Each side runs in
its own process, one after the other, so both fit. Metrics, as transformers' own `generate` counts
them: generate throughput (batch x new tokens / wall time incl. prefill; prompt 256 tokens, greedy),
the marginal decode step ((time for 64 new tokens - time for 32) / 32), our engine's median decode
step, and single-prompt prefill throughput. Medians of --repeats. JSON + a plot + a table.
Our engine runs with the overlap scheduler (default), with --disable-overlap-schedule ("ours_sync",
so the overlap ratio is measured side by side in the same run) and, as side "ours_fp8kv", with
--kv-cache-dtype fp8_e4m3. The median decode
step is the wall time of one scheduler iteration with no device sync between iterations (a sync
would serialise the overlap it measures).

    python benchmark/e2e/bench_e2e_vs_hf.py --shape deepseek-v32 --layers 3 --out-dir /tmp/out
    python benchmark/e2e/bench_e2e_vs_hf.py --smoke          # tiny shapes on CPU: exercises the script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

CONFIG_CLASSES = {"deepseek-v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
                  "glm-5": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM")}
SMOKE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
             q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
             n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, index_n_heads=16,
             index_head_dim=64, index_topk=32, vocab_size=1024, max_position_embeddings=4096)


def make_config_dir(shape: str, layers: int, smoke: bool, **overrides) -> str:
    """A checkpoint folder without weights (config + tokenizer) for --load-format dummy."""
    import transformers

    from sglang.srt.model_loader.tiny_models import build_tokenizer

    cfg_name, arch = CONFIG_CLASSES[shape]
    cfg = getattr(transformers, cfg_name)(num_hidden_layers=layers, first_k_dense_replace=1,
                                          **{**(SMOKE if smoke else {}), **overrides})
    cfg.architectures = [arch]
    d = tempfile.mkdtemp(prefix=f"sglang-e2e-{shape}-")
    cfg.save_pretrained(d)
    build_tokenizer(d)
    return d


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def run_ours(args, path: str, overlap: bool = True, kv_cache_dtype: str = "auto") -> dict:
    from sglang.srt.entrypoints.engine import Engine

    max_bs = max(args.batch_sizes)
    ctx = max(args.prefill_lens + [args.prompt_len + max(args.gen_lens)]) + 64
    engine = Engine(model_path=path, tokenizer_path=path, load_format="dummy", dtype=args.dtype, device=args.device,
                    context_length=ctx, max_running_requests=max_bs, cuda_graph_max_bs=max_bs,
                    disable_radix_cache=True, chunked_prefill_size=-1, max_prefill_tokens=max(ctx, 16384),
                    random_seed=0, disable_overlap_schedule=not overlap,
                    **({} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)

    def gen(bs: int, new: int) -> float:
        prompts = torch.randint(5, vocab, (bs, args.prompt_len), generator=g).tolist()
        sp = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
        _sync(args.device)
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=sp)
        _sync(args.device)
        return time.perf_counter() - t0

    def median_step(bs: int) -> float:
        sched = engine.scheduler
        prompts = torch.randint(5, vocab, (bs, args.prompt_len), generator=g).tolist()
        for p in prompts:
            engine._submit(None, p, {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}, False, -1, 0)
        while sched.waiting_queue or not sched.running:
            sched.step()
        _sync(args.device)
        steps = []
        while sched.has_work():
            t0 = time.perf_counter()
            sched.step()
            steps.append(time.perf_counter() - t0)
        _sync(args.device)
        return _median(steps[2:-2] or steps)

    def prefill(n: int) -> float:
        ids = torch.randint(5, vocab, (n,), generator=g).tolist()
        _sync(args.device)
        t0 = time.perf_counter()
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
        _sync(args.device)
        return time.perf_counter() - t0

    return _measure(args, gen, median_step, prefill)


def run_hf(args, path: str, attn_implementation: str | None = None) -> dict:
    """`attn_implementation` None: transformers' default (sdpa where available)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, **kw).eval()
    vocab = cfg.vocab_size
    g = torch.Generator().manual_seed(0)

    @torch.no_grad()
    def gen(bs: int, new: int) -> float:
        x = torch.randint(5, vocab, (bs, args.prompt_len), generator=g).to(args.device)
        _sync(args.device)
        t0 = time.perf_counter()
        model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new,
                       min_new_tokens=new, pad_token_id=1)
        _sync(args.device)
        return time.perf_counter() - t0

    @torch.no_grad()
    def prefill(n: int) -> float | None:
        x = torch.randint(5, vocab, (1, n), generator=g).to(args.device)
        try:
            _sync(args.device)
            t0 = time.perf_counter()
            model(x, logits_to_keep=1)
            _sync(args.device)
            return time.perf_counter() - t0
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return None

    return _measure(args, gen, None, prefill)


def _measure(args, gen, median_step, prefill) -> dict:
    out: dict = {"generate": {}, "prefill": {}}
    gen(1, 2)  # warm-up: compile / capture / allocator
    for bs in args.batch_sizes:
        gen(bs, 2)
        t = {n: _median([gen(bs, n) for _ in range(args.repeats)]) for n in args.gen_lens}
        lo, hi = min(args.gen_lens), max(args.gen_lens)
        row = {"tok_s": bs * lo / t[lo], "seconds": t, "marginal_step_ms": 1e3 * (t[hi] - t[lo]) / (hi - lo)}
        if median_step is not None:
            row["median_step_ms"] = 1e3 * median_step(bs)
        out["generate"][bs] = row
        print(f"  bs {bs}: {row}", file=sys.stderr, flush=True)
    for n in args.prefill_lens:
        first = prefill(n)
        if first is None:
            out["prefill"][n] = None
            continue
        times = [prefill(n) for _ in range(args.repeats)]
        out["prefill"][n] = {"tok_s": n / _median(times), "seconds": _median(times)}
        print(f"  prefill {n}: {out['prefill'][n]}", file=sys.stderr, flush=True)
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    bss = sorted(int(b) for b in result["ours"]["generate"])
    for side, color in (("ours", "#2b7bba"), ("ours_sync", "#8fbce6"), ("hf", "#999999")):
        if side not in result:
            continue
        axes[0].plot(bss, [result[side]["generate"][str(b) if str(b) in result[side]["generate"] else b]["tok_s"]
                           for b in bss], "o-", color=color, label=side)
    axes[0].set_xscale("log", base=2)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("batch size")
    axes[0].set_ylabel("generate tok/s")
    axes[0].legend()
    lens = sorted(int(n) for n in result["ours"]["prefill"])
    for side, color in (("ours", "#2b7bba"), ("hf", "#999999")):
        ys = [(result[side]["prefill"].get(str(n)) or result[side]["prefill"].get(n) or {}).get("tok_s") for n in lens]
        axes[1].plot([n for n, y in zip(lens, ys) if y], [y for y in ys if y], "o-", color=color, label=side)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("prompt tokens")
    axes[1].set_ylabel("prefill tok/s")
    axes[1].legend()
    fig.suptitle(f"{result['shape']} x {result['layers']} layers, {result['device_name']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="deepseek-v32", choices=sorted(CONFIG_CLASSES))
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-lens", default="32,64")
    p.add_argument("--prefill-lens", default="1024,4096,32768,131072")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--sides", default="ours,ours_sync,hf,hf_eager",
                   help="of ours, ours_sync, ours_fp8kv, hf (default attention), hf_eager")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (checks the script, not speed)")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--side", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.device, args.dtype = "cpu", "float32"
        args.batch_sizes, args.gen_lens, args.prefill_lens = "1,2", "2,4", "64"
        args.prompt_len, args.repeats = 16, 1
    args.batch_sizes = [int(x) for x in str(args.batch_sizes).split(",")]
    args.gen_lens = [int(x) for x in str(args.gen_lens).split(",")]
    args.prefill_lens = [int(x) for x in str(args.prefill_lens).split(",")]
    if args.side:  # child: one side, JSON on stdout
        if args.side in ("hf", "hf_eager"):
            res = run_hf(args, args.path, "eager" if args.side == "hf_eager" else None)
        else:
            res = run_ours(args, args.path, args.side != "ours_sync",
                           "fp8_e4m3" if args.side == "ours_fp8kv" else "auto")
        print("RESULT " + json.dumps(res))
        return
    path = make_config_dir(args.shape, args.layers, args.smoke)
    result = {"shape": args.shape, "layers": args.layers, "prompt_len": args.prompt_len, "dtype": args.dtype,
              "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "date": time.strftime("%Y-%m-%d")}
    argv = [a for a in sys.argv[1:] if a != "--smoke"] + (["--smoke"] if args.smoke else [])
    for side in args.sides.split(","):
        proc = subprocess.run([sys.executable, __file__, *argv, "--side", side, "--path", path],
                              capture_output=True, text=True)
        sys.stderr.write(proc.stderr[-4000:])
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            raise SystemExit(f"{side} side failed ({proc.returncode})")
        result[side] = json.loads(line[len("RESULT "):])
    ratios = {}
    if "hf" in result and "ours" in result:
        for bs, row in result["ours"]["generate"].items():
            hf = result["hf"]["generate"][bs]
            ratios[f"generate_bs{bs}"] = row["tok_s"] / hf["tok_s"]
            ratios[f"marginal_step_bs{bs}"] = hf["marginal_step_ms"] / row["marginal_step_ms"]
        for n, row in result["ours"]["prefill"].items():
            hf = result["hf"]["prefill"].get(n)
            if row and hf:
                ratios[f"prefill_{n}"] = row["tok_s"] / hf["tok_s"]
    for base in ("hf_eager",):  # the second baseline column
        if base in result and "ours" in result:
            for bs, row in result["ours"]["generate"].items():
                ratios[f"generate_bs{bs}_vs_{base}"] = row["tok_s"] / result[base]["generate"][bs]["tok_s"]
            for n, row in result["ours"]["prefill"].items():
                other = result[base]["prefill"].get(n)
                if row and other:
                    ratios[f"prefill_{n}_vs_{base}"] = row["tok_s"] / other["tok_s"]
    if "ours_fp8kv" in result and "ours" in result:
        for bs, row in result["ours_fp8kv"]["generate"].items():
            ratios[f"fp8kv_generate_bs{bs}"] = row["tok_s"] / result["ours"]["generate"][bs]["tok_s"]
    if "ours_sync" in result and "ours" in result:
        for bs, row in result["ours"]["generate"].items():
            sync = result["ours_sync"]["generate"][bs]
            ratios[f"overlap_generate_bs{bs}"] = row["tok_s"] / sync["tok_s"]
            ratios[f"overlap_step_bs{bs}"] = sync["median_step_ms"] / row["median_step_ms"]
    result["ratios"] = ratios
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"e2e_{args.shape}_{args.layers}l" + ("_smoke" if args.smoke else ""))
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    if "hf" in result:
        plot(result, stem + ".png")
    nan = float("nan")
    print(f"{'metric':28s} {'ours':>12s} {'transformers':>14s} {'ratio':>7s} {'hf eager':>10s} {'ratio':>7s}")
    for bs, row in result["ours"]["generate"].items():
        hf = result.get("hf", {}).get("generate", {}).get(bs, {})
        eg = result.get("hf_eager", {}).get("generate", {}).get(bs, {})
        print(f"{'generate bs ' + str(bs) + ' tok/s':28s} {row['tok_s']:12.1f} {hf.get('tok_s', nan):14.1f} "
              f"{ratios.get(f'generate_bs{bs}', nan):7.2f} {eg.get('tok_s', nan):10.1f} "
              f"{ratios.get(f'generate_bs{bs}_vs_hf_eager', nan):7.2f}")
        print(f"{'  marginal step ms':28s} {row['marginal_step_ms']:12.2f} {hf.get('marginal_step_ms', float('nan')):14.2f}"
              f"   median step {row.get('median_step_ms', float('nan')):.2f} ms")
        if "ours_sync" in result:
            sync = result["ours_sync"]["generate"][bs]
            print(f"{'  overlap off: median step':28s} {sync['median_step_ms']:12.2f} ms, {sync['tok_s']:.1f} tok/s"
                  f"   overlap speedup {ratios[f'overlap_step_bs{bs}']:.2f}x step, "
                  f"{ratios[f'overlap_generate_bs{bs}']:.2f}x generate")
    for n, row in result["ours"]["prefill"].items():
        hf = (result.get("hf", {}).get("prefill", {}) or {}).get(n) or {}
        eg = (result.get("hf_eager", {}).get("prefill", {}) or {}).get(n) or {}
        print(f"{'prefill ' + str(n) + ' tok/s':28s} {(row or {}).get('tok_s', nan):12.0f} {hf.get('tok_s', nan):14.0f} "
              f"{ratios.get(f'prefill_{n}', nan):7.2f} {eg.get('tok_s', nan):10.0f} "
              f"{ratios.get(f'prefill_{n}_vs_hf_eager', nan):7.2f}")


if __name__ == "__main__":
    main()
