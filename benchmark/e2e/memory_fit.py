"""Does the memory plan hold on this GPU? For each V3.2-shape config (--configs LAYERSxEXPERTS,
transformers' DeepseekV32Config sizes, dummy weights, the server's default flags):

1. the model alone is loaded with --load-format dummy: the loading peak beyond the weights (the
   dummy init draws in place, chunk by chunk: tens of MB, never a float32 copy of a tensor);
2. the engine starts (the Scheduler and ModelRunner the server runs): its memory plan (weights,
   reserve, KV tokens, what is left free), or the start-up error naming the flags;
3. the largest requests it admits run one after the other: one prompt of --max-prefill-tokens
   tokens, prompts summing to --max-prefill-tokens at once, a 32K prompt (--long-prompt), one of
   --max-prefill-tokens asking for the logprobs of every prompt token (top 5), and a decode batch of --max-running-requests (256) requests; per case the peak allocated memory, the
   free memory after it, and whether the peak stayed within weights + KV + reserve.

--server-configs runs the same cases through the HTTP server (`python -m sglang.launch_server`,
/generate with input_ids): its start-up log's memory plan, and the device's least free memory while
each case runs (polled: the peak of the whole device, allocator cache included).

Each config runs in a subprocess of its own (a fresh allocator). JSON under --out-dir (one file for
all configs); the exit status is non-zero when a config ran out of memory or did not start.

    python benchmark/e2e/memory_fit.py --configs 2x16,2x256,3x16,3x256 --out-dir /tmp/out
    python benchmark/e2e/memory_fit.py --configs "" --server-configs 2x256 --out-dir /tmp/out
    python benchmark/e2e/memory_fit.py --smoke      # tiny shapes on CPU: exercises the script
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e_vs_hf import make_config_dir  # noqa: E402

GiB = 2**30


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _mem(device: str) -> dict:
    if device != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"allocated": torch.cuda.memory_allocated(), "peak_allocated": torch.cuda.max_memory_allocated(),
            "reserved": torch.cuda.memory_reserved(), "free": free, "total": total}


def _reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def load_alone(path: str, args) -> dict:
    """The model loaded with dummy weights, nothing else: weights and the loading peak beyond them."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import get_model

    _sync(args.device)
    _reset_peak(args.device)
    before = _mem(args.device).get("allocated", 0)
    t0 = time.perf_counter()
    model = get_model(ModelConfig(path, args.dtype), args.device, load_format="dummy")
    _sync(args.device)
    out = {"seconds": time.perf_counter() - t0,
           "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    m = _mem(args.device)
    if m:
        out.update(weights=m["allocated"] - before, peak_beyond_weights=m["peak_allocated"] - m["allocated"])
    del model
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def cases(sa, args) -> list[tuple[str, list[int], int, bool]]:
    """(name, prompt lengths submitted at once, new tokens, prompt logprobs of every token)."""
    n = args.max_prefill_tokens or sa.max_prefill_tokens
    many = max(1, n // args.many_len)
    running = sa.max_running_requests or 256
    return [("max_prefill_one_prompt", [n], 1, False),
            (f"max_prefill_{many}_prompts", [n // many] * many, 1, False),
            ("long_prompt", [args.long_prompt], 2, False),
            ("prompt_logprobs", [n], 1, True),
            (f"decode_{running}_requests", [args.decode_prompt_len] * running, args.decode_tokens, False)]


def run_config(layers: int, experts: int, args) -> dict:
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.model_executor.memory_plan import MemoryPlanError

    path = make_config_dir("deepseek-v32", layers, args.smoke, n_routed_experts=experts)
    res: dict = {"layers": layers, "experts": experts, "load_alone": load_alone(path, args)}
    print(f"  {layers}x{experts}: loaded alone {res['load_alone']}", file=sys.stderr, flush=True)
    flags = dict(model_path=path, tokenizer_path=path, load_format="dummy", dtype=args.dtype, device=args.device,
                 random_seed=0, **({"context_length": args.context_length} if args.context_length else {}),
                 **({"max_prefill_tokens": args.max_prefill_tokens} if args.max_prefill_tokens else {}),
                 **({"chunked_prefill_size": args.chunked_prefill_size} if args.chunked_prefill_size else {}))
    t0 = time.perf_counter()
    try:
        engine = Engine(**flags)
    except MemoryPlanError as e:  # the card cannot hold this config: the message names the flags
        res["start_error"] = str(e)
        return res
    res["start_seconds"] = time.perf_counter() - t0
    sa = engine.server_args
    worker = engine.scheduler.tp_worker
    runner = getattr(worker, "target", worker).model_runner
    plan = runner.memory_plan
    res["plan"] = plan.as_dict() if plan is not None else None
    res["plan_text"] = plan.describe() if plan is not None else None
    res["profiled_activation_bytes"] = getattr(runner, "profiled_activation_bytes", None)
    res["max_total_num_tokens"] = runner.max_total_num_tokens
    res["after_start"] = _mem(args.device)
    print(f"  {layers}x{experts}: {res['plan_text']}", file=sys.stderr, flush=True)
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    res["cases"] = {}
    for name, lens, new, logprobs in cases(sa, args):
        prompts = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lens]
        sp = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
        _sync(args.device)
        _reset_peak(args.device)
        row: dict = {"prompt_lens": sorted(set(lens)), "requests": len(lens), "tokens": sum(lens), "new_tokens": new}
        t0 = time.perf_counter()
        try:
            lp = dict(return_logprob=True, logprob_start_len=0, top_logprobs_num=5) if logprobs else {}
            outs = engine.generate(input_ids=prompts, sampling_params=[sp] * len(prompts), **lp)
            _sync(args.device)
            row["ok"] = len(outs) == len(prompts)
        except torch.OutOfMemoryError as e:
            row.update(ok=False, oom=str(e).splitlines()[0])
        row["seconds"] = time.perf_counter() - t0
        row["memory"] = _mem(args.device)
        if plan is not None and row["memory"]:
            # the plan's bound on what the allocator holds; headroom < margin: an estimate was short
            row["headroom"] = plan.weights + plan.kv_bytes + plan.reserve - row["memory"]["peak_allocated"]
            row["within_plan"] = row["headroom"] >= 0
            row["within_plan_without_margin"] = row["headroom"] >= plan.margin
        res["cases"][name] = row
        print(f"  {layers}x{experts} {name}: {json.dumps(row)}", file=sys.stderr, flush=True)
        if not row["ok"]:
            break
    return res


class _FreePoller:
    """The device's least free memory while a case runs (a thread polling cudaMemGetInfo)."""

    def __init__(self, device: str, period_s: float = 0.02) -> None:
        import threading

        self.device, self.period, self.least = device, period_s, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            free = torch.cuda.mem_get_info()[0]
            self.least = free if self.least is None else min(self.least, free)
            self._stop.wait(self.period)

    def __enter__(self) -> "_FreePoller":
        if self.device == "cuda":
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def run_server_config(layers: int, experts: int, args) -> dict:
    """The cases through a launched server: its plan from the start-up log, 200s, least free memory."""
    import httpx

    from sglang.srt.server_args import ServerArgs
    from sglang.srt.testing.server import ServerProcess

    path = make_config_dir("deepseek-v32", layers, args.smoke, n_routed_experts=experts)
    flags = ["--tokenizer-path", path, "--load-format", "dummy", "--dtype", args.dtype, "--device", args.device,
             "--random-seed", "0", "--log-level", "info"]
    for name in ("context_length", "max_prefill_tokens", "chunked_prefill_size"):
        if getattr(args, name):
            flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    flags += shlex.split(args.server_args)
    res: dict = {"layers": layers, "experts": experts, "server": True, "cases": {}, "server_args": args.server_args}
    if args.device == "cuda":  # this process's CUDA context (the poller's) exists before the server plans
        torch.cuda.mem_get_info()
    t0 = time.perf_counter()
    try:
        srv = ServerProcess(path, *flags, timeout=args.timeout)
    except RuntimeError as e:  # start-up failure: the log names the flags (MemoryPlanError) or the crash
        res["start_error"] = str(e)[-3000:]
        return res
    with srv:
        res["start_seconds"] = time.perf_counter() - t0
        res["plan_text"] = next((ln.split("memory plan: ", 1)[1] for ln in srv.log().splitlines()
                                 if "memory plan: " in ln), None)
        info = httpx.get(srv.base_url + "/get_server_info", timeout=60).json()
        res["max_total_num_tokens"] = info.get("max_total_num_tokens")
        sa = ServerArgs(model_path=path, max_prefill_tokens=info["max_prefill_tokens"],
                        max_running_requests=info.get("max_running_requests"))
        with open(os.path.join(path, "config.json")) as f:
            vocab = int(json.load(f)["vocab_size"])
        g = torch.Generator().manual_seed(0)
        for name, lens, new, logprobs in cases(sa, args):
            ids = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lens]
            body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}}
            if logprobs:
                body.update(return_logprob=True, logprob_start_len=0, top_logprobs_num=5)
            row: dict = {"prompt_lens": sorted(set(lens)), "requests": len(lens), "tokens": sum(lens),
                         "new_tokens": new}
            t1 = time.perf_counter()
            with _FreePoller(args.device) as poll:
                r = httpx.post(srv.base_url + "/generate", json=body, timeout=args.timeout)
            row.update(ok=r.status_code == 200 and len(r.json()) == len(ids), status=r.status_code,
                       seconds=time.perf_counter() - t1)
            if not row["ok"]:
                row["body"] = r.text[:500]
            if poll.least is not None:
                row["memory"] = {"least_free": poll.least, "total": torch.cuda.mem_get_info()[1]}
            res["cases"][name] = row
            print(f"  server {layers}x{experts} {name}: {json.dumps(row)}", file=sys.stderr, flush=True)
            if not row["ok"]:
                res["log_tail"] = srv.log()[-3000:]
                break
    return res


