"""The transformers reference implementation, driven the way our tests and benchmarks need it.

transformers' DeepseekV32 / GlmMoeDsa classes are the oracle nobody here wrote; these helpers
only feed them (batch 1, no padding, eager attention) and read greedy tokens and logits.
"""

from __future__ import annotations

import os

import torch


def load_hf_reference(model_dir: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # use_kernels=False: transformers 5 kernelizes from the Hub by default and raises on a host
    # without the `kernels` package (the GPU container); the oracle is its plain torch code anyway
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager",
                                                 use_kernels=False)
    return model.eval()


@torch.no_grad()
def hf_prefill_logits(model, input_ids: list[int]) -> torch.Tensor:
    """[len(input_ids), V] fp32 logits of every position."""
    return model(torch.tensor([input_ids])).logits[0].float()


@torch.no_grad()
def hf_greedy_generate(model, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding with the reference KV cache: no EOS handling, no logits processors
    (transformers' generate() would ban EOS under min_new_tokens, which changes the argmax)."""
    out = model(torch.tensor([input_ids]), use_cache=True)
    past, tokens = out.past_key_values, []
    nxt = int(out.logits[0, -1].argmax())
    for _ in range(max_new_tokens):
        tokens.append(nxt)
        if len(tokens) == max_new_tokens:
            break
        out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = int(out.logits[0, -1].argmax())
    return tokens
