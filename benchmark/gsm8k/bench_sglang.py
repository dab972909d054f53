"""GSM8K few-shot accuracy against a running server (native /generate or OpenAI /v1/completions).

    python benchmark/gsm8k/bench_sglang.py --num-shots 5 --num-questions 200 --parallel 64 --port 30000
    python benchmark/gsm8k/bench_sglang.py --api openai --model default --api-key KEY --data-path test.jsonl

The data file is GSM8K-format jsonl ({"question", "answer"} per line, the answer ending in "#### N").
The first --num-shots lines are the few-shot examples; the next --num-questions lines are asked.
The prediction is the last number in the output (minus signs, "1,234", "3.50", "$5" and "42." are
handled), compared numerically with the label. Exit status 1 when every request failed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Sequence

import requests
from tqdm import tqdm

DEFAULT_DATA = Path(__file__).resolve().parent / "gsm8k_fixture.jsonl"
STOP = ["Question", "Assistant:", "<|separator|>"]

# A number not glued to a preceding word/digit/dot: optional "-" and "$" (either order), then
# either comma-grouped thousands ("12,345") or plain digits, then an optional decimal part.
# "42." keeps 42 (the fraction needs digits); "5-3" gives 3 (the "-" follows a digit).
_NUMBER = re.compile(r"(?<![\w.])(-)?\$?(-)?(\d{1,3}(?:,\d{3})+(?!\d)|\d+)(\.\d+)?")


def build_few_shot_prompt(examples: Sequence[dict[str, str]], k: int) -> str:
    """The first `k` examples as "Question: q\\nAnswer: a\\n\\n" blocks (upstream format)."""
    return "".join(f"Question: {e['question']}\nAnswer: {e['answer']}\n\n" for e in examples[:k])


def build_prompt(few_shot: str, question: str) -> str:
    return f"{few_shot}Question: {question}\nAnswer:"


def parse_answer_label(answer: str) -> float:
    """The number after the last "####" of a GSM8K answer (commas and "$" stripped)."""
    if "####" not in answer:
        raise ValueError(f"answer has no '####' line: {answer[-80:]!r}")
    return float(answer.rsplit("####", 1)[1].strip().replace(",", "").replace("$", "").rstrip("."))


def extract_last_number(text: str) -> float | None:
    """The last number in `text`, or None when there is none."""
    matches = list(_NUMBER.finditer(text.replace("\u2212", "-")))
    if not matches:
        return None
    m = matches[-1]
    value = float(m.group(3).replace(",", "") + (m.group(4) or ""))
    return -value if (m.group(1) or m.group(2)) else value


def is_correct(pred: float | None, label: float) -> bool:
    return pred is not None and abs(pred - label) <= 1e-6 * max(1.0, abs(label))


def score(preds: Sequence[float | None], labels: Sequence[float],
          failed: Sequence[bool] | None = None) -> dict[str, Any]:
    """Accuracy over all questions; invalid = answered without any number (failed requests are
    wrong but counted as errors, not as invalid)."""
    assert len(preds) == len(labels)
    failed = failed or [False] * len(preds)
    n = len(preds)
    correct = sum(is_correct(p, y) for p, y in zip(preds, labels))
    invalid = sum(p is None and not f for p, f in zip(preds, failed))
    return {"accuracy": correct / n if n else 0.0, "invalid": invalid / n if n else 0.0,
            "num_correct": correct, "num_invalid": invalid, "num_errors": sum(failed),
            "num_questions": n}


def load_jsonl(path: str | Path) -> list[dict[str, str]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _request(args: argparse.Namespace, url: str, prompt: str) -> tuple[str, int]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.api == "openai":
        body: dict[str, Any] = {"model": args.model, "prompt": prompt, "max_tokens": args.max_new_tokens,
                                "temperature": args.temperature, "stop": STOP}
    else:
        body = {"text": prompt, "sampling_params": {"temperature": args.temperature,
                                                    "max_new_tokens": args.max_new_tokens, "stop": STOP}}
    r = requests.post(url, json=body, headers=headers, timeout=args.timeout)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
    out = r.json()
    if args.api == "openai":
        return out["choices"][0]["text"], int(out.get("usage", {}).get("completion_tokens", 0))
    return out["text"], int(out.get("meta_info", {}).get("completion_tokens", 0))


def run(args: argparse.Namespace) -> dict[str, Any]:
    lines = load_jsonl(args.data_path)
    shots, asked = lines[:args.num_shots], lines[args.num_shots:args.num_shots + args.num_questions]
    if not asked:
        raise SystemExit(f"{args.data_path}: no questions left after {args.num_shots} shots")
    if len(asked) < args.num_questions:  # say so: the bundled fixture is small
        print(f"note: --num-questions {args.num_questions}, but {args.data_path} has only {len(asked)} questions "
              f"after the {args.num_shots} shots: asking {len(asked)} (use --data-path with the full GSM8K test "
              "set for more)", file=sys.stderr)
    few_shot = build_few_shot_prompt(shots, args.num_shots)
    labels = [parse_answer_label(x["answer"]) for x in asked]
    host = args.host if "://" in args.host else f"http://{args.host}"
    url = f"{host}:{args.port}" + ("/v1/completions" if args.api == "openai" else "/generate")

    n = len(asked)
    outputs: list[str | None] = [None] * n
    tokens = [0] * n
    errors: list[str | None] = [None] * n
    tic = time.perf_counter()
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        futs = {pool.submit(_request, args, url, build_prompt(few_shot, x["question"])): i
                for i, x in enumerate(asked)}
        for fut in tqdm(as_completed(futs), total=n, desc="gsm8k"):
            i = futs[fut]
            try:
                outputs[i], tokens[i] = fut.result()
            except Exception as e:  # noqa: BLE001 -- server/connection errors are counted, not fatal
                errors[i] = f"{type(e).__name__}: {e}"
    latency = time.perf_counter() - tic

    preds = [extract_last_number(o) if o is not None else None for o in outputs]
    res = score(preds, labels, [e is not None for e in errors])
    res.update(task="gsm8k", api=args.api, latency=latency, completion_tokens=sum(tokens),
               output_throughput=sum(tokens) / latency if latency > 0 else 0.0,
               num_shots=args.num_shots, parallel=args.parallel, data_path=str(args.data_path),
               first_error=next((e for e in errors if e), None))
    return res


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-shots", type=int, default=5)
    p.add_argument("--data-path", type=str, default=str(DEFAULT_DATA))
    p.add_argument("--num-questions", type=int, default=200)
    p.add_argument("--parallel", type=int, default=64)
    p.add_argument("--host", type=str, default="http://127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--api", choices=["generate", "openai"], default="generate")
    p.add_argument("--model", type=str, default="default", help="model name for --api openai")
    p.add_argument("--api-key", type=str, default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--result-file", type=str, default=None, help="append one JSON line of results")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    res = run(args)
    n = res["num_questions"]
    print(f"Accuracy: {res['accuracy']:.3f}")
    print(f"Invalid: {res['invalid']:.3f}")
    print(f"Latency: {res['latency']:.3f} s")
    print(f"Output throughput: {res['output_throughput']:.3f} token/s")
    print(f"Questions: {n}")
    if res["num_errors"]:
        print(f"Errors: {res['num_errors']}/{n} requests failed (first: {res['first_error']})")
    if args.result_file:
        with open(args.result_file, "a") as f:
            f.write(json.dumps(res) + "\n")
    return 1 if res["num_errors"] == n else 0


if __name__ == "__main__":
    sys.exit(main())
