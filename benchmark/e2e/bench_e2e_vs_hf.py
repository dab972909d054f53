"""End to end on one GPU: our engine vs transformers, on real DeepSeek-V3.2 (or GLM-5) layer shapes
with random weights. The headline baseline is transformers with its default attention
(`hf`, sdpa); `hf_eager` (attn_implementation="eager") is reported beside it.

The config is transformers' own (`DeepseekV32Config()` / `GlmMoeDsaConfig()`, i.e. the real model
sizes) with --layers N, the first dense and the rest MoE (--experts routed experts, default the
real 256, 8 active; fewer experts keep the attention shapes real on a card that cannot hold 256).
Each side runs in its own process, one after the other, so both fit. transformers' MoE experts run
its --hf-experts-implementation (its own names: eager, grouped_mm, batched_mm, ...; default its
own choice); the JSON records what it resolved to. Our engine runs with the server's default
chunked prefill (--chunked-prefill-size 8192), so a 32K or 128K prompt is several steps and the
memory plan (model_executor/memory_plan.py, recorded in the JSON with the peak memory) reserves
one step's activations. Metrics, as transformers' own `generate` counts
them: generate throughput (batch x new tokens / wall time incl. prefill; prompt 256 tokens, greedy),
the marginal decode step ((time for 64 new tokens - time for 32) / 32), our engine's median decode
step, and single-prompt prefill throughput. Medians of --repeats. JSON + a plot + a table.
Our engine runs with the overlap scheduler (default), with --disable-overlap-schedule ("ours_sync",
so the overlap ratio is measured side by side in the same run) and, as side "ours_fp8kv", with
--kv-cache-dtype fp8_e4m3, and as "ours_fp8w" with FP8 block weights (--quantization fp8: the bf16
dummy weights quantised at load). The median decode
step is the wall time of one scheduler iteration with no device sync between iterations (a sync
would serialise the overlap it measures).

    python benchmark/e2e/bench_e2e_vs_hf.py --shape deepseek-v32 --layers 3 --out-dir /tmp/out
    python benchmark/e2e/bench_e2e_vs_hf.py --layers 2 --experts 16 --hf-experts-implementation grouped_mm
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

from sglang.bench_plot import import_pyplot

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


def run_ours(args, path: str, overlap: bool = True, kv_cache_dtype: str = "auto", quantization: str | None = None) -> dict:
    from sglang.srt.entrypoints.engine import Engine

    max_bs = max(args.batch_sizes)
    ctx = max(args.prefill_lens + [args.prompt_len + max(args.gen_lens)]) + 64
    engine = Engine(model_path=path, tokenizer_path=path, load_format="dummy", dtype=args.dtype, device=args.device,
                    context_length=ctx, max_running_requests=max_bs, cuda_graph_max_bs=max_bs,
                    disable_radix_cache=True, random_seed=0, disable_overlap_schedule=not overlap,
                    **({} if args.chunked_prefill_size is None else {"chunked_prefill_size": args.chunked_prefill_size}),
                    **({} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}),
                    **({} if quantization is None else {"quantization": quantization}))
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

    out = _measure(args, gen, median_step, prefill)
    out["memory"] = _memory(args.device, engine)
    return out


def _memory(device: str, engine=None) -> dict:
    """The memory plan the engine started with and the peak the run reached (GPU only)."""
    if device != "cuda":
        return {}
    out = {"peak_allocated_bytes": torch.cuda.max_memory_allocated(), "peak_reserved_bytes":
           torch.cuda.max_memory_reserved(), "total_bytes": torch.cuda.mem_get_info()[1]}
    worker = getattr(engine.scheduler, "tp_worker", None) if engine is not None else None
    runner = getattr(getattr(worker, "target", worker), "model_runner", None)
    plan = getattr(runner, "memory_plan", None)
    if plan is not None:
        out["plan"] = plan.as_dict()
    return out


def run_hf(args, path: str, attn_implementation: str | None = None) -> dict:
    """`attn_implementation` None: transformers' default (sdpa where available); the experts
    implementation is --hf-experts-implementation (None: transformers' default)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
        if args.hf_experts_implementation is not None:
            kw["experts_implementation"] = args.hf_experts_implementation
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, **kw).eval()
    impl = {"attn_implementation": model.config._attn_implementation,
            "experts_implementation": getattr(model.config, "_experts_implementation", None)}
    print(f"  transformers: {impl}", file=sys.stderr, flush=True)
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

    out = _measure(args, gen, None, prefill)
    out.update(implementation=impl, memory=_memory(args.device))
    return out


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


