"""Speculative decoding (EAGLE / NEXTN on the MTP layer) vs plain decoding, in one run.

Random weights accept (almost) nothing, so both ends are measured with the draft forced:
- `wrong`: every draft rejected -- the cost of a step that drafts and verifies for nothing
  (issue 19's goal: at most 20% slower than plain);
- `right`: the draft proposes the target's own tokens (taken from the plain run) -- every draft
  accepted, `num_steps + 1` tokens per verify (goal on the H200: >= 2.5x plain at batch 1,
  >= 1.8x at batch 16);
- `natural`: the draft as it is (random weights: reported, not a goal).
Two throughputs, each engine against itself: `tok_s` = batch x new tokens / wall time of generate
(prefill included), and `decode_tok_s` = batch x (new tokens - 1) / (that wall time - the wall time
of the same prompts with max_new_tokens=1, timed in the same repeat): the decode rate, which is what
speculative decoding changes (the prefill is the same work, plus the draft's extend). `speedup` and
`decode_speedup` are the ratios to plain's. Plain and each speculative mode alternate per repeat;
medians. JSON + a plot + a table.

    python benchmark/speculative/bench_speculative.py                      # CPU, builtin MTP model
    python benchmark/speculative/bench_speculative.py --device cuda --model-path DIR_WITH_MTP --load-format dummy
    python benchmark/speculative/bench_speculative.py --smoke             # seconds: checks the script
    python benchmark/speculative/bench_speculative.py --device cuda --layers 16 --experts 16 --hot-vocab 32768
        # real shapes on an H200 (two engines of ~38 GiB of weights each); on an 80 GB card add
        # --shared-target --max-total-tokens 8192 (one engine: plain decoding on its own target worker)

`--layers N --experts E` builds transformers' DeepSeek-V3.2 config with N target layers of the real
attention shapes, E routed experts and one MTP layer (dummy weights): V3.2 itself has 61 target
layers against one MTP layer, so a 3-layer model overstates the draft's share. A decode step at
batch 1 reads 8 experts whatever their count, so fewer experts keep the per-layer cost and fit the
card. The measured draft-step / target-step time ratio (CUDA events around each forward) is printed.

Every speculative output is checked against plain decoding in the same run: equal under
`--deterministic` (both engines --enable-deterministic-inference), else within the bound of
sglang.srt.testing.spec_drafts (the run's own batch-shape noise x 4; first divergence only at a
near-tie of plain's top-2), on a separate run with logprobs (the timed runs return none).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from sglang.bench_plot import import_pyplot

MODES = ("natural", "wrong", "right")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(engine, prompts, sp, device: str) -> tuple[float, list]:
    _sync(device)
    t0 = time.perf_counter()
    out = engine.generate(input_ids=prompts, sampling_params=sp)
    _sync(device)
    return time.perf_counter() - t0, out


class ForwardTimer:
    """CUDA events around each decode-mode ModelRunner.forward of one runner (draft decode steps,
    target verifies), read after a sync; wall clock on CPU."""

    def __init__(self, runner, device: str) -> None:
        self.runner, self.device, self.calls = runner, device, []
        self._orig = runner.forward

        def forward(fb):
            if not fb.forward_mode.is_decode():
                return self._orig(fb)
            if device == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = self._orig(fb)
                b.record()
                self.calls.append((a, b))
                return out
            t0 = time.perf_counter()
            out = self._orig(fb)
            self.calls.append(1e3 * (time.perf_counter() - t0))
            return out

        runner.forward = forward

    def median_ms(self) -> float | None:
        _sync(self.device)
        ms = [c if isinstance(c, float) else c[0].elapsed_time(c[1]) for c in self.calls]
        return statistics.median(ms) if ms else None

    def close(self) -> None:
        self.runner.forward = self._orig


class TargetAsPlain:
    """`--shared-target`: the plain side is the speculative engine's own target worker, swapped in as
    the scheduler's worker for each plain call (the scheduler asks its worker for the rows per
    request), so the target's weights are loaded once and 16 layers x 16 experts fit an 80 GB card.
    The target captures only verify graphs in a speculative engine: its runner re-captures with the
    plain decode spec added, so the plain side replays graphs as a plain engine does."""

    def __init__(self, spec) -> None:
        import gc

        from sglang.srt.model_executor.cuda_graph_runner import DECODE_SPEC, CudaGraphRunner

        self.spec, self.sched = spec, spec.scheduler
        self.spec_worker = self.sched.tp_worker
        self.target = self.spec_worker.target
        self.model_config = spec.model_config
        mr = self.target.model_runner
        if mr.cuda_graph_runner is not None:
            old = mr.cuda_graph_runner
            specs, backend = (*old.specs, DECODE_SPEC), old.graph_backend
            mr.cuda_graph_runner = old = None  # its graphs go before the new capture takes memory
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            mr.cuda_graph_runner = CudaGraphRunner(mr, backend, specs=specs)

    def _drain(self) -> None:
        while self.sched.has_work():  # a step in flight belongs to the worker that launched it
            self.sched.step()

    def generate(self, **kw):
        self._drain()
        self.sched.tp_worker = self.target
        try:
            return self.spec.generate(**kw)
        finally:
            self._drain()
            self.sched.tp_worker = self.spec_worker


def check_outputs(plain, spec, worker, prompts, sp, targets, deterministic: bool) -> dict:
    """Speculative == plain (deterministic) or within the stated bound, per mode; raises otherwise."""
    from sglang.srt.testing.spec_drafts import (batch_shape_noise, forced_drafts, verify_tolerance,
                                                within_tolerance_violation)

    gen = dict(return_logprob=True, top_logprobs_num=10)  # a flip may land past the top-2 (flat logits)
    ref = plain.generate(input_ids=prompts, sampling_params=sp, **gen)
    noise = 0.0
    if not deterministic:  # the same prompts alone vs in a batch of >= 4 (at bs 1 the timed batch is one row)
        g = torch.Generator().manual_seed(1)
        extra = torch.randint(5, min(plain.model_config.vocab_size, 1000), (4, len(prompts[0])), generator=g).tolist()
        probe = (prompts + extra)[:max(4, len(prompts))]
        batched = plain.generate(input_ids=probe, sampling_params=sp, **gen)
        alone = [plain.generate(input_ids=p, sampling_params=sp, **gen) for p in probe[:4]]
        noise = batch_shape_noise(alone, batched[:4])
    tol = verify_tolerance(noise)
    first_diff = {}
    for m in MODES:
        worker.draft_override = None if m == "natural" else forced_drafts(targets, m, vocab=plain.model_config.vocab_size)
        out = spec.generate(input_ids=prompts, sampling_params=sp, **gen)
        if deterministic:
            if [o["output_ids"] for o in out] != [o["output_ids"] for o in ref]:
                raise SystemExit(f"speculative output differs from plain under deterministic inference ({m})")
        else:
            bad = within_tolerance_violation(ref, out, tol)
            if bad:
                raise SystemExit(f"speculative output outside the tolerance ({m}): {bad}")
        first_diff[m] = sum(o["output_ids"] != r["output_ids"] for o, r in zip(out, ref))
    return {"rule": "exact" if deterministic else "tolerance", "noise_nats": noise, "tolerance_nats": tol,
            "requests_parting_at_a_near_tie": first_diff}


def _model_config(args):
    """The target's config (its vocab) before any engine exists (--shared-target)."""
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig(args.model_path)


