"""IndexCache benchmark: prefill and decode time vs context length for index_topk_freq 1, 2, 4,
the share of time spent in the DSA indexer, and the KV memory saved.

Layers use DeepSeek-V3.2 / GLM-5 attention + indexer shapes with random (dummy) weights; the MoE
is replaced by a dense MLP of the same active FLOPs (9 x moe_intermediate: 8 routed + 1 shared),
and the vocabulary is the builtin tokenizer's (embedding / LM head do not matter here).

Method: every freq's engine stays loaded; each repeat measures all freqs in turn on the same
prompts, the order alternating (1, 2, 4 then 4, 2, 1), with no instrumentation; each reported time
is the median over repeats. The indexer's share comes from a separate pass with a synchronising
timer around Indexer.forward: its syncs stall a launch-bound decode loop (more calls at freq 1), so
they must not be in the timed pass.

    # GPU, real shapes
    python benchmark/indexcache/bench_indexcache.py --shape deepseek-v32 --device cuda --dtype bfloat16 \\
        --contexts 8192,16384,32768
    # CPU: real head / indexer dims, reduced width and index_topk so the indexer engages at small contexts
    python benchmark/indexcache/bench_indexcache.py --shape deepseek-v32 --cpu-small
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from tqdm import tqdm

from sglang.bench_plot import import_pyplot

SHAPES = {
    "deepseek-v32": dict(arch="deepseek_v32", hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
                         q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                         v_head_dim=128, index_n_heads=64, index_head_dim=128, index_topk=2048,
                         intermediate_size=9 * 2048),
    "glm-5": dict(arch="glm_moe_dsa", hidden_size=6144, num_attention_heads=64, num_key_value_heads=64,
                  q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                  index_n_heads=32, index_head_dim=128, index_topk=2048, intermediate_size=9 * 2048),
}
METHOD = ("times: an untimed warm-up pass per freq at each context (JIT compile, autotune), then the median "
          "of >= 3 interleaved repeats (freqs in turn, order alternating, same prompts), no indexer timer; "
          "indexer shares: a separate pass with a synchronising timer around Indexer.forward")
CPU_SMALL = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=16, intermediate_size=2048,
                 index_topk=512)
# --smoke (the unit test): the real head / indexer head dims, few heads and a small index_topk, so a
# context just past it still runs the sparse path; its numbers mean nothing
SMOKE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, intermediate_size=512, q_lora_rank=256,
             index_n_heads=8, index_topk=64)


def make_config_dir(shape: dict, layers: int, max_pos: int) -> str:
    from sglang.srt.model_loader.tiny_models import build_tokenizer, make_tiny_config

    d = tempfile.mkdtemp(prefix="sglang-ic-bench-")
    spec = dict(shape)
    arch = spec.pop("arch")
    cfg = make_tiny_config(arch, num_hidden_layers=layers, first_k_dense_replace=layers,
                           max_position_embeddings=max_pos, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 10000.0}, **spec)
    cfg.architectures = [{"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}[arch]]
    cfg.save_pretrained(d)
    build_tokenizer(d)
    return d


class IndexerTimer:
    """Wall time inside Indexer.forward, synchronising on CUDA so the time is the kernel time.

    Only for the indexer-share pass: its synchronize pairs (one per indexer call, so more at freq 1
    than at freq 4) stall a launch-bound decode loop, which inflated the freq-1 baseline of the
    first decode results. Speed ratios come from the untimed pass."""

    def __init__(self, device: str) -> None:
        from sglang.srt.layers.attention.nsa import nsa_indexer

        self.mod, self.device, self.total = nsa_indexer, device, 0.0
        self.orig = nsa_indexer.Indexer.forward
        timer = self

        def timed(this, *a, **k):
            timer.sync()
            t0 = time.perf_counter()
            out = timer.orig(this, *a, **k)
            timer.sync()
            timer.total += time.perf_counter() - t0
            return out

        nsa_indexer.Indexer.forward = timed

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def restore(self) -> None:
        self.mod.Indexer.forward = self.orig


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed_steps(engine, device: str, n_steps: int | None = None) -> tuple[float, list[float]]:
    """Run scheduler steps (all remaining, or n_steps); returns (seconds, per-step seconds). Each
    step is synchronised on its own so single steps can be summarised by a median."""
    sched = engine.scheduler
    _sync(device)
    per_step = []
    t0 = time.perf_counter()
    while sched.has_work() and (n_steps is None or len(per_step) < n_steps):
        ts = time.perf_counter()
        sched.step()
        _sync(device)
        per_step.append(time.perf_counter() - ts)
    return time.perf_counter() - t0, per_step


def make_engine(path: str, freq: int, offset: int, args):
    from sglang.srt.entrypoints.engine import Engine

    max_ctx = max(args.contexts)
    engine = Engine(model_path=path, load_format="dummy", dtype=args.dtype, device=args.device,
                    nsa_index_topk_freq=freq, nsa_index_topk_offset=offset, nsa_index_k_dtype=args.index_k_dtype,
                    disable_radix_cache=True, chunked_prefill_size=-1, max_prefill_tokens=max_ctx,
                    max_total_tokens=(max_ctx + args.decode_steps + 64) * args.decode_batch + 256, random_seed=0,
                    # steps are timed one by one (prefill vs decode, indexer share): no overlap
                    disable_overlap_schedule=True)
    _submit(engine, [1, 2, 3], 2)
    _timed_steps(engine, args.device)  # warm-up
    return engine


def _submit(engine, ids: list[int], new_tokens: int) -> None:
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.scheduler.add_request(TokenizedGenerateReqInput(f"r{time.monotonic_ns()}", ids, sp))


def run_pass(engine, prompts: list[list[int]], args, timer: IndexerTimer | None = None) -> dict:
    """One sample at one context: prompts[0] prefilled alone (one extend step), then the decode
    steps of the batch of all prompts at that context. With `timer`: the indexer's seconds too."""
    def indexer_s() -> float:
        return timer.total if timer is not None else 0.0

    _submit(engine, prompts[0], args.decode_steps + 1)
    i0 = indexer_s()
    prefill_s, _ = _timed_steps(engine, args.device, 1)
    pre_idx = indexer_s() - i0
    for ids in prompts[1:]:
        _submit(engine, ids, args.decode_steps + 1)
    _timed_steps(engine, args.device, len(prompts) - 1)  # their prefills (max_prefill_tokens = context)
    i0 = indexer_s()
    dec_s, steps = _timed_steps(engine, args.device, args.decode_steps)
    dec_idx = indexer_s() - i0
    _timed_steps(engine, args.device)  # drain
    # median step: decode steps are short and host-launch-bound, so a mean is noisy
    return {"prefill_s": prefill_s, "decode_step_s": statistics.median(steps), "decode_mean_step_s": dec_s / len(steps),
            "prefill_indexer_s": pre_idx, "decode_indexer_s": dec_idx}


