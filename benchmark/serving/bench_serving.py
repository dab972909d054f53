"""Online serving benchmark against any OpenAI-compatible server (``/v1/completions``, streaming).

Flag names follow upstream SGLang's ``bench_serving`` where they exist. Each request is a streaming
completion (``stream_options.include_usage`` on, ``temperature`` 0, ``ignore_eos`` on); per request
it records TTFT, inter-token latencies, end-to-end latency and token counts, then reports throughput
and latency statistics (mean / median / p90 / p99 / std), writes JSON and a PNG plot.

    # server: python -m sglang.launch_server --model-path builtin:tiny-deepseek-v32 --port 30000
    python benchmark/serving/bench_serving.py --num-prompts 200 --request-rate 16 \\
        --random-input-len 256 --random-output-len 64 --output-file /tmp/bench.json

    # a jsonl fixture of {"prompt": ...} or GSM8K-style {"question": ...} records
    python benchmark/serving/bench_serving.py --dataset-name fixture --dataset-path prompts.jsonl

Without ``--tokenizer`` random prompts are random words and token counts come from the server's
``usage`` fields (falling back to the number of streamed content chunks); with ``--tokenizer DIR``
(a local HF tokenizer directory) random prompts are random token ids decoded to text, of the exact
token length, and the tokenizer counts tokens where the server does not report them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from sglang.bench_plot import import_pyplot

# --------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------


@dataclass
class RequestInput:
    prompt: str
    # Prompt length in tokens when known locally (tokenizer given), else None: the server reports it.
    prompt_len: Optional[int]
    output_len: int


@dataclass
class RequestOutput:
    success: bool = False
    error: str = ""
    status: Optional[int] = None  # HTTP status
    ttft: Optional[float] = None  # seconds, request sent -> first non-empty text chunk
    itl: list[float] = field(default_factory=list)  # seconds between successive content chunks
    latency: float = 0.0  # end-to-end seconds
    output_tokens: int = 0
    prompt_tokens: Optional[int] = None
    num_chunks: int = 0  # content chunks received
    generated_text: str = ""
    start_time: float = 0.0  # seconds since the benchmark started
    end_time: float = 0.0
    expected_output_len: int = 0

    @property
    def tpot(self) -> Optional[float]:
        if not self.success or self.ttft is None or self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


# A fixed vocabulary of common English words: random-word prompts (no tokenizer) stay readable and
# roughly one token per word for most BPE tokenizers.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her she there been one all we their has would when if so no what can out "
    "other into more some time could them than these two may first then do any like my now over "
    "such our man me even most made after also did many before must through years where much your "
    "way well down should because each just those people how too little state good very make world "
    "still own see men work long get here between both life being under never day same another know "
    "while last might us great old year off come since against go came right used take three small "
    "house water light place city river mountain garden window table book letter music paper story "
    "number question answer system model server token cache memory network signal value market price"
).split()


def _length_range(length: int, ratio: float) -> tuple[int, int]:
    """Inclusive integer bounds of a length drawn uniformly from ``[ratio * length, length]``."""
    hi = max(1, int(length))
    lo = max(1, min(hi, int(math.ceil(ratio * hi))))
    return lo, hi


def _load_tokenizer(path: Optional[str]):
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=True)


def _random_token_prompt(tokenizer, length: int, rng: random.Random, allowed: Sequence[int]) -> tuple[str, int]:
    """Random token ids decoded to text, re-encoded to exactly ``length`` tokens where possible."""
    ids = [rng.choice(allowed) for _ in range(length)]
    text = tokenizer.decode(ids)
    n = len(tokenizer.encode(text, add_special_tokens=False))
    for _ in range(16):  # decode/encode does not round-trip exactly (merges); trim or extend
        if n == length:
            break
        ids = tokenizer.encode(text, add_special_tokens=False)
        if n > length:
            ids = ids[:length]
        else:
            ids = ids + [rng.choice(allowed) for _ in range(length - n)]
        text = tokenizer.decode(ids)
        n = len(tokenizer.encode(text, add_special_tokens=False))
    return text, n


def sample_random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.5,
    seed: int = 1,
    tokenizer: Any = None,
) -> list[RequestInput]:
    """``num_prompts`` random prompts; input/output lengths uniform in ``[ratio * len, len]``.

    With a tokenizer (object or local path) the prompt is random token ids (special tokens excluded)
    decoded to text, with ``prompt_len`` its token length; without, it is ``input_len`` random words
    and ``prompt_len`` is None (the server's usage reports it).
    """
    if isinstance(tokenizer, str):
        tokenizer = _load_tokenizer(tokenizer)
    rng = random.Random(seed)
    in_lo, in_hi = _length_range(input_len, range_ratio)
    out_lo, out_hi = _length_range(output_len, range_ratio)
    allowed: list[int] = []
    if tokenizer is not None:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        allowed = [i for i in range(len(tokenizer)) if i not in special]
    reqs = []
    for i in range(num_prompts):
        n_in = rng.randint(in_lo, in_hi)
        n_out = rng.randint(out_lo, out_hi)
        if tokenizer is not None:
            prompt, plen = _random_token_prompt(tokenizer, n_in, rng, allowed)
        else:
            prompt, plen = " ".join(rng.choice(_WORDS) for _ in range(n_in)), None
        reqs.append(RequestInput(prompt=prompt, prompt_len=plen, output_len=n_out))
    return reqs


def load_fixture_requests(
    path: str,
    num_prompts: int,
    output_len: int,
    tokenizer: Any = None,
) -> list[RequestInput]:
    """Requests from a jsonl file of ``{"prompt": ...}`` or GSM8K-style ``{"question": ...}`` records.

    A record's own ``max_tokens`` / ``output_len`` overrides ``output_len``. GSM8K questions are sent
    as ``"Question: ...\\nAnswer:"``. Records are taken in file order and repeated when the file has
    fewer than ``num_prompts``.
    """
    if isinstance(tokenizer, str):
        tokenizer = _load_tokenizer(tokenizer)
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if isinstance(rec, str):
                rec = {"prompt": rec}
            if "prompt" in rec:
                prompt = rec["prompt"]
            elif "question" in rec:
                prompt = f"Question: {rec['question']}\nAnswer:"
            else:
                raise ValueError(f"{path}:{lineno}: record has neither 'prompt' nor 'question'")
            n_out = int(rec.get("max_tokens", rec.get("output_len", output_len)))
            plen = len(tokenizer.encode(prompt, add_special_tokens=False)) if tokenizer is not None else None
            records.append(RequestInput(prompt=str(prompt), prompt_len=plen, output_len=n_out))
    if not records:
        raise ValueError(f"{path}: no records")
    return [records[i % len(records)] for i in range(num_prompts)]


# --------------------------------------------------------------------------------------------------
# Client
# --------------------------------------------------------------------------------------------------


def _headers(api_key: Optional[str]) -> dict[str, str]:
    h = {"Content-Type": "application/json"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


async def get_default_model(client, base_url: str, api_key: Optional[str] = None) -> str:
    """First model id from ``GET /v1/models``."""
    r = await client.get(f"{base_url.rstrip('/')}/v1/models", headers=_headers(api_key))
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no models")
    return data[0]["id"]


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    text = c.get("text")
    if text is None:  # chat-style delta, for servers that answer completions that way
        text = (c.get("delta") or {}).get("content")
    return text or ""


async def send_request(
    client,
    url: str,
    model: str,
    req: RequestInput,
    api_key: Optional[str] = None,
    extra_body: Optional[dict] = None,
    tokenizer: Any = None,
    t_origin: float = 0.0,
) -> RequestOutput:
    """One streaming ``/v1/completions`` request; never raises (errors land in the output)."""
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if extra_body:
        body.update(extra_body)
    out = RequestOutput(expected_output_len=req.output_len, prompt_tokens=req.prompt_len)
    usage: Optional[dict] = None
    texts: list[str] = []
    st = time.perf_counter()
    out.start_time = st - t_origin
    last = st
    try:
        async with client.stream("POST", url, json=body, headers=_headers(api_key)) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                msg = (await resp.aread()).decode("utf-8", "replace")
                out.error = f"HTTP {resp.status_code}: {msg[:500]}"
            else:
                done = False
                async for line in resp.aiter_lines():
                    line = line.strip()
                    if not line or line.startswith(":"):
                        continue
                    if not line.startswith("data:"):
                        continue
                    payload = line[len("data:"):].strip()
                    if payload == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk and not chunk.get("choices"):
                        err = chunk["error"]
                        out.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                        break
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    text = _chunk_text(chunk)
                    if text:
                        now = time.perf_counter()
                        if out.ttft is None:
                            out.ttft = now - st
                        else:
                            out.itl.append(now - last)
                        last = now
                        texts.append(text)
                if not out.error:
                    if done:
                        out.success = True
                    else:
                        out.error = "stream ended without data: [DONE]"
    except Exception as e:  # noqa: BLE001 -- connection errors, timeouts, bad JSON: a failed request
        out.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    end = time.perf_counter()
    out.latency = end - st
    out.end_time = end - t_origin
    out.num_chunks = len(texts)
    out.generated_text = "".join(texts)
    if usage and usage.get("completion_tokens") is not None:
        out.output_tokens = int(usage["completion_tokens"])
    elif tokenizer is not None and out.generated_text:
        out.output_tokens = len(tokenizer.encode(out.generated_text, add_special_tokens=False))
    else:
        out.output_tokens = len(texts)
    if usage and usage.get("prompt_tokens") is not None:
        out.prompt_tokens = int(usage["prompt_tokens"])
    return out


async def _arrivals(n: int, request_rate: float, seed: int):
    """Yield 0..n-1, sleeping exponential (Poisson-process) gaps between them; none for rate inf."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield i
        if i == n - 1 or math.isinf(request_rate) or request_rate <= 0:
            continue
        await asyncio.sleep(float(rng.exponential(1.0 / request_rate)))


def _build_requests(args, tokenizer) -> list[RequestInput]:
    if args.dataset_name == "random":
        return sample_random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                                      args.random_range_ratio, args.seed, tokenizer)
    if args.dataset_name == "fixture":
        if not args.dataset_path:
            raise SystemExit("--dataset-name fixture needs --dataset-path")
        return load_fixture_requests(args.dataset_path, args.num_prompts, args.random_output_len, tokenizer)
    raise SystemExit(f"unknown --dataset-name {args.dataset_name!r}")


