"""Ready-made custom logit processors for tests (need --enable-custom-logit-processor).

`ScriptedTokensLogitProcessor` makes a random-weight model emit an exact token sequence, so the
server's parsers (reasoning, tool calls, structured outputs) can be tested end to end:

    from sglang.srt.testing.logit_processors import ScriptedTokensLogitProcessor, scripted_request
    body = {"text": "hi", **scripted_request(tokenizer.encode("<think>x</think>{...}"))}
    requests.post(url + "/generate", json=body)       # output_ids == the script, then EOS

or by hand: `"custom_logit_processor": ScriptedTokensLogitProcessor.to_str()` and
`sampling_params.custom_params = {"token_ids": [...]}` (optionally `"eos_token_id": N`).

Step i of a request (i = len(req.output_ids), the tokens it has generated so far) forces
token_ids[i]; once the script is out it forces EOS (`eos_token_id`, else the smallest of the
model's EOS ids). The index comes from the request, never from a counter in the processor, so it
is right in any batch, on every chunk of a chunked prefill (those samples are discarded) and after
a retraction (which keeps output_ids). Sampling settings do not matter: every other logit is -inf.
With ignore_eos the request runs to max_new_tokens, repeating EOS past the script.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor


class ScriptedTokensLogitProcessor(CustomLogitProcessor):
    def __call__(self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None) -> torch.Tensor:
        if not custom_param_list:
            return logits
        forced: list[int] = []
        rows: list[int] = []
        vocab = logits.shape[-1]
        for row, params in enumerate(custom_param_list):
            token = scripted_token(params)
            if token is None or not 0 <= token < vocab:
                continue
            rows.append(row)
            forced.append(token)
        if rows:
            r = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
            t = torch.tensor(forced, dtype=torch.int64).to(logits.device, non_blocking=True)
            logits[r] = float("-inf")
            logits[r, t] = 0.0
        return logits


def scripted_token(params: dict[str, Any] | None) -> int | None:
    """The token a request's params force now (None: leave its logits alone)."""
    if not params:
        return None
    req = params.get("__req__")
    script = params.get("token_ids") or []
    step = len(req.output_ids) if req is not None else 0
    if step < len(script):
        return int(script[step])
    eos = params.get("eos_token_id")
    if eos is None and req is not None and getattr(req, "eos_token_ids", None):
        eos = min(req.eos_token_ids)
    return None if eos is None else int(eos)


def scripted_request(token_ids: list[int], eos_token_id: int | None = None, **sampling: Any) -> dict[str, Any]:
    """The /generate body fields that make a request emit `token_ids` then EOS."""
    params: dict[str, Any] = {"token_ids": [int(t) for t in token_ids]}
    if eos_token_id is not None:
        params["eos_token_id"] = int(eos_token_id)
    sp = {"max_new_tokens": len(token_ids) + 1, **sampling, "custom_params": params}
    return {"custom_logit_processor": ScriptedTokensLogitProcessor.to_str(), "sampling_params": sp}