def measure(engine, prompts: list[list[int]], args) -> dict:
    """The timed pass (no instrumentation): what the speed ratios are computed from."""
    out = run_pass(engine, prompts, args)
    return {k: out[k] for k in ("prefill_s", "decode_step_s", "decode_mean_step_s")}


def measure_indexer_share(engine, prompts: list[list[int]], args) -> dict:
    """The separate pass with the indexer timer: the indexer's share of prefill and decode."""
    timer = IndexerTimer(args.device)
    try:
        out = run_pass(engine, prompts, args, timer)
    finally:
        timer.restore()
    return {"prefill_indexer_share": out["prefill_indexer_s"] / out["prefill_s"],
            "decode_indexer_share": out["decode_indexer_s"] / (out["decode_mean_step_s"] * args.decode_steps)}


def bench(path: str, freqs: list[int], args) -> list[dict]:
    """All freqs side by side: every engine stays loaded and each repeat measures them in turn,
    alternating the order (1, 2, 4 then 4, 2, 1), on the same prompts; each point is the median."""
    engines = {f: make_engine(path, f, args.offset, args) for f in tqdm(freqs, desc="load")}
    g = torch.Generator().manual_seed(0)
    rows: dict[int, list[dict]] = {f: [] for f in freqs}
    for L in args.contexts:
        samples: dict[int, list[dict]] = {f: [] for f in freqs}
        warm = [torch.randint(5, 1000, (L,), generator=g).tolist() for _ in range(args.decode_batch)]
        for f in freqs:  # untimed: JIT compile / autotune at this context's shapes (a cold sample is 2-3x)
            run_pass(engines[f], warm, args)
        for r in tqdm(range(args.repeats), desc=f"context {L}"):
            prompts = [torch.randint(5, 1000, (L,), generator=g).tolist() for _ in range(args.decode_batch)]
            for f in (freqs if r % 2 == 0 else freqs[::-1]):
                samples[f].append(measure(engines[f], prompts, args))
        for f in freqs:
            row = {"context": L, **{k: statistics.median(s[k] for s in samples[f]) for k in samples[f][0]},
                   "samples": samples[f]}
            row.update(measure_indexer_share(engines[f], prompts, args))
            rows[f].append(row)
    runs = []
    for f, engine in engines.items():
        pool = engine.scheduler.tp_worker.model_runner.token_to_kv_pool
        sched = engine.model_config.index_layer_schedule
        runs.append({"freq": f, "offset": args.offset, "schedule": sched.describe(),
                     "full_layers": len(sched.full_layer_ids), "kv_bytes_per_token": pool.kv_bytes_per_token(),
                     "index_bytes_per_token": pool.index_bytes_per_token, "rows": rows[f]})
    return runs


