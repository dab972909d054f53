"""HiCache on real DeepSeek-V3.2 attention shapes: copy bandwidth of the controller vs a plain pinned
copy of the same bytes, a host hit vs recomputing the prefix, and the layer-end backup's cost in the
prefill -- all measured in the same run (issue 29, items 4 and 6).

Model: a config directory (`--model-path`, a config.json is enough; `--load-format dummy` draws
random weights) or, by default, transformers' own `DeepseekV32Config()` (the real sizes) written to
a temporary directory. `--num-layers` / `--num-experts` override `num_hidden_layers` /
`n_routed_experts` (the first layer dense, the rest MoE); `--json-model-override-args` merges more.
The default, 3 layers x 16 experts in bf16, is about 9 GB of weights per engine; the run holds two
engines (HiCache on, and off for the recompute / backup-off baseline) plus a KV pool of two prompts
each, so it fits an 80 GB card at 32K (the activations of one 32K prefill are the rest).

Measured:
- copy: `--copy-tokens` tokens of the HiCache engine's own device pool (every layer, MLA KV + index
  K) backed up to a host mirror and loaded back into other device pages, per `--io-backends` x
  `--layouts` x page map (consecutive pages; device pages shuffled; every other host page), wall time
  from submission to the op's completion; the round trip is checked byte for byte. Beside it, a
  plain pinned D2H and H2D copy of the same number of bytes (one contiguous tensor). Then the same
  for one op at a real model's depth (`--copy-layers`, default 61 = V3.2) on a pool of the engine's
  rows, with the engine's backend and layout: an op's host share (hand-off to the copy thread, plan,
  wake-up; ~1 ms of Python on an H100 host) is fixed while its bytes grow with depth, so a 3-layer op
  understates what serving sees. The goal is >= 0.8 of the plain copy for page runs (consecutive and
  device-shuffled maps) at that depth; the engine-depth ratio is reported beside it.
- host hit: a prompt is prefilled (backed up at layer ends), its device copy evicted to the host
  (checked: the match comes from the host), then re-sent: TTFT (max_new_tokens 1) vs the same
  prompt on an engine without HiCache or radix cache (a full recompute). Goal >= 5x at 32K.
- backup: the fresh prefill on the HiCache engine (layer-end backups on a side stream) vs the same
  prompt without HiCache; also the time until every backup is acknowledged. Goal <= 5% of the prefill.
Each repeat uses a new prompt; the order of the two engines alternates; one warm-up repeat; medians.

    python benchmark/hicache/bench_hicache.py --out-dir /tmp/hicache          # GPU: V3.2, 3 layers x 16 experts, 32K
    python benchmark/hicache/bench_hicache.py --model-path DIR --load-format dummy --num-layers 2 --out-dir /tmp/h
    python benchmark/hicache/bench_hicache.py --smoke --out-dir /tmp/h   # tiny shapes on CPU: exercises the script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from sglang.bench_plot import import_pyplot

SP = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
SMOKE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
             v_head_dim=32, num_experts_per_tok=2, n_group=1, topk_group=1, index_n_heads=16, index_head_dim=64,
             index_topk=32, vocab_size=1024, max_position_embeddings=4096)
GOALS = {"copy_ratio": 0.8, "host_hit_speedup": 5.0, "backup_overhead": 0.05}


def _progress(it, desc: str):
    try:
        from tqdm import tqdm

        return tqdm(it, desc=desc, file=sys.stderr)
    except ImportError:
        return it


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(5, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- the model --------------------------------------------------------------------------------------
def model_dirs(args) -> tuple[str, str, dict]:
    """(model path, tokenizer path, config overrides) for the engines."""
    from sglang.srt.model_loader.tiny_models import build_tokenizer

    overrides = json.loads(args.json_model_override_args) if args.json_model_override_args else {}
    if args.model_path is None:  # transformers' own V3.2 config: the real attention shapes
        import transformers

        cfg = transformers.DeepseekV32Config(num_hidden_layers=args.num_layers or 3, first_k_dense_replace=1,
                                             n_routed_experts=args.num_experts or 16, **(SMOKE if args.smoke else {}))
        cfg.architectures = ["DeepseekV32ForCausalLM"]
        path = tempfile.mkdtemp(prefix="sglang-hicache-v32-")
        cfg.save_pretrained(path)
    else:
        path = args.model_path
        given = {"num_hidden_layers": args.num_layers, "n_routed_experts": args.num_experts}
        overrides = {**{k: v for k, v in given.items() if v is not None}, **overrides}
    tok = path
    if not path.startswith("builtin:") and not any(
            os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        tok = tempfile.mkdtemp(prefix="sglang-hicache-tok-")  # ids are given; the tokenizer only detokenizes
        build_tokenizer(tok)
    return path, tok, overrides


def make_engines(args, max_len: int):
    from sglang.srt.entrypoints.engine import Engine

    path, tok, overrides = model_dirs(args)
    page = args.page_size
    pool = (max_len // page + 2) * page * 2  # two prompts: evicting one really moves it to the host
    common = dict(model_path=path, tokenizer_path=tok, load_format=args.load_format, device=args.device,
                  dtype=args.dtype, random_seed=0, page_size=page, max_total_tokens=max(pool, 2 * args.copy_tokens
                                                                                          + 2 * page),
                  chunked_prefill_size=-1, max_prefill_tokens=max_len + page, context_length=max_len + 2 * page,
                  max_running_requests=2, disable_cuda_graph=True,
                  json_model_override_args=json.dumps(overrides) if overrides else "")
    hi = Engine(enable_hierarchical_cache=True, hicache_io_backend=args.engine_io_backend,
                hicache_mem_layout=args.engine_layout, hicache_write_policy="write_through", **common)
    cold = Engine(disable_radix_cache=True, **common)
    return hi, cold


# -- copy bandwidth ---------------------------------------------------------------------------------
def _fill_random(pool, pages: torch.Tensor) -> None:
    g = torch.Generator(device=pool.kv_buffer[0].device).manual_seed(0)
    d = pages.to(pool.kv_buffer[0].device)
    for lid in range(pool.layer_num):
        for p in pool.page_payloads(lid):
            b = p.buffer.view(torch.uint8)
            b[d] = torch.randint(0, 256, (len(d), b.shape[1]), generator=g, dtype=torch.uint8, device=b.device)


def _slots(pages: torch.Tensor, page: int) -> torch.Tensor:
    return (pages[:, None] * page + torch.arange(page)).reshape(-1)


def _plain(nbytes: int, repeats: int) -> dict:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if torch.cuda.is_available() else "cpu")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    out = {}
    for name, fn in (("d2h", lambda: host.copy_(dev, non_blocking=True)),
                     ("h2d", lambda: dev.copy_(host, non_blocking=True))):
        fn()  # warm-up
        out[f"plain_{name}_GBps"] = nbytes / statistics.median(_timed(fn) for _ in range(repeats)) / 1e9
    return out


def pool_like(pool, layers: int, size: int):
    """A device pool with `pool`'s rows (MLA KV, index K on every layer) and `layers` layers: a real
    model's depth, which the engine's few layers stand in for when it comes to compute."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, NSATokenToKVPool

    common = dict(size=size, page_size=pool.page_size, dtype=pool.dtype, kv_lora_rank=pool.kv_lora_rank,
                  qk_rope_head_dim=pool.qk_rope_head_dim, layer_num=layers, device=pool.device,
                  kv_cache_dtype=pool.kv_cache_dtype)
    if isinstance(pool, NSATokenToKVPool):
        return NSATokenToKVPool(index_head_dim=pool.index_head_dim, index_k_dtype=pool.index_k_dtype, **common)
    return MLATokenToKVPool(**common)