def run(args) -> dict:
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.testing.spec_drafts import forced_drafts

    common = dict(model_path=args.model_path, device=args.device, dtype=args.dtype, load_format=args.load_format,
                  random_seed=0, disable_radix_cache=True, max_total_tokens=args.max_total_tokens,
                  enable_deterministic_inference=args.deterministic,
                  # >= 4: the tolerance's noise probe decodes a batch of 4 (with 1, it never batches: noise 0)
                  max_running_requests=max(4, *args.batch_sizes), cuda_graph_max_bs=max(4, *args.batch_sizes))
    if args.tokenizer_path:
        common["tokenizer_path"] = args.tokenizer_path
    plain = None if args.shared_target else Engine(**common)
    vocab = (plain.model_config if plain else _model_config(args)).vocab_size
    token_map = args.speculative_token_map
    if token_map is None and args.hot_vocab:
        # a stand-in for a frequency ranking (FR-Spec): the lowest ids (BPE merges come roughly in
        # frequency order); forced drafts do not depend on it, natural ones may accept less
        token_map = os.path.join(args.out_dir, f"hot_{args.hot_vocab}.pt")
        os.makedirs(args.out_dir, exist_ok=True)
        torch.save(torch.arange(min(args.hot_vocab, vocab)), token_map)
    spec = Engine(**common, speculative_algorithm="EAGLE", speculative_num_steps=args.num_steps,
                  speculative_token_map=token_map, speculative_adaptive=args.adaptive)
    worker = spec.scheduler.tp_worker
    if plain is None:
        plain = TargetAsPlain(spec)
    g = torch.Generator().manual_seed(0)
    result = {"batches": {}}
    for bs in args.batch_sizes:
        prompts = torch.randint(5, min(vocab, 1000), (bs, args.prompt_len), generator=g).tolist()
        sp = {"temperature": 0, "max_new_tokens": args.gen_len, "ignore_eos": True}
        _timed(plain, prompts, sp, args.device)  # warm-up (and the oracle for the forced drafts)
        _, ref = _timed(plain, prompts, sp, args.device)
        if not args.deterministic:
            # Default mode: a verify row is another batch shape than plain's decode row, and on random
            # weights (flat logits) that flips near-ties, so plain's tokens are not what the verify
            # accepts. Forced drafts follow the speculative engine's own natural output instead (the
            # verify's arithmetic is fixed by its bs x (steps + 1) shape, so those drafts are accepted);
            # that output is still checked against plain's within the tolerance.
            # --adaptive: that run drafts at every step (a step without drafts is a plain row, and
            # the forced-right targets must be what the verify computes)
            worker.draft_override, adaptive, worker.adaptive = None, worker.adaptive, None
            ref = spec.generate(input_ids=prompts, sampling_params=sp)
            worker.adaptive = adaptive
        targets = {tuple(p): o["output_ids"] for p, o in zip(prompts, ref)}
        check = check_outputs(plain, spec, worker, prompts, sp, targets, args.deterministic)
        times = {"plain": []} | {m: [] for m in MODES}
        prefill_t = {"plain": [], "spec": []}
        sp1 = {**sp, "max_new_tokens": 1}
        accept = {}
        for m in MODES:
            worker.draft_override = None if m == "natural" else forced_drafts(targets, m)
            _timed(spec, prompts, sp, args.device)  # warm-up of this mode
        for _ in range(args.repeats):
            prefill_t["plain"].append(_timed(plain, prompts, sp1, args.device)[0])
            worker.draft_override = None
            prefill_t["spec"].append(_timed(spec, prompts, sp1, args.device)[0])
            times["plain"].append(_timed(plain, prompts, sp, args.device)[0])
            for m in MODES:
                worker.draft_override = None if m == "natural" else forced_drafts(targets, m)
                worker.num_verify_steps = worker.num_accepted_drafts = 0
                if worker.adaptive is not None:  # each mode's run from a fresh policy
                    worker.adaptive.reset()
                t, out = _timed(spec, prompts, sp, args.device)
                times[m].append(t)
                accept[m] = worker.avg_accept_length
        # draft step vs target step: one more forced-wrong run (every step drafts and verifies)
        worker.draft_override = forced_drafts(targets, "wrong")
        draft_t, target_t = ForwardTimer(worker.draft_runner, args.device), ForwardTimer(
            worker.target.model_runner, args.device)
        try:
            _timed(spec, prompts, sp, args.device)
            ratio = {"draft_step_ms": draft_t.median_ms(), "target_verify_ms": target_t.median_ms()}
        finally:
            draft_t.close()
            target_t.close()
        ratio["draft_over_target"] = (ratio["draft_step_ms"] / ratio["target_verify_ms"]
                                      if ratio["draft_step_ms"] and ratio["target_verify_ms"] else None)
        med = {k: statistics.median(v) for k, v in times.items()}
        pre = {k: statistics.median(v) for k, v in prefill_t.items()}
        dec = {k: bs * (args.gen_len - 1) / max(v - pre["plain" if k == "plain" else "spec"], 1e-9)
               for k, v in med.items()}
        row = {"tok_s": {k: bs * args.gen_len / v for k, v in med.items()}, "seconds": med,
               "decode_tok_s": dec, "prefill_seconds": pre,
               "decode_speedup": {m: dec[m] / dec["plain"] for m in MODES},
               "forced_drafts_from": "plain" if args.deterministic else "speculative natural output",
               "accept_length": accept, "step_ratio": ratio, "output_check": check,
               "speedup": {m: med["plain"] / med[m] for m in MODES}}
        result["batches"][bs] = row
        print(f"  bs {bs}: {json.dumps(row)}", file=sys.stderr, flush=True)
    return result