async def run_benchmark(args, requests: Optional[list[RequestInput]] = None) -> dict:
    """Run the benchmark described by ``args`` (see :func:`parse_args`); returns the result dict
    ``{"config": ..., "summary": summarize(...), "requests": [per-request records]}``."""
    import httpx
    from tqdm import tqdm

    tokenizer = _load_tokenizer(getattr(args, "tokenizer", None))
    if requests is None:
        requests = _build_requests(args, tokenizer)
    base_url = args.base_url.rstrip("/")
    url = f"{base_url}/v1/completions"
    extra_body = json.loads(args.extra_request_body) if getattr(args, "extra_request_body", None) else None
    cap = args.max_concurrency if args.max_concurrency and args.max_concurrency > 0 else None
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap or 256)
    timeout = httpx.Timeout(args.request_timeout) if args.request_timeout else httpx.Timeout(None)

    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        model = args.model or await get_default_model(client, base_url, args.api_key)

        for i in range(getattr(args, "warmup_requests", 0) or 0):
            w = await send_request(client, url, model, RequestInput(requests[0].prompt, requests[0].prompt_len,
                                                                    min(requests[0].output_len, 16)),
                                   args.api_key, extra_body, tokenizer)
            if not w.success:
                raise RuntimeError(f"warm-up request failed: {w.error}")

        sem = asyncio.Semaphore(cap) if cap else None
        in_flight = 0
        max_in_flight = 0
        pbar = tqdm(total=len(requests), disable=args.disable_tqdm, desc="requests")
        t0 = time.perf_counter()

        async def one(req: RequestInput) -> RequestOutput:
            nonlocal in_flight, max_in_flight
            if sem is not None:
                await sem.acquire()
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
            try:
                return await send_request(client, url, model, req, args.api_key, extra_body, tokenizer, t0)
            finally:
                in_flight -= 1
                if sem is not None:
                    sem.release()
                pbar.update(1)

        tasks = []
        async for i in _arrivals(len(requests), args.request_rate, args.seed):
            tasks.append(asyncio.create_task(one(requests[i])))
        outputs: list[RequestOutput] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        pbar.close()

    summary = summarize(outputs, duration=duration, max_in_flight=max_in_flight)
    config = {
        "base_url": base_url, "model": model, "dataset_name": args.dataset_name,
        "dataset_path": args.dataset_path, "num_prompts": len(requests),
        "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": cap, "seed": args.seed, "tokenizer": args.tokenizer,
        "extra_request_body": extra_body, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    recs = []
    for o in outputs:
        d = asdict(o)
        d["tpot"] = o.tpot
        if not args.keep_generated_text:
            d.pop("generated_text")
        recs.append(d)
    return {"config": config, "summary": summary, "requests": recs}


# --------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------

STAT_METRICS = ("ttft", "tpot", "itl", "e2e_latency")


def _stats(values: Sequence[float]) -> dict[str, Optional[float]]:
    """mean / median / p90 / p99 / std (population) of ``values`` in milliseconds (linear percentiles)."""
    if len(values) == 0:
        return {"mean": None, "median": None, "p90": None, "p99": None, "std": None}
    a = np.asarray(values, dtype=np.float64) * 1000.0
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "std": float(a.std())}


