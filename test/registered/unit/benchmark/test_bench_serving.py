"""benchmark/serving/bench_serving.py against an in-process stub OpenAI-compatible streaming server
(FastAPI + uvicorn in a thread): counts, TTFT/ITL/E2E vs the stub's known delays, request-rate and
max-concurrency, JSON + PNG output, and `summarize` statistics on synthetic inputs. CPU, fast."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

# Server deps are package requirements: a missing one must fail here, not skip.
import httpx  # noqa: F401
import uvicorn
from fastapi import FastAPI, Request  # module level: annotations are strings here
from fastapi.responses import JSONResponse, StreamingResponse

_BENCH = Path(__file__).resolve().parents[4] / "benchmark" / "serving" / "bench_serving.py"
_spec = importlib.util.spec_from_file_location("bench_serving", _BENCH)
bs = sys.modules.setdefault("bench_serving", importlib.util.module_from_spec(_spec))  # dataclasses need it
_spec.loader.exec_module(bs)

TTFT_DELAY = 0.08  # stub: seconds before the first content chunk
ITL_DELAY = 0.01  # stub: seconds between content chunks
MODEL_ID = "stub-model"


# --------------------------------------------------------------------------------------------------
# Stub server
# --------------------------------------------------------------------------------------------------


class StubState:
    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        with self.lock:
            self.in_flight = 0
            self.max_in_flight = 0
            self.arrivals: list[float] = []
            self.bodies: list[dict] = []
            self.auth: list[str | None] = []

    def enter(self, body, auth):
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.arrivals.append(time.perf_counter())
            self.bodies.append(body)
            self.auth.append(auth)

    def leave(self):
        with self.lock:
            self.in_flight -= 1


def make_app(state: StubState):
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}, {"id": "other", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt = body["prompt"]
        state.enter(body, request.headers.get("authorization"))
        if "FAIL" in prompt:
            await asyncio.sleep(0.01)
            state.leave()
            return JSONResponse({"error": {"message": "stub failure", "code": 500}}, status_code=500)
        n = int(body["max_tokens"])
        with_usage = "NOUSAGE" not in prompt and (body.get("stream_options") or {}).get("include_usage")

        async def gen():
            try:
                for i in range(n):
                    await asyncio.sleep(TTFT_DELAY if i == 0 else ITL_DELAY)
                    chunk = {"id": "c", "object": "text_completion", "model": MODEL_ID,
                             "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                # a trailing empty-text chunk (finish reason) must not count as a token
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}) + "\n\n"
                if with_usage:
                    usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n,
                             "total_tokens": len(prompt.split()) + n}
                    yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.leave()

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stub():
    state = StubState()
    port = _free_port()
    config = uvicorn.Config(make_app(state), host="127.0.0.1", port=port, log_level="error", lifespan="off")
    server = uvicorn.Server(config)
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.time() + 120  # a busy 2-core machine
    while not server.started:
        if time.time() > deadline or not th.is_alive():
            raise RuntimeError("stub server did not start")
        time.sleep(0.02)
    state.base_url = f"http://127.0.0.1:{port}"
    yield state
    server.should_exit = True
    th.join(timeout=5)


@pytest.fixture
def fresh(stub):
    stub.reset()
    return stub


def _args(base_url, *extra):
    return bs.parse_args(["--base-url", base_url, "--disable-tqdm", "--warmup-requests", "0", *extra])


def _write_fixture(path: Path, prompts: list[dict]) -> str:
    path.write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    return str(path)


# --------------------------------------------------------------------------------------------------
# summarize on synthetic inputs
# --------------------------------------------------------------------------------------------------


def _ro(ttft, latency, out, itl=(), ok=True, start=0.0, prompt=10, error=""):
    return bs.RequestOutput(success=ok, ttft=ttft, latency=latency, output_tokens=out, itl=list(itl),
                            start_time=start, end_time=start + latency, prompt_tokens=prompt, error=error)


def test_summarize_percentiles_and_throughput():
    # 10 successful requests: ttft 10..100 ms, latency 1.0..1.9 s, 11 output tokens each.
    ok = [_ro(0.01 * (i + 1), 1.0 + 0.1 * i, 11, itl=[0.001 * (i + 1)] * 2, start=0.1 * i) for i in range(10)]
    bad = [_ro(None, 0.5, 0, ok=False, error="HTTP 500: boom"), _ro(None, 0.2, 0, ok=False, error="HTTP 500: boom")]
    s = bs.summarize(ok + bad, duration=4.0)

    assert s["completed"] == 10 and s["failed"] == 2 and s["total_requests"] == 12
    assert s["errors"] == {"HTTP 500: boom": 2}
    ttft_ms = np.arange(1, 11) * 10.0
    # Linear-interpolated percentiles, worked by hand: p90 = 91, p99 = 99.1, median = 55.
    assert s["mean_ttft_ms"] == pytest.approx(55.0)
    assert s["median_ttft_ms"] == pytest.approx(55.0)
    assert s["p90_ttft_ms"] == pytest.approx(91.0)
    assert s["p99_ttft_ms"] == pytest.approx(99.1)
    assert s["std_ttft_ms"] == pytest.approx(float(np.std(ttft_ms)))  # population std
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(825.0))

    e2e_ms = 1000.0 + 100.0 * np.arange(10)
    assert s["mean_e2e_latency_ms"] == pytest.approx(1450.0)
    assert s["p90_e2e_latency_ms"] == pytest.approx(1810.0)
    assert s["p99_e2e_latency_ms"] == pytest.approx(float(np.percentile(e2e_ms, 99)))

    tpot_ms = (e2e_ms - ttft_ms) / 10.0  # (e2e - ttft) / (out - 1)
    assert s["mean_tpot_ms"] == pytest.approx(float(tpot_ms.mean()))
    assert s["median_tpot_ms"] == pytest.approx(float(np.median(tpot_ms)))

    itl_ms = np.repeat(np.arange(1, 11), 2).astype(float)  # ITL pools every gap of every request
    assert s["mean_itl_ms"] == pytest.approx(float(itl_ms.mean()))
    assert s["p99_itl_ms"] == pytest.approx(float(np.percentile(itl_ms, 99)))

    assert s["total_input_tokens"] == 100 and s["total_output_tokens"] == 110
    assert s["request_throughput"] == pytest.approx(10 / 4.0)
    assert s["input_throughput"] == pytest.approx(100 / 4.0)
    assert s["output_throughput"] == pytest.approx(110 / 4.0)
    assert s["concurrency"] == pytest.approx(float(e2e_ms.sum()) / 1000.0 / 4.0)
    # max in flight from start/end times: starts every 0.1 s, each lasts >= 1 s -> all 10 overlap at 0.9 s
    # (the failed ones, started at 0, are over by then).
    assert s["max_concurrency_observed"] == 10
    json.dumps(s, allow_nan=False)


def test_summarize_edge_cases():
    s = bs.summarize([])
    assert s["completed"] == 0 and s["mean_ttft_ms"] is None and s["request_throughput"] is None
    # single-token outputs have no TPOT; a single value has std 0 and every percentile equal to it
    s = bs.summarize([_ro(0.2, 0.2, 1)], duration=1.0)
    assert s["mean_tpot_ms"] is None
    assert s["p99_ttft_ms"] == pytest.approx(200.0) and s["std_ttft_ms"] == 0.0
    # dicts (as in the JSON) work too; duration defaults to last end - first start
    recs = [dict(success=True, ttft=0.1, latency=1.0, output_tokens=5, itl=[0.2] * 4, start_time=0.0,
                 end_time=1.0, prompt_tokens=3),
            dict(success=True, ttft=0.1, latency=1.0, output_tokens=5, itl=[0.2] * 4, start_time=1.0,
                 end_time=2.0, prompt_tokens=3)]
    s = bs.summarize(recs)
    assert s["duration"] == pytest.approx(2.0) and s["max_concurrency_observed"] == 1
    assert s["mean_tpot_ms"] == pytest.approx(225.0)


# --------------------------------------------------------------------------------------------------
# datasets
# --------------------------------------------------------------------------------------------------


def test_sample_random_requests_words():
    reqs = bs.sample_random_requests(200, 40, 20, range_ratio=0.5, seed=3)
    assert len(reqs) == 200
    ins = [len(r.prompt.split()) for r in reqs]
    outs = [r.output_len for r in reqs]
    assert min(ins) >= 20 and max(ins) <= 40 and min(outs) >= 10 and max(outs) <= 20
    assert len(set(ins)) > 5 and len(set(outs)) > 5  # actually spread over the range
    assert all(r.prompt_len is None for r in reqs)  # no tokenizer: the server's usage counts
    again = bs.sample_random_requests(200, 40, 20, range_ratio=0.5, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    exact = bs.sample_random_requests(10, 16, 8, range_ratio=1.0, seed=0)
    assert all(len(r.prompt.split()) == 16 and r.output_len == 8 for r in exact)


def test_sample_random_requests_tokenizer(tmp_path):
    from sglang.srt.model_loader.tiny_models import build_tokenizer

    tok = build_tokenizer(str(tmp_path / "tok"))
    reqs = bs.sample_random_requests(12, 48, 8, range_ratio=0.5, seed=0, tokenizer=str(tmp_path / "tok"))
    for r in reqs:
        assert 24 <= r.prompt_len <= 48
        assert len(tok.encode(r.prompt, add_special_tokens=False)) == r.prompt_len


def test_load_fixture_requests(tmp_path):
    p = _write_fixture(tmp_path / "f.jsonl", [{"prompt": "hello there"}, {"question": "What is 2+2?", "answer": "4"},
                                              {"prompt": "x", "max_tokens": 3}])
    reqs = bs.load_fixture_requests(p, 5, output_len=7)
    assert [r.prompt for r in reqs] == ["hello there", "Question: What is 2+2?\nAnswer:", "x", "hello there",
                                        "Question: What is 2+2?\nAnswer:"]
    assert [r.output_len for r in reqs] == [7, 7, 3, 7, 7]
    bad = _write_fixture(tmp_path / "bad.jsonl", [{"text": "no prompt"}])
    with pytest.raises(ValueError):
        bs.load_fixture_requests(bad, 1, 4)


# --------------------------------------------------------------------------------------------------
# end to end against the stub
# --------------------------------------------------------------------------------------------------


def test_end_to_end_counts_latencies_and_files(fresh, tmp_path):
    prompts = [{"prompt": f"request number {i}" + (" FAIL" if i % 4 == 3 else "")} for i in range(12)]
    fixture = _write_fixture(tmp_path / "p.jsonl", prompts)
    out_json = tmp_path / "res" / "bench.json"
    n_out = 10
    result = bs.main(["--base-url", fresh.base_url, "--dataset-name", "fixture", "--dataset-path", fixture,
                      "--num-prompts", "12", "--random-output-len", str(n_out), "--disable-tqdm",
                      "--output-file", str(out_json), "--api-key", "sk-test", "--warmup-requests", "1"])
    s = result["summary"]
    assert s["completed"] == 9 and s["failed"] == 3
    assert list(s["errors"]) and all(e.startswith("HTTP 500") and "stub failure" in e for e in s["errors"])
    fails = [r for r in result["requests"] if not r["success"]]
    assert all(r["status"] == 500 for r in fails)

    # default model from GET /v1/models; the request body as specified; the bearer token sent
    assert result["config"]["model"] == MODEL_ID
    body = fresh.bodies[-1]
    assert body["model"] == MODEL_ID and body["stream"] is True and body["temperature"] == 0
    assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}
    assert {b["max_tokens"] for b in fresh.bodies[1:]} == {n_out}  # [0] is the warm-up
    assert len(fresh.bodies) == 13 and all(a == "Bearer sk-test" for a in fresh.auth)

    ok = [r for r in result["requests"] if r["success"]]
    for r in ok:
        assert r["output_tokens"] == n_out and r["num_chunks"] == n_out  # usage.completion_tokens
        assert r["prompt_tokens"] == 3  # usage.prompt_tokens (stub counts words)
        assert TTFT_DELAY * 0.9 <= r["ttft"] <= TTFT_DELAY + 1.0
        assert len(r["itl"]) == n_out - 1
        assert r["latency"] >= r["ttft"] + (n_out - 1) * ITL_DELAY * 0.9
        assert r["latency"] <= TTFT_DELAY + n_out * ITL_DELAY + 2.0
    assert s["total_output_tokens"] == 9 * n_out and s["total_input_tokens"] == 27
    assert TTFT_DELAY * 0.9 <= s["median_ttft_ms"] / 1000 <= TTFT_DELAY + 1.0
    assert ITL_DELAY * 0.8 <= s["median_itl_ms"] / 1000 <= ITL_DELAY + 0.1
    assert ITL_DELAY * 0.8 <= s["median_tpot_ms"] / 1000 <= ITL_DELAY + 0.1
    assert s["median_e2e_latency_ms"] / 1000 >= TTFT_DELAY + (n_out - 1) * ITL_DELAY * 0.9
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration"])
    # request rate inf: all sent at once
    assert s["max_concurrency_observed"] >= 6

    # JSON and PNG (default: next to the JSON)
    saved = json.loads(out_json.read_text())
    assert set(saved) == {"config", "summary", "requests"} and len(saved["requests"]) == 12
    assert saved["summary"]["completed"] == 9
    png = out_json.with_suffix(".png")
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_no_usage_falls_back_to_chunk_count(fresh):
    reqs = [bs.RequestInput("plain NOUSAGE prompt", None, 6), bs.RequestInput("with usage", None, 4)]
    args = _args(fresh.base_url, "--model", MODEL_ID)
    result = asyncio.run(bs.run_benchmark(args, requests=reqs))
    r0, r1 = result["requests"]
    assert r0["success"] and r0["output_tokens"] == 6 and r0["prompt_tokens"] is None
    assert r1["success"] and r1["output_tokens"] == 4 and r1["prompt_tokens"] == 2
    assert result["summary"]["input_tokens_known"] is False


def test_max_concurrency_is_honoured(fresh):
    cap = 3
    args = _args(fresh.base_url, "--num-prompts", "12", "--random-input-len", "8", "--random-output-len", "4",
                 "--random-range-ratio", "1.0", "--max-concurrency", str(cap))
    result = asyncio.run(bs.run_benchmark(args))
    s = result["summary"]
    assert s["completed"] == 12 and s["failed"] == 0
    assert s["max_concurrency_observed"] <= cap and fresh.max_in_flight <= cap
    assert s["max_concurrency_observed"] == cap  # and the cap is actually reached
    # 12 requests, 3 at a time, each >= TTFT + 3 ITL: at least 4 waves
    assert s["duration"] >= 4 * (TTFT_DELAY + 3 * ITL_DELAY) * 0.9
    assert result["config"]["max_concurrency"] == cap


def test_request_rate_is_honoured(fresh):
    rate, n = 20.0, 16
    args = _args(fresh.base_url, "--num-prompts", str(n), "--random-input-len", "8", "--random-output-len", "2",
                 "--random-range-ratio", "1.0", "--request-rate", str(rate), "--seed", "7")
    result = asyncio.run(bs.run_benchmark(args))
    assert result["summary"]["completed"] == n
    # the Poisson gaps the client draws (same seed, same generator)
    gaps = np.random.default_rng(7).exponential(1.0 / rate, size=n - 1)
    starts = sorted(r["start_time"] for r in result["requests"])
    spread = starts[-1] - starts[0]
    assert spread >= gaps.sum() * 0.95 and spread <= gaps.sum() + 1.0
    arrivals = sorted(fresh.arrivals)
    assert arrivals[-1] - arrivals[0] >= gaps.sum() * 0.9
    assert result["config"]["request_rate"] == rate

    # rate inf: all requests go out at once
    fresh.reset()
    args = _args(fresh.base_url, "--num-prompts", "8", "--random-input-len", "8", "--random-output-len", "2")
    result = asyncio.run(bs.run_benchmark(args))
    starts = sorted(r["start_time"] for r in result["requests"])
    assert starts[-1] - starts[0] < TTFT_DELAY
    assert result["summary"]["max_concurrency_observed"] == 8


def test_connection_error_is_a_failed_request():
    port = _free_port()  # nothing listens there
    args = _args(f"http://127.0.0.1:{port}", "--model", "m", "--num-prompts", "3", "--random-input-len", "4",
                 "--random-output-len", "2")
    result = asyncio.run(bs.run_benchmark(args))
    s = result["summary"]
    assert s["completed"] == 0 and s["failed"] == 3 and s["mean_ttft_ms"] is None
    assert all(r["status"] is None and r["error"] for r in result["requests"])
    text = bs.format_summary(result)
    assert "Failed requests:" in text and "n/a" in text


def test_results_json_written_without_output_file(fresh, tmp_path, monkeypatch):
    """As upstream: no --output-file still writes the results, named after the run, in the cwd."""
    monkeypatch.chdir(tmp_path)
    fixture = _write_fixture(tmp_path / "p.jsonl", [{"prompt": f"request {i}"} for i in range(3)])
    bs.main(["--base-url", fresh.base_url, "--dataset-name", "fixture", "--dataset-path", fixture,
             "--num-prompts", "3", "--random-output-len", "4", "--disable-tqdm", "--no-plot", "--api-key", "sk-test"])
    (out,) = tmp_path.glob("bench_serving_*_3_128_4.json")
    assert json.loads(out.read_text())["summary"]["completed"] == 3