def plot(result: dict, path: str) -> None:
    plt = import_pyplot(path)
    if plt is None:
        return None

    bss = sorted(result["batches"], key=int)
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / (len(MODES) + 1)
    for j, name in enumerate(("plain",) + MODES):
        ys = [result["batches"][b]["tok_s"][name] for b in bss]
        ax.bar([i + j * width for i in range(len(bss))], ys, width, label=name)
    ax.set_xticks([i + width * len(MODES) / 2 for i in range(len(bss))], [f"bs {b}" for b in bss])
    ax.set_ylabel("decode tok/s (generate)")
    ax.set_title(f"speculative (num_steps {result['num_steps']}) vs plain, {result['device_name']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="builtin:tiny-deepseek-v32-mtp")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--shape", default="deepseek-v32", help="with --layers: transformers' config of this shape")
    p.add_argument("--layers", type=int, default=None, help="real-shape model: target layers (+ one MTP layer)")
    p.add_argument("--experts", type=int, default=16, help="with --layers: routed experts")
    p.add_argument("--deterministic", action="store_true", help="both engines --enable-deterministic-inference")
    p.add_argument("--adaptive", action="store_true",
                   help="the speculative engine with --speculative-adaptive (drafting off while drafts fail)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-steps", type=int, default=3)
    p.add_argument("--speculative-token-map", default=None, help="FR-Spec hot-token file for the draft's lm_head")
    p.add_argument("--hot-vocab", type=int, default=0,
                   help="without a token map: draft over the K lowest token ids (FR-Spec stand-in); 0 = full vocab")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-total-tokens", type=int, default=32768)
    p.add_argument("--shared-target", action="store_true",
                   help="one engine: plain decoding runs on the speculative engine's own target worker (one copy "
                        "of the weights: 16 layers x 16 experts on an 80 GB card)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (checks the script, not speed)")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    if args.smoke:
        args.batch_sizes, args.prompt_len, args.gen_len, args.repeats = "1,2", 8, 8, 1
    args.batch_sizes = [int(x) for x in str(args.batch_sizes).split(",")]
    if args.layers:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
        from bench_e2e_vs_hf import make_config_dir

        args.model_path = args.tokenizer_path = make_config_dir(args.shape, args.layers, args.smoke,
                                                                n_routed_experts=args.experts,
                                                                num_nextn_predict_layers=1)
        args.load_format = "dummy"
    result = {"model": args.model_path, "layers": args.layers, "experts": args.experts if args.layers else None,
              "deterministic": args.deterministic, "adaptive": args.adaptive, "num_steps": args.num_steps,
              "plain_side": "the speculative engine's target worker" if args.shared_target else "a plain engine",
              "speculative_token_map": args.speculative_token_map, "hot_vocab": args.hot_vocab, "prompt_len": args.prompt_len,
              "gen_len": args.gen_len, "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "date": time.strftime("%Y-%m-%d"), **run(args)}
    os.makedirs(args.out_dir, exist_ok=True)
    tag = ((f"_{args.layers}l{args.experts}e" if args.layers else "") + (f"_hot{args.hot_vocab}" if args.hot_vocab else "")
           + ("_adaptive" if args.adaptive else ""))
    stem = os.path.join(args.out_dir, f"speculative_{args.device}{tag}" + ("_det" if args.deterministic else "")
                        + ("_smoke" if args.smoke else ""))
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    try:
        plot(result, stem + ".png")
    except ImportError:
        print("matplotlib not installed: JSON only", file=sys.stderr)
    print(f"{'bs':>4s} {'plain tok/s':>12s} " + " ".join(f"{m + ' tok/s':>14s} {'x':>5s} {'acc':>4s}" for m in MODES)
          + f" {'draft/target':>12s}   (generate, prefill included)")
    for bs, row in result["batches"].items():
        r = row["step_ratio"]["draft_over_target"]
        print(f"{bs:>4} {row['tok_s']['plain']:12.1f} " + " ".join(
            f"{row['tok_s'][m]:14.1f} {row['speedup'][m]:5.2f} {row['accept_length'][m]:4.1f}" for m in MODES)
            + f" {r if r is None else round(r, 3)!s:>12}")
        print(f"     decode only: plain {row['decode_tok_s']['plain']:.1f} tok/s, " + ", ".join(
            f"{m} {row['decode_tok_s'][m]:.1f} ({row['decode_speedup'][m]:.2f}x)" for m in MODES)
            + f"; prefill {1e3 * row['prefill_seconds']['plain']:.1f} / {1e3 * row['prefill_seconds']['spec']:.1f} ms")
        c = row["output_check"]
        print(f"     outputs vs plain: {c['rule']} (tolerance {c['tolerance_nats']:.2e} nats, noise "
              f"{c['noise_nats']:.2e}); requests parting at a near-tie: {c['requests_parting_at_a_near_tie']}")


if __name__ == "__main__":
    main()
