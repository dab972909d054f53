"""Forced drafts for speculative decoding tests and benchmarks (EAGLEWorker.draft_override).

Random weights accept (almost) nothing, so the accept path is exercised by proposing the target's
own next tokens, known from a plain run: every draft right, every draft wrong (each token + 1), or
"mixed" (wrong where (tokens generated + draft index) % 3 == 1: a run must stop at its first wrong
draft). Every mode must still give plain decoding's output.
"""

from __future__ import annotations

import torch

FORCED_MODES = ("right", "wrong", "mixed")


def forced_drafts(targets: dict[tuple[int, ...], list[int]], mode: str, vocab: int = 1000):
    """A draft_override: `targets` maps a prompt (token ids) to plain decoding's output ids."""
    if mode not in FORCED_MODES:
        raise ValueError(f"mode {mode!r} is not one of {FORCED_MODES}")

    def wrong_at(k: int, j: int) -> bool:
        return mode == "wrong" or (mode == "mixed" and (k + j) % 3 == 1)

    def override(reqs, drafts: torch.Tensor, kv_lens: list[int]) -> torch.Tensor:
        """`kv_lens`: each request's committed KV length at this step (the host's output_ids lag
        behind a step in flight under overlap): it has output[k - 1] as its last token."""
        s = drafts.shape[1]
        rows = []
        for r, c in zip(reqs, kv_lens):
            k = c - len(r.origin_input_ids) + 1  # tokens generated before this step
            ahead = (targets[tuple(r.origin_input_ids)] + [5] * (s + 1))[k:k + s]
            rows.append([(t + 1) % vocab if wrong_at(k, j) else t for j, t in enumerate(ahead)])
        return torch.tensor(rows)

    return override