def bench_copy_engine(args, hi) -> dict:
    """The copies on the HiCache engine's own pool (its few layers), every backend x layout."""
    hi.flush_cache()
    sched = hi.scheduler
    pool = sched.tp_worker.model_runner.token_to_kv_pool
    tokens = args.copy_tokens // pool.page_size * pool.page_size
    src = sched.allocator.alloc(tokens).to("cpu")
    dst = sched.allocator.alloc(tokens).to("cpu")
    try:
        return bench_copy(args, pool, src, dst, args.io_backends.split(","), args.layouts.split(","))
    finally:
        sched.allocator.free(torch.cat([src, dst]).to(sched.allocator.device))


def bench_copy_deep(args, hi) -> dict:
    """The copies of one op at a real model's depth (`--copy-layers`), the engine's backend and layout:
    an op's host share (hand-off, plan, wake-up: ~1 ms of Python) is fixed, its bytes grow with depth."""
    eng = hi.scheduler.tp_worker.model_runner.token_to_kv_pool
    page = eng.page_size
    tokens = args.copy_tokens // page * page
    pool = pool_like(eng, args.copy_layers, 2 * tokens + page)
    slots = torch.arange(page, page + 2 * tokens)  # page 0 is the padding page
    try:
        return bench_copy(args, pool, slots[:tokens], slots[tokens:], [args.engine_io_backend], [args.engine_layout])
    finally:
        del pool
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def bench_copy(args, pool, src: torch.Tensor, dst: torch.Tensor, backends: list[str], layouts: list[str]) -> dict:
    """Backup + load of the pages of `src` slots (to / from `dst` slots) per backend x layout x page map."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache import hicache_io
    from sglang.srt.mem_cache.memory_pool_host import HostKVPool

    page = pool.page_size
    tokens = len(src)
    src_pages, dst_pages = src[::page] // page, dst[::page] // page
    _fill_random(pool, src_pages)
    n = len(src_pages)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    maps = {"consecutive": (torch.arange(n), src_pages, dst_pages),
            "device_shuffled": (torch.arange(n), src_pages[perm], dst_pages[perm.flip(0)]),
            "host_gaps": (2 * torch.arange(n), src_pages, dst_pages)}  # every other host page: runs of 1
    rows = []
    nbytes = HostKVPool(pool, tokens, "layer_first", pin_memory=False).get_size_bytes()  # what one transfer moves
    before = _plain(nbytes, args.repeats)
    for backend in _progress(backends, f"copies x {pool.layer_num} layers"):
        for layout in layouts:
            host = HostKVPool(pool, 2 * tokens, layout)
            ctl = HiCacheController([(pool, host)], backend)
            for name, (hp, sp, dp) in maps.items():
                h, s, d = _slots(hp, page), _slots(sp, page), _slots(dp, page)

                phases: dict[str, list] = {}

                def run(submit) -> float:
                    _sync()
                    t0 = time.perf_counter()
                    op = submit()
                    ctl.wait_done(op, timeout=600)
                    t1 = time.perf_counter()
                    t = t1 - t0
                    tl = {**op.timeline, "woken": t1}
                    for name, a, b in (("handoff", "submit", "start"), ("plan", "start", "planned"),
                                       ("enqueue", "planned", "queued"), ("copy_wait", "queued", "synced"),
                                       ("wake", "finish", "woken")):
                        if a in tl and b in tl:
                            phases.setdefault(f"{op.kind}_{name}_us", []).append((tl[b] - tl[a]) * 1e6)
                    ctl.poll()
                    if op.error is not None:
                        raise RuntimeError(f"{backend}/{layout}/{name}: {op.error}") from op.error
                    return t

                def layerwise() -> float:  # the write-through path: one backup_layer per layer end
                    import threading

                    left, fin, errs = [pool.layer_num], threading.Event(), []

                    def done(err):
                        errs.append(err) if err is not None else None
                        left[0] -= 1
                        if left[0] == 0:
                            fin.set()
                    _sync()
                    t0 = time.perf_counter()
                    runs = ctl.plan_later(h, s)  # once per forward, as the backup reservation does
                    for lid in range(pool.layer_num):
                        ctl.backup_layer(0, lid, s, h, None, done, runs)
                    if not fin.wait(600) or errs:
                        raise RuntimeError(f"{backend}/{layout}/{name}: layer backups failed {errs[:1]}")
                    return time.perf_counter() - t0

                def bare(to_host: bool) -> float:
                    """The copies alone: queued on this thread's stream, planned beforehand, no copy thread."""
                    runs = ctl.plan(h, s) if to_host else ctl.plan(h, d)
                    copy = ctl._copy_to_host if to_host else ctl._copy_to_device
                    # first repeat is the warm-up; median of the rest, as the op timings
                    return statistics.median([_timed(lambda: [copy(0, lid, runs, None) for lid in range(pool.layer_num)])
                                              for _ in range(args.repeats + 1)][1:])

                plan_s = statistics.median([_timed(lambda: ctl.plan(h, s)) for _ in range(args.repeats + 1)][1:])
                bare_backup = bare(True)
                backup = [run(lambda: ctl.backup(s, h)) for _ in range(args.repeats + 1)][1:]
                layers = [layerwise() for _ in range(args.repeats + 1)][1:]
                for lid in range(pool.layer_num):  # the load alone must bring the pages back
                    for p in pool.page_payloads(lid):
                        p.buffer.view(torch.uint8)[dp.to(p.buffer.device)] = 0
                load = [run(lambda: ctl.load(h, d)) for _ in range(args.repeats + 1)][1:]
                bare_load = bare(False)
                exact = all(torch.equal(b[dp.to(b.device)], b[sp.to(b.device)])  # bytes: random bits hold NaNs
                            for lid in range(pool.layer_num)
                            for b in (p.buffer.view(torch.uint8) for p in pool.page_payloads(lid)))
                runs = ctl.plan(h, s)
                rows.append({"io_backend": backend, "layout": layout, "map": name, "round_trip_exact": exact,
                             "host_copies_per_payload": runs.num_host_copies(),
                             "backup_GBps": nbytes / statistics.median(backup) / 1e9,
                             "backup_layerwise_GBps": nbytes / statistics.median(layers) / 1e9,
                             "load_GBps": nbytes / statistics.median(load) / 1e9,
                             # where an op's time goes: the copies alone (no thread, no plan) and the plan
                             "bare_backup_GBps": nbytes / bare_backup / 1e9, "bare_load_GBps": nbytes / bare_load / 1e9,
                             "plan_us": plan_s * 1e6,
                             # medians of the op phases (controller timeline), warm-up included
                             **{k: statistics.median(v) for k, v in phases.items()}})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                if not exact:
                    raise RuntimeError(f"{backend}/{layout}/{name}: the round trip changed the pages")
            ctl.shutdown()
            del host, ctl  # a deep pool's pinned mirror is GBs: one at a time
    after = _plain(nbytes, args.repeats)  # the faster of before / after: the ratios are not flattered
    plain = {k: max(before[k], after[k]) for k in before}
    plain["plain_before_after"] = [before, after]
    for r in rows:
        r["backup_ratio"] = r["backup_GBps"] / plain["plain_d2h_GBps"]
        r["backup_layerwise_ratio"] = r["backup_layerwise_GBps"] / plain["plain_d2h_GBps"]
        r["load_ratio"] = r["load_GBps"] / plain["plain_h2d_GBps"]
        r["bare_backup_ratio"] = r["bare_backup_GBps"] / plain["plain_d2h_GBps"]
        r["bare_load_ratio"] = r["bare_load_GBps"] / plain["plain_h2d_GBps"]
    return {"tokens": tokens, "bytes": nbytes, "page_size": page, "layers": pool.layer_num,
            "memcpy2d": hicache_io.memcpy2d_available(), **plain, "rows": rows}


