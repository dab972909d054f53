"""IndexCache benchmark: prefill and decode time vs context length for index_topk_freq 1, 2, 4,
the share of time spent in the DSA indexer, and the KV memory saved.

Layers use DeepSeek-V3.2 / GLM-5 attention + indexer shapes with random (dummy) weights; the MoE
is replaced by a dense MLP of the same active FLOPs (9 x moe_intermediate: 8 routed + 1 shared),
and the vocabulary is the builtin tokenizer's (embedding / LM head do not matter here).

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

SHAPES = {
    "deepseek-v32": dict(arch="deepseek_v32", hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
                         q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                         v_head_dim=128, index_n_heads=64, index_head_dim=128, index_topk=2048,
                         intermediate_size=9 * 2048),
    "glm-5": dict(arch="glm_moe_dsa", hidden_size=6144, num_attention_heads=64, num_key_value_heads=64,
                  q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                  index_n_heads=32, index_head_dim=128, index_topk=2048, intermediate_size=9 * 2048),
}
CPU_SMALL = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=16, intermediate_size=2048,
                 index_topk=512)


def make_config_dir(shape: dict, layers: int, max_pos: int) -> str:
    from sglang.srt.testing.tiny_models import build_tokenizer, make_tiny_config

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
    """Wall time inside Indexer.forward (synchronising on CUDA so the time is the kernel time)."""

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


def _timed_steps(engine, timer, n_steps: int | None = None) -> tuple[float, float, list[float]]:
    """Run scheduler steps (all remaining, or n_steps); returns (seconds, indexer seconds, per-step
    seconds). Each step is synchronised on its own so single steps can be summarised by a median."""
    sched = engine.scheduler
    timer.sync()
    timer.total, per_step = 0.0, []
    t0 = time.perf_counter()
    while sched.has_work() and (n_steps is None or len(per_step) < n_steps):
        ts = time.perf_counter()
        sched.step()
        timer.sync()
        per_step.append(time.perf_counter() - ts)
    return time.perf_counter() - t0, timer.total, per_step


def bench_one(path: str, freq: int, offset: int, args) -> dict:
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    max_ctx = max(args.contexts)
    engine = Engine(model_path=path, load_format="dummy", dtype=args.dtype, device=args.device,
                    nsa_index_topk_freq=freq, nsa_index_topk_offset=offset, nsa_index_k_dtype=args.index_k_dtype,
                    disable_radix_cache=True, chunked_prefill_size=-1, max_prefill_tokens=max_ctx,
                    max_total_tokens=(max_ctx + args.decode_steps + 64) * args.decode_batch + 256, random_seed=0)
    pool = engine.scheduler.model_runner.token_to_kv_pool
    sched = engine.model_config.index_layer_schedule
    timer = IndexerTimer(args.device)
    g = torch.Generator().manual_seed(0)
    rows = []

    def submit(ids: list[int], new_tokens: int) -> None:
        sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        engine.scheduler.add_request(TokenizedGenerateReqInput(f"r{time.monotonic_ns()}", ids, sp))

    try:
        submit([1, 2, 3], 2)
        _timed_steps(engine, timer)  # warm-up
        for L in args.contexts:
            best = None
            for _ in range(args.repeats):
                # prefill: one request of L tokens, alone (one extend step)
                submit(torch.randint(5, 1000, (L,), generator=g).tolist(), 1)
                pre, pre_idx, _ = _timed_steps(engine, timer)
                # decode: a batch of requests at context ~L; prefill them first, then time decode steps
                for _ in range(args.decode_batch):
                    submit(torch.randint(5, 1000, (L,), generator=g).tolist(), args.decode_steps + 1)
                _timed_steps(engine, timer, args.decode_batch)  # the prefills (max_prefill_tokens = L)
                dec, dec_idx, steps = _timed_steps(engine, timer, args.decode_steps)
                _timed_steps(engine, timer)  # drain
                # median step: decode steps are short and host-launch-bound, so a mean is noisy
                row = {"context": L, "prefill_s": pre, "prefill_indexer_share": pre_idx / pre,
                       "decode_step_s": statistics.median(steps), "decode_mean_step_s": dec / len(steps),
                       "decode_indexer_share": dec_idx / dec}
                if best is None or row["prefill_s"] + row["decode_step_s"] < best["prefill_s"] + best["decode_step_s"]:
                    best = row
            rows.append(best)
    finally:
        timer.restore()
    return {"freq": freq, "offset": offset, "schedule": sched.describe(), "full_layers": len(sched.full_layer_ids),
            "kv_bytes_per_token": pool.kv_bytes_per_token(), "index_bytes_per_token": pool.index_bytes_per_token,
            "rows": rows}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    p.add_argument("--repeats", type=int, default=2, help="best of N per point (machine noise)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--index-k-dtype", default="fp8_e4m3")
    p.add_argument("--cpu-small", action="store_true", help="reduced width + index_topk for CPU (see docstring)")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",")]
    shape = {**SHAPES[args.shape], **(CPU_SMALL if args.cpu_small else {})}
    path = make_config_dir(shape, args.layers, max(args.contexts) + args.decode_steps + 128)
    runs = [bench_one(path, int(f), args.offset, args) for f in tqdm(args.freqs.split(","), desc="freq")]
    base = runs[0]
    for run in runs:
        run["kv_saved_vs_freq1"] = 1 - run["kv_bytes_per_token"] / base["kv_bytes_per_token"]
        for r, b in zip(run["rows"], base["rows"]):
            r["prefill_speedup_vs_freq1"] = b["prefill_s"] / r["prefill_s"]
            r["decode_speedup_vs_freq1"] = b["decode_step_s"] / r["decode_step_s"]
    result = {"shape": args.shape, "cpu_small": args.cpu_small, "layers": args.layers, "device": args.device,
              "dtype": args.dtype, "index_k_dtype": args.index_k_dtype, "index_topk": shape["index_topk"],
              "decode_batch": args.decode_batch, "torch": torch.__version__, "shape_params": shape, "runs": runs}
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"indexcache_{args.shape}_{args.device}{'_small' if args.cpu_small else ''}")
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