def _get(r: Any, key: str, default=None):
    return r.get(key, default) if isinstance(r, dict) else getattr(r, key, default)


def summarize(results: Iterable[Any], duration: Optional[float] = None,
              max_in_flight: Optional[int] = None) -> dict:
    """Aggregate per-request results (:class:`RequestOutput` or their dicts) into the summary.

    ``duration`` defaults to last end minus first start; ``concurrency`` is the mean number of
    requests in flight (sum of successful latencies / duration, as upstream reports it) and
    ``max_concurrency_observed`` the most in flight at once (given, or computed from start/end
    times). Latency statistics are over successful requests, in milliseconds; ITLs pool all gaps.
    TPOT is ``(e2e - ttft) / (output_tokens - 1)`` for requests with more than one output token.
    """
    results = list(results)
    ok = [r for r in results if _get(r, "success")]
    failed = [r for r in results if not _get(r, "success")]
    if duration is None:
        if results:
            duration = max(_get(r, "end_time", 0.0) for r in results) - min(_get(r, "start_time", 0.0) for r in results)
        else:
            duration = 0.0
    if max_in_flight is None:
        events = sorted([(_get(r, "start_time", 0.0), 1) for r in results]
                        + [(_get(r, "end_time", 0.0), -1) for r in results], key=lambda e: (e[0], e[1]))
        cur = max_in_flight = 0
        for _, d in events:
            cur += d
            max_in_flight = max(max_in_flight, cur)

    ttfts = [_get(r, "ttft") for r in ok if _get(r, "ttft") is not None]
    e2es = [_get(r, "latency") for r in ok]
    itls = [x for r in ok for x in (_get(r, "itl") or [])]
    tpots = []
    for r in ok:
        ttft, n = _get(r, "ttft"), _get(r, "output_tokens", 0)
        if ttft is not None and n > 1:
            tpots.append((_get(r, "latency") - ttft) / (n - 1))
    in_toks = sum(_get(r, "prompt_tokens") or 0 for r in ok)
    out_toks = sum(_get(r, "output_tokens") or 0 for r in ok)
    dur = duration if duration and duration > 0 else float("nan")

    errors: dict[str, int] = {}
    for r in failed:
        e = _get(r, "error") or "unknown error"
        errors[e] = errors.get(e, 0) + 1

    s: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(failed),
        "total_requests": len(results),
        "duration": duration,
        "total_input_tokens": in_toks,
        "total_output_tokens": out_toks,
        "input_tokens_known": all(_get(r, "prompt_tokens") is not None for r in ok),
        "request_throughput": len(ok) / dur,
        "input_throughput": in_toks / dur,
        "output_throughput": out_toks / dur,
        "total_throughput": (in_toks + out_toks) / dur,
    }
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2e_latency", e2es)):
        for stat, v in _stats(vals).items():
            s[f"{stat}_{name}_ms"] = v
    s["concurrency"] = sum(e2es) / dur
    s["max_concurrency_observed"] = max_in_flight
    s["errors"] = dict(sorted(errors.items(), key=lambda kv: -kv[1])[:10])
    for k, v in list(s.items()):  # JSON has no NaN
        if isinstance(v, float) and math.isnan(v):
            s[k] = None
    return s


