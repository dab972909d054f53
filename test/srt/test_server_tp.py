"""Tensor parallelism over real processes (gloo on CPU; the same code uses NCCL on GPUs):
two ranks give the same greedy tokens as one."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sglang.srt.testing.server import ServerProcess

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Long context " * 40, "x"]


def _gen(url: str, prompt: str) -> dict:
    return requests.post(url + "/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}, timeout=300).json()


@pytest.mark.parametrize("model", ["builtin:tiny-deepseek-v32", "builtin:tiny-glm-moe-dsa"])
def test_tp2_equals_tp1(model):
    args = ("--max-total-tokens", "4096", "--random-seed", "0")
    with ServerProcess(model, *args) as s1:
        ref = [_gen(s1.base_url, p)["output_ids"] for p in PROMPTS]
    with ServerProcess(model, *args, "--tp-size", "2") as s2:
        with ThreadPoolExecutor(4) as pool:
            got = [r["output_ids"] for r in pool.map(lambda p: _gen(s2.base_url, p), PROMPTS)]
        st = s2.wait_idle()
    assert got == ref
    assert st["kv_protected_tokens"] == 0 and st["kv_leak"] is None
