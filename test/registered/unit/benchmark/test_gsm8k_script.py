"""benchmark/gsm8k/bench_sglang.py: answer extraction, label parsing, prompt format, and end-to-end
runs against a stub HTTP server (native /generate and OpenAI /v1/completions) with known outputs.

The stub finds the asked question (the last "Question: ...\\nAnswer:" of the prompt) and answers
by its position among the fixture's test questions: i % 4 == 0 -> the reference answer text,
1 -> a wrong number, 2 -> no number, 3 -> the label written as "$1,234.00." (correct). Questions
listed in `fail` get HTTP 500.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[4]
SCRIPT = ROOT / "benchmark" / "gsm8k" / "bench_sglang.py"
FIXTURE = ROOT / "benchmark" / "gsm8k" / "gsm8k_fixture.jsonl"

_spec = importlib.util.spec_from_file_location("bench_gsm8k", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

LINES = [json.loads(x) for x in FIXTURE.read_text().splitlines() if x.strip()]
SHOTS = 5
TEST = LINES[SHOTS:]


def stub_output(i: int) -> str:
    label = bench.parse_answer_label(TEST[i]["answer"])
    return [TEST[i]["answer"], f"The answer is {label + 3:g}.", "I am not sure how to solve this.",
            f"So the total is ${label:,.2f}."][i % 4]


def expected(n: int, fail: frozenset[int] = frozenset()) -> tuple[int, int]:
    correct = sum(i % 4 in (0, 3) and i not in fail for i in range(n))
    invalid = sum(i % 4 == 2 and i not in fail for i in range(n))
    return correct, invalid


class Stub:
    def __init__(self, fail: frozenset[int] = frozenset(), fail_all: bool = False) -> None:
        self.requests: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        index = {x["question"]: i for i, x in enumerate(TEST)}
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append((self.path, dict(self.headers), body))
                prompt = body.get("text", body.get("prompt", ""))
                q = prompt.rsplit("Question: ", 1)[1].removesuffix("\nAnswer:")
                i = index.get(q)
                if fail_all or i is None or i in fail or self.path not in ("/generate", "/v1/completions"):
                    return self._send(500, {"error": "boom"})
                text = stub_output(i)
                ntok = len(text.split())
                if self.path == "/generate":
                    self._send(200, {"text": text, "meta_info": {"completion_tokens": ntok, "prompt_tokens": 1}})
                else:
                    self._send(200, {"choices": [{"text": text, "index": 0}],
                                     "usage": {"completion_tokens": ntok, "prompt_tokens": 1}})

            def _send(self, code: int, obj: dict[str, Any]) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Stub":
        self.thread.start()
        return self

    def __exit__(self, *a: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub() -> Iterator[Stub]:
    with Stub() as s:
        yield s


def run_script(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


# ---------------------------------------------------------------- extraction / parsing / prompt

@pytest.mark.parametrize("text,want", [
    ("The answer is 42", 42), ("The answer is 42.", 42), ("is 42!", 42), ("(42)", 42), ("42?\n", 42),
    ("It was -7 degrees.", -7), ("-7", -7), ("x = -3.5", -3.5), ("a loss of -$650.", -650),
    ("balance: $-23", -23), ("\u22125", -5),
    ("1,234", 1234), ("There are 1,234,567 stars.", 1234567), ("$12,000.50 total", 12000.5),
    ("3.50", 3.5), ("It costs $3.50.", 3.5), ("0.75 cups", 0.75), ("He paid $5", 5),
    ("10 - 3 = 7", 7), ("5-3", 3), ("first 3 then 4, finally 12", 12), ("1, 2, 3", 3),
    ("#### 1,630", 1630), ("so 2 * 3 = <<2*3=6>>6 apples", 6), ("12kg of flour", 12),
    ("1,2345", 2345), ("room abc123 is 8", 8), ("the answer is 9 not mp3", 9),
])
def test_extract_last_number(text: str, want: float) -> None:
    assert bench.extract_last_number(text) == pytest.approx(want, abs=0)


@pytest.mark.parametrize("text", ["", "no digits here", "mp3 and b2b", "- . , $", "v2x"])
def test_extract_no_number(text: str) -> None:
    assert bench.extract_last_number(text) is None


def test_parse_answer_label() -> None:
    assert bench.parse_answer_label("3 * 4 = <<3*4=12>>12\n#### 12") == 12
    assert bench.parse_answer_label("... #### 1,630") == 1630
    assert bench.parse_answer_label("#### -7") == -7
    assert bench.parse_answer_label("#### 6.75\n") == 6.75
    assert bench.parse_answer_label("#### $15,000") == 15000
    with pytest.raises(ValueError):
        bench.parse_answer_label("no label")


def test_fixture_labels() -> None:
    labels = [bench.parse_answer_label(x["answer"]) for x in LINES]
    assert len(LINES) >= 30 and all(set(x) == {"question", "answer"} for x in LINES)
    assert any(y < 0 for y in labels) and any(y != int(y) for y in labels) and any(y >= 1000 for y in labels)
    # The reference answer's last number is its label, so the reference text scores as correct.
    assert all(bench.extract_last_number(x["answer"]) == y for x, y in zip(LINES, labels))


def test_few_shot_prompt() -> None:
    ex = [{"question": "q1?", "answer": "a1\n#### 1"}, {"question": "q2?", "answer": "a2\n#### 2"},
          {"question": "q3?", "answer": "#### 3"}]
    fs = bench.build_few_shot_prompt(ex, 2)
    assert fs == "Question: q1?\nAnswer: a1\n#### 1\n\nQuestion: q2?\nAnswer: a2\n#### 2\n\n"
    assert bench.build_few_shot_prompt(ex, 0) == ""
    assert bench.build_prompt(fs, "q3?") == fs + "Question: q3?\nAnswer:"


def test_score() -> None:
    r = bench.score([1.0, 2.0, None, 3.5000000001, None, -4.0], [1, 3, 5, 3.5, 7, -4], [False] * 4 + [True, False])
    assert (r["num_correct"], r["num_invalid"], r["num_errors"], r["num_questions"]) == (3, 1, 1, 6)
    assert r["accuracy"] == pytest.approx(0.5) and r["invalid"] == pytest.approx(1 / 6)
    assert bench.score([], [])["accuracy"] == 0.0


# ---------------------------------------------------------------- end to end

def test_run_generate(stub: Stub) -> None:
    n = 12
    args = bench.parse_args(["--port", str(stub.port), "--num-questions", str(n), "--parallel", "4",
                             "--max-new-tokens", "64", "--temperature", "0.5"])
    res = bench.run(args)
    correct, invalid = expected(n)
    assert (res["num_correct"], res["num_invalid"], res["num_errors"], res["num_questions"]) == (correct, invalid, 0, n)
    assert res["accuracy"] == pytest.approx(correct / n) and res["invalid"] == pytest.approx(invalid / n)
    assert res["completion_tokens"] == sum(len(stub_output(i).split()) for i in range(n))
    assert res["output_throughput"] > 0 and res["latency"] > 0

    assert len(stub.requests) == n
    few_shot = bench.build_few_shot_prompt(LINES, SHOTS)
    prompts = set()
    for path, headers, body in stub.requests:
        assert path == "/generate" and "Authorization" not in headers
        assert body["sampling_params"] == {"temperature": 0.5, "max_new_tokens": 64,
                                           "stop": ["Question", "Assistant:", "<|separator|>"]}
        assert body["text"].startswith(few_shot) and body["text"].endswith("\nAnswer:")
        prompts.add(body["text"])
    assert prompts == {bench.build_prompt(few_shot, x["question"]) for x in TEST[:n]}


def test_script_openai_result_file_api_key(stub: Stub, tmp_path: Path) -> None:
    out = tmp_path / "res.jsonl"
    out.write_text('{"previous": 1}\n')
    p = run_script("--api", "openai", "--model", "my-model", "--api-key", "sekrit", "--port", str(stub.port),
                   "--host", "127.0.0.1", "--num-questions", "1000", "--parallel", "8", "--result-file", str(out))
    assert p.returncode == 0, p.stderr
    n = len(TEST)  # capped at what the file has after the shots
    correct, invalid = expected(n)
    assert f"Accuracy: {correct / n:.3f}" in p.stdout and f"Invalid: {invalid / n:.3f}" in p.stdout
    assert f"Questions: {n}" in p.stdout and "Latency:" in p.stdout and "Output throughput:" in p.stdout
    assert "gsm8k" in p.stderr  # tqdm bar
    assert f"--num-questions 1000, but" in p.stderr and f"asking {n}" in p.stderr  # the cap is said

    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows[0] == {"previous": 1} and len(rows) == 2
    r = rows[1]
    assert (r["num_correct"], r["num_invalid"], r["num_errors"], r["num_questions"]) == (correct, invalid, 0, n)
    assert r["accuracy"] == pytest.approx(correct / n) and r["api"] == "openai" and r["task"] == "gsm8k"
    assert r["completion_tokens"] == sum(len(stub_output(i).split()) for i in range(n))

    assert len(stub.requests) == n
    for path, headers, body in stub.requests:
        assert path == "/v1/completions" and headers["Authorization"] == "Bearer sekrit"
        assert body["model"] == "my-model" and body["max_tokens"] == 512 and body["temperature"] == 0
        assert body["stop"] == ["Question", "Assistant:", "<|separator|>"] and body["prompt"].endswith("\nAnswer:")


def test_partial_failures_counted() -> None:
    n, fail = 8, frozenset({0, 2})
    with Stub(fail=fail) as s:
        p = run_script("--port", str(s.port), "--num-questions", str(n), "--num-shots", str(SHOTS))
    assert p.returncode == 0, p.stderr
    correct, invalid = expected(n, fail)
    assert f"Accuracy: {correct / n:.3f}" in p.stdout and f"Invalid: {invalid / n:.3f}" in p.stdout
    assert "Errors: 2/8 requests failed" in p.stdout and "HTTP 500" in p.stdout


def test_all_failed_exits_nonzero(tmp_path: Path) -> None:
    with Stub(fail_all=True) as s:
        p = run_script("--port", str(s.port), "--num-questions", "4")
    assert p.returncode != 0 and "Errors: 4/4" in p.stdout and "HTTP 500" in p.stdout
    # Nothing listening: connection errors are counted too.
    with Stub() as s:
        port = s.port
    p = run_script("--port", str(port), "--num-questions", "3", "--result-file", str(tmp_path / "r.jsonl"))
    assert p.returncode != 0 and "Errors: 3/3" in p.stdout and "ConnectionError" in p.stdout
    assert json.loads((tmp_path / "r.jsonl").read_text())["num_errors"] == 3