# -- host hit vs recompute, backup cost --------------------------------------------------------------
def bench_prefill(args, hi, cold, length: int) -> dict:
    tc = hi.scheduler.tree_cache
    t = {"backup_on": [], "backup_drained": [], "recompute": [], "host_hit": []}
    same, reload_exact = [], []
    for rep in _progress(range(args.repeats + 1), f"prefill {length}"):
        hi.flush_cache()
        prompt = _prompt(length, 1000 + rep)
        out = {}

        def on():
            t0 = time.perf_counter()
            out["on"] = _timed(lambda: out.__setitem__("tok_on", hi.generate(input_ids=prompt, sampling_params=SP)))
            tc.controller.wait_idle(600)
            tc.check_events()
            out["drained"] = time.perf_counter() - t0

        def off():
            out["off"] = _timed(lambda: out.__setitem__("tok_off", cold.generate(input_ids=prompt, sampling_params=SP)))

        for f in ((on, off) if rep % 2 == 0 else (off, on)):
            f()
        tc.evict(10**9)  # the prefix leaves the device; its committed host copy stays
        m = tc.match_prefix(prompt)
        if m.host_hit_length < length // 2:
            raise RuntimeError(f"prefix not on the host (device {len(m.device_indices)}, host {m.host_hit_length})")
        out["hit"] = _timed(lambda: out.__setitem__("tok_hit", hi.generate(input_ids=prompt, sampling_params=SP,
                                                                         return_logprob=True)))
        tc.controller.wait_idle(600)
        tc.check_events()
        # The reloaded pages against the same pages never evicted: a device hit over the same prefix
        # runs the same extend shape, so its token and logprob must be equal bit for bit -- a host
        # copy that lost or shuffled bytes (the fork's "garbage after reload") shows here.
        dev_hit = hi.generate(input_ids=prompt, sampling_params=SP, return_logprob=True)
        hit = out["tok_hit"]
        reload_exact.append(_first(hit) == _first(dev_hit)
                            and hit["meta_info"]["cached_tokens"] == dev_hit["meta_info"]["cached_tokens"])
        if rep == 0:
            continue  # warm-up
        t["backup_on"].append(out["on"])
        t["backup_drained"].append(out["drained"])
        t["recompute"].append(out["off"])
        t["host_hit"].append(out["hit"])
        same.append(out["tok_hit"]["output_ids"] == out["tok_off"]["output_ids"] == out["tok_on"]["output_ids"])
    med = {k: statistics.median(v) for k, v in t.items()}
    return {"prefix_len": length, "host_hit_ttft_s": med["host_hit"], "recompute_ttft_s": med["recompute"],
            "host_hit_speedup": med["recompute"] / med["host_hit"], "prefill_backup_on_s": med["backup_on"],
            "prefill_backup_off_s": med["recompute"], "backup_overhead": med["backup_on"] / med["recompute"] - 1,
            "backup_drained_s": med["backup_drained"], "samples": t,
            "same_first_token": same,  # random weights: a near-tie can flip between batch shapes
            "reload_exact": reload_exact,  # host hit == device hit (token + logprob): must all be true
            "committed_backups": tc.backup.stats["committed"] if tc.backup is not None else None}