def format_summary(result: dict) -> str:
    """A readable table of the summary (upstream-style)."""
    s, c = result["summary"], result.get("config", {})

    def fmt(v, spec="{:.2f}"):
        return "n/a" if v is None else spec.format(v) if isinstance(v, float) else str(v)

    rate = c.get("request_rate")
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]

    def row(k, v):
        lines.append("{:<44}{:>16}".format(k, v))

    row("Model:", str(c.get("model", "")))
    row("Dataset:", str(c.get("dataset_name", "")))
    row("Request rate (req/s):", "inf" if rate is None else fmt(float(rate)))
    row("Max request concurrency:", "not set" if c.get("max_concurrency") is None else str(c["max_concurrency"]))
    row("Successful requests:", str(s["completed"]))
    row("Failed requests:", str(s["failed"]))
    row("Benchmark duration (s):", fmt(s["duration"]))
    row("Total input tokens:", str(s["total_input_tokens"]))
    row("Total generated tokens:", str(s["total_output_tokens"]))
    row("Request throughput (req/s):", fmt(s["request_throughput"]))
    row("Input token throughput (tok/s):", fmt(s["input_throughput"]))
    row("Output token throughput (tok/s):", fmt(s["output_throughput"]))
    row("Total token throughput (tok/s):", fmt(s["total_throughput"]))
    row("Concurrency (mean in flight):", fmt(s["concurrency"]))
    row("Max concurrency observed:", str(s["max_concurrency_observed"]))
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-Token Latency", "e2e_latency": "End-to-End Latency"}
    for m in STAT_METRICS:
        lines.append("{s:{c}^60}".format(s=f" {titles[m]} ", c="-"))
        for stat in ("mean", "median", "p90", "p99", "std"):
            short = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e_latency": "E2E Latency"}[m]
            row(f"{stat.upper() if stat in ('p90', 'p99') else stat.capitalize()} {short} (ms):",
                fmt(s[f"{stat}_{m}_ms"]))
    if s.get("errors"):
        lines.append("{s:{c}^60}".format(s=" Errors ", c="-"))
        for e, n in s["errors"].items():
            lines.append(f"{n:>5} x {e[:200]}")
    lines.append("=" * 60)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------------