def _summary(r: dict) -> str:
    if "start_error" in r:
        return f"{r['layers']}x{r['experts']}: did not start: {r['start_error']}"
    if r.get("server"):
        lines = [f"server {r['layers']}x{r['experts']}: {r.get('plan_text')}"]
        for name, c in r.get("cases", {}).items():
            m = c.get("memory") or {}
            lines.append(f"    {name:28s} {'ok ' if c['ok'] else 'FAIL'} HTTP {c['status']}, least free "
                         f"{m.get('least_free', 0) / GiB:6.2f} GiB of {m.get('total', 0) / GiB:.2f}, {c['seconds']:.1f} s")
        return "\n".join(lines)
    p = r.get("plan")
    if p is None:
        return f"{r['layers']}x{r['experts']}: no device plan (CPU); cases " + ", ".join(
            f"{n} {'ok' if c['ok'] else 'failed'}" for n, c in r.get("cases", {}).items())
    lines = [f"{r['layers']}x{r['experts']}: weights {p.get('weights', 0) / GiB:.2f} GiB, reserve "
             f"{p.get('reserve', 0) / GiB:.2f} GiB (activations {p.get('activations', 0) / GiB:.2f}, graphs "
             f"{p.get('cuda_graphs', 0) / GiB:.2f}), KV {r.get('max_total_num_tokens')} tokens, load peak beyond the "
             f"weights {r['load_alone'].get('peak_beyond_weights', 0) / 2**20:.0f} MiB"]
    for name, c in r.get("cases", {}).items():
        m = c.get("memory") or {}
        lines.append(f"    {name:28s} {'ok ' if c['ok'] else 'OOM'} peak {m.get('peak_allocated', 0) / GiB:6.2f} GiB, "
                     f"free after {m.get('free', 0) / GiB:6.2f} GiB, headroom {c.get('headroom', 0) / GiB:5.2f} GiB "
                     f"(within plan {c.get('within_plan')}, without its margin {c.get('within_plan_without_margin')}), "
                     f"{c['seconds']:.1f} s")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="2x16,2x256,3x16,3x256", help="LAYERSxEXPERTS, comma-separated")
    p.add_argument("--server-configs", default="", help="LAYERSxEXPERTS run through the HTTP server")
    p.add_argument("--server-args", default="", help="more launch_server flags for --server-configs, e.g. "
                   "'--kv-cache-dtype fp8_e4m3 --enable-hierarchical-cache'")
    p.add_argument("--long-prompt", type=int, default=32768)
    p.add_argument("--many-len", type=int, default=1024, help="prompt length of the many-prompt prefill")
    p.add_argument("--decode-prompt-len", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=8)
    p.add_argument("--max-prefill-tokens", type=int, default=None, help="default: the server's")
    p.add_argument("--chunked-prefill-size", type=int, default=None, help="default: the server's")
    p.add_argument("--context-length", type=int, default=None, help="default: the config's (163840)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--timeout", type=int, default=150, help="seconds per config")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (checks the script, not memory)")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.device, args.dtype = "cpu", "float32"
        args.configs = "2x4" if args.configs == p.get_default("configs") else args.configs
        args.long_prompt, args.many_len, args.decode_prompt_len, args.decode_tokens = 96, 16, 8, 2
        args.max_prefill_tokens = args.max_prefill_tokens or 64
        args.chunked_prefill_size = args.chunked_prefill_size or 32
        args.context_length = args.context_length or 256
    if args.child:
        server = args.child.startswith("server:")
        layers, experts = (int(x) for x in args.child.removeprefix("server:").split("x"))
        print("RESULT " + json.dumps((run_server_config if server else run_config)(layers, experts, args)))
        return
    argv = [a for a in sys.argv[1:] if a != "--smoke"] + (["--smoke"] if args.smoke else [])
    result = {"device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "date": time.strftime("%Y-%m-%d"), "configs": {}}
    failed = []
    os.makedirs(args.out_dir, exist_ok=True)
    out = os.path.join(args.out_dir, "memory_fit" + ("_smoke" if args.smoke else "") + ".json")
    todo = [c for c in args.configs.split(",") if c] + [f"server:{c}" for c in args.server_configs.split(",") if c]
    for cfg in todo:
        try:
            proc = subprocess.run([sys.executable, __file__, *argv, "--child", cfg], capture_output=True, text=True,
                                  timeout=2 * args.timeout if cfg.startswith("server:") else args.timeout)
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            stdout, stderr, rc = e.stdout or "", (e.stderr or "") + f"\ntimed out after {args.timeout} s", -1
            stdout, stderr = (x.decode() if isinstance(x, bytes) else x for x in (stdout, stderr))
        sys.stderr.write(stderr[-3000:])
        line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
        if rc or line is None:
            result["configs"][cfg] = {"error": f"exit {rc}: {(stderr.strip().splitlines() or [''])[-1][-500:]}"}
            failed.append(cfg)
        else:
            r = result["configs"][cfg] = json.loads(line[len("RESULT "):])
            if "start_error" in r or not all(c["ok"] for c in r["cases"].values()):
                failed.append(cfg)
        with open(out, "w") as f:  # after each config: a run cut short keeps what it measured
            json.dump(result, f, indent=2)
    for cfg, r in result["configs"].items():
        print(r["error"] if "error" in r else _summary(r))
    print(f"wrote {out}; {'FAILED: ' + ','.join(failed) if failed else 'every config fits'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
