"""Greedy decoding is batch-invariant at the default settings (issue 9 item 6): a prompt decoded
alone and the same prompt decoded among others give identical tokens. The cause of the old
divergence was the top-k: torch.topk over rows padded to the batch's longest request kept
different (exactly tied, FP8) keys depending on that width; the rule now is "ties keep the lower
position" (sgl_kernel.topk), and no kernel's reduction order depends on the batch."""

import os

import pytest
import torch

from sglang.srt.entrypoints.engine import Engine

DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 1000, (int(k),), generator=g).tolist() for k in torch.randint(20, 150, (n,), generator=g)]


@pytest.mark.parametrize("name,backend,n,new", [("tiny-deepseek-v32", "auto", 10, 48),
                                                 ("tiny-glm-moe-dsa", "auto", 10, 48),
                                                 ("tiny-deepseek-v32", "triton", 3, 6)])
def test_alone_equals_together(name, backend, n, new):
    """Default settings (FP8 index K, radix cache on), plus the Triton backends (interpreter on CPU)."""
    kw = {} if backend == "auto" else dict(nsa_prefill_backend=backend, nsa_decode_backend=backend,
                                           moe_runner_backend=backend)
    engine = Engine(model_path=f"builtin:{name}", device=DEVICE, random_seed=0, max_total_tokens=16384, **kw)
    prompts = _prompts(n, seed=3)
    sp = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
    together = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=sp)]
    for i, p in enumerate(prompts):
        assert engine.flush_cache()  # alone means no cached prefix from the batched run either
        assert engine.generate(input_ids=p, sampling_params=sp)["output_ids"] == together[i], i