def _first(out: dict) -> tuple:
    """(first token, its logprob) of a max_new_tokens=1 generation."""
    lp = out["meta_info"]["output_token_logprobs"][0]
    return out["output_ids"][0], lp[0]


# -- output -----------------------------------------------------------------------------------------
def _copy_min(copy: dict | None, args) -> float | None:
    """The slowest backup or load over the page-run maps of the engine's backend and layout."""
    rows = [] if copy is None else [r for r in copy["rows"] if r["io_backend"] == args.engine_io_backend
                                    and r["layout"] == args.engine_layout and r["map"] != "host_gaps"]
    return min(min(r["backup_ratio"], r["load_ratio"]) for r in rows) if rows else None


def goals(res: dict, args) -> dict:
    """The copy goal holds for an op of the real model's depth (`copy_deep`, when run: a V3.2 op moves
    61 layers); the engine's few-layer op is reported beside it (`copy_ratio_min_engine_layers`)."""
    long = max(res["prefill"], key=lambda r: r["prefix_len"])
    engine_min = _copy_min(res["copy"], args)
    deep_min = _copy_min(res.get("copy_deep"), args)
    copy_min = deep_min if deep_min is not None else engine_min
    return {"copy_ratio_min": copy_min, "copy_ratio_min_engine_layers": engine_min,
            "copy_layers": (res.get("copy_deep") or res["copy"])["layers"],
            "host_hit_speedup": long["host_hit_speedup"], "backup_overhead": long["backup_overhead"],
            "targets": GOALS, "at_prefix_len": long["prefix_len"],
            "reload_exact": all(all(r["reload_exact"]) for r in res["prefill"]),
            "met": copy_min is not None and all(all(r["reload_exact"]) for r in res["prefill"])
            and copy_min >= GOALS["copy_ratio"]
            and long["host_hit_speedup"] >= GOALS["host_hit_speedup"]
            and long["backup_overhead"] <= GOALS["backup_overhead"]}