def _ran(result: dict, side: str) -> bool:
    """The side ran to the end (a failed baseline holds only its error)."""
    return "generate" in result.get(side, {})


def plot(result: dict, path: str) -> None:
    plt = import_pyplot(path)
    if plt is None:
        return None

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    bss = sorted(int(b) for b in result["ours"]["generate"])
    for side, color in (("ours", "#2b7bba"), ("ours_sync", "#8fbce6"), ("hf", "#999999")):
        if not _ran(result, side):
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
        if not _ran(result, side):
            continue
        ys = [(result[side]["prefill"].get(str(n)) or result[side]["prefill"].get(n) or {}).get("tok_s") for n in lens]
        axes[1].plot([n for n, y in zip(lens, ys) if y], [y for y in ys if y], "o-", color=color, label=side)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("prompt tokens")
    axes[1].set_ylabel("prefill tok/s")
    axes[1].legend()
    fig.suptitle(f"{result['shape']} x {result['layers']} layers, {result['device_name']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def hf_experts_implementations() -> list[str]:
    """transformers' names for its MoE experts implementations ("eager" + its ExpertsInterface)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:  # transformers 4.x: eager only
        return ["eager"]
    return ["eager", *sorted(ALL_EXPERTS_FUNCTIONS.keys())]


def moe_overrides(shape: str, experts: int, smoke: bool) -> dict:
    """n_routed_experts = `experts`, checked against the config's group-limited routing (top-k
    from topk_group of n_group groups), so a bad --experts fails here and not inside a model."""
    import transformers

    cfg = getattr(transformers, CONFIG_CLASSES[shape][0])(**(SMOKE if smoke else {}))
    groups, top_groups, top_k = cfg.n_group or 1, cfg.topk_group or 1, cfg.num_experts_per_tok
    if experts <= 0 or experts % groups or experts // groups * top_groups < top_k:
        raise SystemExit(f"--experts {experts}: must be a positive multiple of n_group {groups} with "
                         f"{experts}/{groups} x topk_group {top_groups} >= num_experts_per_tok {top_k} "
                         f"(e.g. --experts {max(groups, -(-top_k // top_groups) * groups)})")
    return {"n_routed_experts": experts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="deepseek-v32", choices=sorted(CONFIG_CLASSES))
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--experts", type=int, default=None,
                   help="routed experts per MoE layer (n_routed_experts; default the config's, 256 for V3.2)")
    p.add_argument("--hf-experts-implementation", default=None, choices=hf_experts_implementations(),
                   help="transformers' MoE experts implementation (default: transformers' choice)")
    p.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="our engine's prefill step (default: the server's, 8192; -1: whole prompts)")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-lens", default="32,64")
    p.add_argument("--prefill-lens", default="1024,4096,32768,131072")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--sides", default="ours,ours_sync,hf,hf_eager",
                   help="of ours, ours_sync, ours_fp8kv, ours_fp8w, ours_sparse (short prefills through the "
                        "sparse path: SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD=0), hf (default attention), "
                        "hf_eager")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (checks the script, not speed)")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--side", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.device, args.dtype = "cpu", "float32"
        args.batch_sizes, args.gen_lens, args.prefill_lens = "1,2", "2,4", "64"
        args.prompt_len, args.repeats = 16, 1
        if args.chunked_prefill_size is None:
            args.chunked_prefill_size = 32  # the 64-token prefill runs as 2 chunks
    args.batch_sizes = [int(x) for x in str(args.batch_sizes).split(",")]
    args.gen_lens = [int(x) for x in str(args.gen_lens).split(",")]
    if len(set(args.gen_lens)) < 2:  # the marginal decode step is the difference of two lengths
        p.error(f"--gen-lens {','.join(map(str, args.gen_lens))}: give two different lengths, e.g. 32,64")
    args.prefill_lens = [int(x) for x in str(args.prefill_lens).split(",")]
    if args.side:  # child: one side, JSON on stdout
        if args.side in ("hf", "hf_eager"):
            res = run_hf(args, args.path, "eager" if args.side == "hf_eager" else None)
        else:
            if args.side == "ours_sparse":  # read when the attention backend is built
                from sglang.srt.layers.attention.nsa.utils import DENSE_PREFILL_ENV

                os.environ[DENSE_PREFILL_ENV[0]] = "0"
            res = run_ours(args, args.path, args.side != "ours_sync",
                           "fp8_e4m3" if args.side == "ours_fp8kv" else "auto",
                           "fp8" if args.side == "ours_fp8w" else None)
        print("RESULT " + json.dumps(res))
        return
    overrides = {} if args.experts is None else moe_overrides(args.shape, args.experts, args.smoke)
    path = make_config_dir(args.shape, args.layers, args.smoke, **overrides)
    result = {"shape": args.shape, "layers": args.layers, "prompt_len": args.prompt_len, "dtype": args.dtype,
              "config_overrides": overrides, "chunked_prefill_size": args.chunked_prefill_size,
              "hf_experts_implementation_requested": args.hf_experts_implementation,
              "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "date": time.strftime("%Y-%m-%d")}
    argv = [a for a in sys.argv[1:] if a != "--smoke"] + (["--smoke"] if args.smoke else [])
    for side in args.sides.split(","):
        proc = subprocess.run([sys.executable, __file__, *argv, "--side", side, "--path", path],
                              capture_output=True, text=True)
        sys.stderr.write(proc.stderr[-4000:])
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            if not side.startswith("hf"):
                raise SystemExit(f"{side} side failed ({proc.returncode})")
            # a baseline that cannot run here (e.g. transformers' experts OOM) is recorded, not fatal
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            result[side] = {"error": f"exit {proc.returncode}: {tail[-500:]}"}
            continue
        result[side] = json.loads(line[len("RESULT "):])
    ratios = {}
    if _ran(result, "hf") and _ran(result, "ours"):
        for bs, row in result["ours"]["generate"].items():
            hf = result["hf"]["generate"][bs]
            ratios[f"generate_bs{bs}"] = row["tok_s"] / hf["tok_s"]
            ratios[f"marginal_step_bs{bs}"] = hf["marginal_step_ms"] / row["marginal_step_ms"]
        for n, row in result["ours"]["prefill"].items():
            hf = result["hf"]["prefill"].get(n)
            if row and hf:
                ratios[f"prefill_{n}"] = row["tok_s"] / hf["tok_s"]
    for base in ("hf_eager",):  # the second baseline column
        if _ran(result, base) and _ran(result, "ours"):
            for bs, row in result["ours"]["generate"].items():
                ratios[f"generate_bs{bs}_vs_{base}"] = row["tok_s"] / result[base]["generate"][bs]["tok_s"]
            for n, row in result["ours"]["prefill"].items():
                other = result[base]["prefill"].get(n)
                if row and other:
                    ratios[f"prefill_{n}_vs_{base}"] = row["tok_s"] / other["tok_s"]
    if "ours_fp8kv" in result and "ours" in result:
        for bs, row in result["ours_fp8kv"]["generate"].items():
            ratios[f"fp8kv_generate_bs{bs}"] = row["tok_s"] / result["ours"]["generate"][bs]["tok_s"]
    if "ours_fp8w" in result and "ours" in result:  # FP8 block weights (--quantization fp8) vs bf16
        for bs, row in result["ours_fp8w"]["generate"].items():
            ratios[f"fp8w_generate_bs{bs}"] = row["tok_s"] / result["ours"]["generate"][bs]["tok_s"]
        for n, row in result["ours_fp8w"]["prefill"].items():
            ratios[f"fp8w_prefill_{n}"] = row["tok_s"] / result["ours"]["prefill"][n]["tok_s"]
    if "ours_sparse" in result and "ours" in result:  # dense MHA for short prefills vs the sparse path
        for n, row in result["ours"]["prefill"].items():
            other = result["ours_sparse"]["prefill"].get(n)
            if row and other:
                ratios[f"dense_prefill_{n}"] = row["tok_s"] / other["tok_s"]
    if "ours_sync" in result and "ours" in result:
        for bs, row in result["ours"]["generate"].items():
            sync = result["ours_sync"]["generate"][bs]
            ratios[f"overlap_generate_bs{bs}"] = row["tok_s"] / sync["tok_s"]
            ratios[f"overlap_step_bs{bs}"] = sync["median_step_ms"] / row["median_step_ms"]
    result["ratios"] = ratios
    os.makedirs(args.out_dir, exist_ok=True)
    experts = f"_{args.experts}e" if args.experts is not None else ""
    stem = os.path.join(args.out_dir, f"e2e_{args.shape}_{args.layers}l{experts}" + ("_smoke" if args.smoke else ""))
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    if _ran(result, "hf"):
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