def plot(result: dict, path: str) -> str | None:
    """TTFT / E2E histograms, latency CDFs and a per-request timeline into a PNG at ``path``."""
    plt = import_pyplot(path)
    if plt is None:
        return None

    c, s = result.get("config", {}), result["summary"]
    reqs = result["requests"]
    ok = [r for r in reqs if r["success"]]
    bad = [r for r in reqs if not r["success"]]
    ttft = np.array([r["ttft"] for r in ok if r["ttft"] is not None]) * 1000.0
    e2e = np.array([r["latency"] for r in ok]) * 1000.0
    tpot = np.array([r["tpot"] for r in ok if r.get("tpot") is not None]) * 1000.0
    itl = np.array([x for r in ok for x in r["itl"]]) * 1000.0

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0, 0]
    both = np.concatenate([ttft, e2e])
    if both.size:  # shared bins so both distributions stay visible on one axis
        edges = np.linspace(0.0, float(both.max()) * 1.02 + 1e-9, 41)
        for arr, label, col in ((ttft, "TTFT", "tab:blue"), (e2e, "E2E", "tab:orange")):
            if arr.size:
                ax.hist(arr, bins=edges, alpha=0.6, label=label, color=col)
    ax.set_xlabel("ms"), ax.set_ylabel("requests"), ax.set_title("TTFT and E2E latency histograms")
    ax.legend()

    ax = axes[0, 1]
    for arr, label in ((ttft, "TTFT"), (e2e, "E2E"), (tpot, "TPOT"), (itl, "ITL")):
        if arr.size:
            xs = np.sort(arr)
            ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=label, drawstyle="steps-post")
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("ms"), ax.set_ylabel("fraction of requests (ITL: of gaps)"), ax.set_title("Latency CDFs")
    ax.grid(alpha=0.3), ax.legend()

    ax = axes[1, 0]
    if ok:
        st = np.array([r["start_time"] for r in ok])
        ax.scatter(st, e2e, s=12, label="E2E", color="tab:orange")
        ax.scatter(st, [r["ttft"] * 1000.0 if r["ttft"] is not None else np.nan for r in ok], s=12,
                   label="TTFT", color="tab:blue")
    if bad:
        ax.scatter([r["start_time"] for r in bad], [r["latency"] * 1000.0 for r in bad], s=18, marker="x",
                   color="tab:red", label="failed")
    ax.set_xlabel("request start (s since benchmark start)"), ax.set_ylabel("ms")
    ax.set_title("Per-request latency"), ax.legend()

    ax = axes[1, 1]
    if reqs:
        ts = sorted([(r["start_time"], 1) for r in reqs] + [(r["end_time"], -1) for r in reqs])
        xs, ys, cur = [0.0], [0], 0
        for t, d in ts:
            cur += d
            xs.append(t), ys.append(cur)
        ax.step(xs, ys, where="post", color="tab:green")
    ax.set_xlabel("s since benchmark start"), ax.set_ylabel("requests in flight")
    ax.set_title(f"Concurrency (mean {s['concurrency'] or 0:.2f}, max {s['max_concurrency_observed']})")

    rate = c.get("request_rate")
    fig.suptitle(
        f"{c.get('model', '')} @ {c.get('base_url', '')} | {c.get('dataset_name', '')} x{c.get('num_prompts', '')}"
        f" in {c.get('random_input_len', '')}/out {c.get('random_output_len', '')} (ratio {c.get('random_range_ratio', '')})"
        f" | rate {'inf' if rate is None else rate} req/s, max conc {c.get('max_concurrency') or 'none'}\n"
        f"{s['completed']} ok / {s['failed']} failed, {s['output_throughput'] or 0:.1f} out tok/s, "
        f"median TTFT {s['median_ttft_ms'] or 0:.1f} ms, median E2E {s['median_e2e_latency_ms'] or 0:.1f} ms",
        fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server URL (without /v1)")
    p.add_argument("--model", default=None, help="model name; default: first id of GET /v1/models")
    p.add_argument("--dataset-name", choices=["random", "fixture"], default="random", help="prompt source")
    p.add_argument("--dataset-path", default=None,
                   help='jsonl of {"prompt": ...} or GSM8K-style {"question": ...} (fixture dataset)')
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    p.add_argument("--random-input-len", type=int, default=128, help="max prompt length (tokens or words)")
    p.add_argument("--random-output-len", type=int, default=64,
                   help="output length (max_tokens); also the fixture default")
    p.add_argument("--random-range-ratio", type=float, default=0.5,
                   help="lengths uniform in [ratio * len, len]")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s with Poisson arrivals; inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--seed", type=int, default=1, help="prompt sampling and arrival-time seed")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token")
    p.add_argument("--tokenizer", default=None,
                   help="local HF tokenizer dir: exact-length random token prompts and local token counts")
    p.add_argument("--output-file", default=None,
                   help="write the results JSON here; default (as upstream): a file named after the run in the "
                        "current directory, bench_serving_<MMDD-HHMMSS>_<num prompts>_<input len>_<output len>.json")
    p.add_argument("--plot", default=None, help="PNG path; default: next to --output-file (.png)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--warmup-requests", type=int, default=1, help="untimed requests sent first")
    p.add_argument("--extra-request-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--request-timeout", type=float, default=None, help="per-request timeout (s); none by default")
    p.add_argument("--keep-generated-text", action="store_true", help="keep generated text in the JSON")
    return p


def default_output_file(args: argparse.Namespace) -> str:
    """Upstream writes the results even without --output-file: a name made of the run's shape."""
    stamp = time.strftime("%m%d-%H%M%S")
    return (f"bench_serving_{stamp}_{args.num_prompts}_{args.random_input_len}_"
            f"{args.random_output_len}.json")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    result = asyncio.run(run_benchmark(args))
    print(format_summary(result))
    if not args.output_file:
        args.output_file = default_output_file(args)
    if args.output_file:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_file)), exist_ok=True)
        with open(args.output_file, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"results: {args.output_file}")
    plot_path = args.plot or (os.path.splitext(args.output_file)[0] + ".png" if args.output_file else None)
    if plot_path and not args.no_plot:
        try:
            if plot(result, plot_path):
                print(f"plot: {plot_path}")
        except Exception:  # noqa: BLE001 -- a plotting failure must not lose the measurements
            traceback.print_exc()
    return result


if __name__ == "__main__":
    main()