def plot(res: dict, path: str) -> None:
    """The bandwidth bars and the TTFT bars; without matplotlib a message and no file."""
    plt = import_pyplot(path)
    if plt is None:
        return None

    c = res["copy"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    labels = ["plain D2H", "plain H2D"] + [f"{r['io_backend']}/{r['layout']}/{r['map']}" for r in c["rows"]]
    x = list(range(len(labels)))
    a.bar([x[0]], [c["plain_d2h_GBps"]], color="gray")
    a.bar([x[1]], [c["plain_h2d_GBps"]], color="silver")
    a.bar([i - 0.2 for i in x[2:]], [r["backup_GBps"] for r in c["rows"]], width=0.4, label="backup (D2H)")
    a.bar([i + 0.2 for i in x[2:]], [r["load_GBps"] for r in c["rows"]], width=0.4, label="load (H2D)")
    a.axhline(GOALS["copy_ratio"] * c["plain_d2h_GBps"], ls="--", color="k", lw=0.8, label="0.8 x plain D2H")
    a.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
    a.set_ylabel("GB/s")
    a.set_title(f"HiCache copies, {c['tokens']} tokens x {c['layers']} layers ({c['bytes'] / 1e6:.1f} MB)")
    a.legend(fontsize=7)
    p = max(res["prefill"], key=lambda r: r["prefix_len"])
    b.bar(["recompute", "host hit", "backup on"], [p["recompute_ttft_s"], p["host_hit_ttft_s"],
                                                   p["prefill_backup_on_s"]], color=["gray", "C2", "C1"])
    b.set_ylabel("TTFT (s)")
    b.set_title(f"{p['prefix_len']} tokens: hit {p['host_hit_speedup']:.1f}x, "
                f"backup {100 * p['backup_overhead']:+.1f}%", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="config directory (config.json; weights optional); "
                    "default: transformers' DeepseekV32Config written to a temporary directory")
    ap.add_argument("--load-format", default="dummy", help="dummy (random weights) or auto (the checkpoint's)")
    ap.add_argument("--num-layers", type=int, default=None, help="num_hidden_layers (default 3 for the built-in "
                    "config, the directory's own otherwise)")
    ap.add_argument("--num-experts", type=int, default=None, help="n_routed_experts (8 active per token; default "
                    "16 for the built-in config, the directory's own otherwise)")
    ap.add_argument("--json-model-override-args", default="", help="more HF config overrides (JSON object)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--page-size", type=int, default=None, help="default 64 on cuda (upstream's), 16 on cpu")
    ap.add_argument("--prefix-lens", default=None, help="comma-separated; default 32768 (cuda), 256 (cpu)")
    ap.add_argument("--copy-tokens", type=int, default=None, help="default 32768 (cuda), 512 (cpu)")
    ap.add_argument("--copy-layers", type=int, default=None, help="also time one op of this many layers on a "
                    "pool of the engine's rows (the goal's op; default 61 = V3.2's depth on cuda, 5 on cpu; 0: off)")
    ap.add_argument("--io-backends", default=None, help="default direct,kernel (cuda), direct (cpu)")
    ap.add_argument("--layouts", default="layer_first,page_first")
    ap.add_argument("--engine-io-backend", default="direct", help="the HiCache engine's --hicache-io-backend")
    ap.add_argument("--engine-layout", default="layer_first", help="the HiCache engine's --hicache-mem-layout")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (exercises the script)")
    ap.add_argument("--out-dir", default=None, help="write hicache_<device>.json (+ .png) here")
    args = ap.parse_args()
    if args.smoke:
        args.device = "cpu"
    cuda = args.device == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.page_size = args.page_size or (64 if cuda else 16)
    args.prefix_lens = args.prefix_lens or ("32768" if cuda else "256")
    args.copy_tokens = args.copy_tokens or (32768 if cuda else 512)
    args.io_backends = args.io_backends or ("direct,kernel" if cuda else "direct")
    if args.copy_layers is None:
        args.copy_layers = 61 if cuda else 5
    if args.model_path and args.model_path.startswith("builtin:"):
        args.load_format = "auto"
    lens = [int(x) for x in args.prefix_lens.split(",")]
    hi, cold = make_engines(args, max(lens))
    res = {"args": vars(args), "device": args.device, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if cuda else None,
           "layers": hi.model_config.num_hidden_layers,
           "experts": getattr(hi.model_config.hf_config, "n_routed_experts", None),
           "gpu_mem_peak_GiB": None}
    res["copy"] = bench_copy_engine(args, hi)
    res["copy_deep"] = bench_copy_deep(args, hi) if args.copy_layers > 0 else None
    res["prefill"] = [bench_prefill(args, hi, cold, n) for n in lens]
    res["goals"] = goals(res, args)
    if cuda:
        res["gpu_mem_peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps({k: res[k] for k in ("gpu", "layers", "experts", "goals", "gpu_mem_peak_GiB")}, indent=1))
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        out = os.path.join(args.out_dir, f"hicache_{args.device}.json")
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        plot(res, out.replace(".json", ".png"))
        print("wrote", out, file=sys.stderr)


if __name__ == "__main__":
    main()