def plot(result: dict, path: str) -> None:
    plt = import_pyplot(path)
    if plt is None:
        return None

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for run in result["runs"]:
        ctx = [r["context"] for r in run["rows"]]
        label = f"freq {run['freq']} ({run['schedule']})"
        axes[0].plot(ctx, [r["prefill_s"] for r in run["rows"]], marker="o", label=label)
        axes[1].plot(ctx, [r["decode_step_s"] * 1e3 for r in run["rows"]], marker="o", label=label)
        axes[2].plot(ctx, [r["prefill_indexer_share"] for r in run["rows"]], marker="o", label=f"{label} prefill")
        axes[2].plot(ctx, [r["decode_indexer_share"] for r in run["rows"]], marker="x", ls="--",
                     label=f"{label} decode")
    axes[0].set(title="prefill time (s)", xlabel="context", xscale="log")
    axes[1].set(title=f"decode step (ms), batch {result['decode_batch']}", xlabel="context", xscale="log")
    axes[2].set(title="share of time in the indexer", xlabel="context", xscale="log", ylim=(0, 1))
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"IndexCache, {result['shape']} shapes, {result['layers']} layers, {result['device']} "
                 f"{result['dtype']} (index_topk {result['index_topk']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="deepseek-v32")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--freqs", default="1,2,4")
    p.add_argument("--offset", type=int, default=2)
    p.add_argument("--contexts", default="1024,2048,4096")
    p.add_argument("--decode-batch", type=int, default=4)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved repeats per point (freqs measured in turn, order alternating); median")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--index-k-dtype", default="fp8_e4m3")
    p.add_argument("--cpu-small", action="store_true", help="reduced width + index_topk for CPU (see docstring)")
    p.add_argument("--smoke", action="store_true", help="tiny widths, index_topk 64: checks the script runs, not speed")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    if args.repeats < 3:
        p.error("--repeats must be >= 3: each point is a median (a mean of 2 hid a cold 4.25 s sample at 128K)")
    args.contexts = [int(x) for x in args.contexts.split(",")]
    shape = {**SHAPES[args.shape], **(CPU_SMALL if args.cpu_small else {}), **(SMOKE if args.smoke else {})}
    path = make_config_dir(shape, args.layers, max(args.contexts) + args.decode_steps + 128)
    runs = bench(path, [int(f) for f in args.freqs.split(",")], args)
    base = runs[0]
    for run in runs:
        run["kv_saved_vs_freq1"] = 1 - run["kv_bytes_per_token"] / base["kv_bytes_per_token"]
        for r, b in zip(run["rows"], base["rows"]):
            r["prefill_speedup_vs_freq1"] = b["prefill_s"] / r["prefill_s"]
            r["decode_speedup_vs_freq1"] = b["decode_step_s"] / r["decode_step_s"]
    result = {"shape": args.shape, "cpu_small": args.cpu_small, "smoke": args.smoke, "layers": args.layers, "device": args.device,
              "dtype": args.dtype, "index_k_dtype": args.index_k_dtype, "index_topk": shape["index_topk"],
              "decode_batch": args.decode_batch, "torch": torch.__version__, "shape_params": shape,
              "repeats": args.repeats, "method": METHOD, "runs": runs}
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"indexcache_{args.shape}_{args.device}{'_small' if args.cpu_small else ''}"
                        f"{'_smoke' if args.smoke else ''}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    plot(result, stem + ".png")
    for run in runs:
        print(f"freq {run['freq']} {run['schedule']}: KV {run['kv_bytes_per_token']} B/token "
              f"({100 * run['kv_saved_vs_freq1']:.1f}% saved)")
        for r in run["rows"]:
            print(f"  ctx {r['context']:>6}: prefill {r['prefill_s']:.3f}s (x{r['prefill_speedup_vs_freq1']:.2f}, "
                  f"indexer {100 * r['prefill_indexer_share']:.0f}%), decode {1e3 * r['decode_step_s']:.1f}ms "
                  f"(x{r['decode_speedup_vs_freq1']:.2f}, indexer {100 * r['decode_indexer_share']:.0f}%)")


if __name__ == "__main__":
    main()
